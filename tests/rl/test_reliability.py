"""What a new user runs into, through the public entry points only (the recipe via `tune run`,
optimize, pack, the CLI): typos and impossible values are refused before anything runs, with
the key, the closest known key and where it came from; no run loses or silently replaces a
checkpoint; unsupported models and configs are refused up front; bad inputs are named."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.testing import make_batch, tiny_model

ROOT = Path(__file__).resolve().parents[2]
TUNE = str(Path(sys.executable).parent / "tune")
CONFIG = ROOT / "recipes" / "configs" / "tiny_grpo.yaml"


def tune(*args, config=CONFIG, wait=True, timeout=300):
    cmd = [TUNE, "run", "recipes/grpo_full_finetune.py", "--config", str(config), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


# ---- strict configuration ------------------------------------------------------------------
def test_typos_and_impossible_values_are_refused_before_anything_runs(tmp_path):
    bad = ["dualkv.enabeld=false", "num_stepz=3", "num_steps=abc", "groups_per_step=0",
           "group_size=1", "model.num_layerz=3", "optimizer.lrr=0.1", "temperature=0"]
    if not torch.cuda.is_available():
        bad.append("device=cuda")
    proc = tune(f"output_dir={tmp_path / 'run'}", *bad)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = errors(proc)
    expect = {
        "dualkv.enabeld": "did you mean 'enabled'", "num_stepz": "did you mean 'num_steps'",
        "num_steps": "'abc' is not an integer", "groups_per_step": "0 must be >= 1",
        "group_size": "group of one has advantage 0", "model.num_layerz": "'num_layers'",
        "optimizer.lrr": "did you mean 'lr'", "temperature": "0 must be a finite number >= 1e-05",
    }
    if not torch.cuda.is_available():
        expect["device"] = "torch.cuda.is_available() is False"
    for key, message in expect.items():
        hits = [x for x in lines if x.startswith(f"error: {key} (command-line override")]
        assert hits and message in hits[0], (key, lines)
    assert len(lines) == len(expect), lines
    assert not (tmp_path / "run").exists()  # nothing ran


def test_optional_sections_may_be_left_out_or_null_and_choices_are_checked(tmp_path):
    config = tmp_path / "mine.yaml"
    text = re.sub(r"^overlong:.*$", "", CONFIG.read_text(), flags=re.M)
    assert "overlong:" not in text
    config.write_text(text)
    proc = tune(f"output_dir={tmp_path / 'run'}", "num_steps=1", "checkpointer=null",
                "save_final_checkpoint=false", config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = tune(f"output_dir={tmp_path / 'run2'}", "dualkv.attention_backend=flsh")
    assert proc.returncode == 2 and "dualkv.attention_backend (command-line override" in (
        errors(proc)[0]) and "'flsh' is not one of" in errors(proc)[0]


def test_an_unknown_key_in_the_file_names_the_file(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text(CONFIG.read_text() + "learning_rate: 0.1\n")
    proc = tune(f"output_dir={tmp_path / 'run'}", config=config)
    assert proc.returncode == 2
    assert errors(proc) == [f"error: learning_rate ({config}): unknown key; known keys: "
                            + errors(proc)[0].split("known keys: ")[1]]


# ---- no lost work ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped by SIGINT after a few steps, save_every=0: (its output_dir, process)."""
    out = tmp_path_factory.mktemp("stopped")
    proc = tune(f"output_dir={out}", "num_steps=300", "save_every=0",
                "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
                f"metric_logger.log_dir={out}/logs", wait=False)
    deadline = time.time() + 240
    while time.time() < deadline:  # until two steps are logged
        logs = list((out / "logs").glob("*.txt")) if (out / "logs").exists() else []
        if logs and logs[0].read_text().count("Step ") >= 2:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    return out, proc.returncode, output


def test_sigint_finishes_the_step_and_writes_a_checkpoint(stopped_run):
    out, code, output = stopped_run
    assert code == 128 + signal.SIGINT, output[-2000:]
    assert "stopped by signal 2 after step" in output
    step = torch.load(out / "checkpoint.pt", weights_only=False)["step"]
    assert 2 <= step < 300


def test_a_checkpoint_is_neither_replaced_nor_resumed_past_its_end(stopped_run, tmp_path):
    out, _, _ = stopped_run
    before = (out / "checkpoint.pt").read_bytes()
    step = torch.load(out / "checkpoint.pt", weights_only=False)["step"]
    proc = tune(f"output_dir={out}", "num_steps=2")
    assert proc.returncode == 2
    assert "holds a checkpoint" in errors(proc)[0] and "overwrite_output_dir=true" in errors(proc)[0]
    proc = tune(f"output_dir={out}", f"num_steps={step}", "resume_from_checkpoint=true")
    assert proc.returncode == 2
    assert f"num_steps={step}: the checkpoint" in errors(proc)[0]
    assert f"at step {step} already" in errors(proc)[0]
    assert (out / "checkpoint.pt").read_bytes() == before
    proc = tune(f"output_dir={out}", f"num_steps={step + 1}", "resume_from_checkpoint=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == step + 1


@pytest.mark.parametrize("content,message", [
    (b"not a zip archive at all", "is not a readable checkpoint"),
    (None, "is not a checkpoint of this recipe"),
])
def test_corrupt_or_foreign_checkpoints_are_named_and_left_untouched(tmp_path, content, message):
    path = tmp_path / "checkpoint.pt"
    if content is None:
        torch.save({"weights": torch.zeros(2)}, path)
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    proc = tune(f"output_dir={tmp_path}", "resume_from_checkpoint=true", "num_steps=3")
    assert proc.returncode == 2
    assert str(path) in errors(proc)[0] and message in errors(proc)[0], errors(proc)
    assert "left untouched" in errors(proc)[0] and path.read_bytes() == before


# ---- optimize() refuses up front ------------------------------------------------------------
def test_models_optimize_cannot_run_are_refused_by_name():
    import transformers as tf

    bert = tf.BertModel(tf.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match=r"BertModel \(model_type='bert'\): BERT is a "
                                         r"bidirectional encoder.*Supported:"):
        dk.optimize(bert)
    base = tf.Qwen3Model(tf.Qwen3Config(vocab_size=50, hidden_size=16, head_dim=4,
                                        intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="Qwen3Model has none"):
        dk.optimize(base)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="GPT-2's learned absolute position embeddings"):
        dk.optimize(gpt2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU model")
@pytest.mark.parametrize("config,message", [
    (dict(backend="inductor"), "backend='inductor' cannot run this model on cpu"),
    (dict(attention_backend="flash"), "attention_backend='flash' is a CUDA kernel"),
])
def test_configs_that_cannot_run_on_the_device_are_refused_at_construction(config, message):
    with pytest.raises(ValueError, match=message):
        dk.optimize(tiny_model("qwen2_5"), dk.DualKVConfig(**config))


# ---- inputs ---------------------------------------------------------------------------------
def test_inputs_are_named():
    model = tiny_model("hf_qwen3").double()
    tokens, mask, p = make_batch([5, 3], [[4, 2], [3]], vocab=90,
                                 generator=torch.Generator().manual_seed(0))
    wrapper = dk.optimize(model)
    want = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    # a 0-d integer tensor is an int; an integer 0/1 mask is a mask, here as in the wrapper
    same = wrapper.response_logprobs(tokens, prompt_len=torch.tensor(p),
                                     padding_mask=mask.long())
    assert torch.equal(same, want)
    wrapper(tokens, attention_mask=mask.long(), prompt_len=p)
    with pytest.raises(ValueError, match=r"prompt_len=2.5 must be an integer"):
        dk.pack(tokens, prompt_len=2.5)
    with pytest.raises(ValueError, match=r"padding_mask must hold only 0 and 1.*\[2\]"):
        wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask.long() * 2)
    with pytest.raises(ValueError, match=r"padding_mask must hold only 0 and 1.*\[2\]"):
        wrapper(tokens, attention_mask=mask.long() * 2, prompt_len=p)
    bad = tokens.clone()
    bad[0, -1] = 500
    with pytest.raises(ValueError, match=r"tokens hold id 500, outside the model's vocabulary "
                                         r"\[0, 101\)"):
        wrapper.response_logprobs(bad, prompt_len=p, padding_mask=mask)


def test_the_mask_command_refuses_a_drawing_it_cannot_finish():
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "dualkv_compile.tools", "mask", "--groups", "64",
                           "--group-size", "64", "-P", "32768", "-R", "4096", "--out",
                           "/tmp/never.png"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and time.time() - t0 < 60
    assert "18,874,368 tokens" in proc.stderr and "bounded at 4096 blocks" in proc.stderr


def test_importing_the_library_prints_no_third_party_noise():
    proc = subprocess.run([sys.executable, "-c", "import dualkv_compile, torchtune, torchao"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == "", proc.stderr


def test_tune_run_prints_no_torchao_line_before_our_code_runs():
    # `tune` imports torchtune (and with it torchao) before it loads the recipe; the .pth file
    # the install writes filters torchao's line at interpreter start.
    proc = subprocess.run([sys.executable, "-c", "import torchtune._cli.tune"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == "", proc.stderr


@pytest.mark.parametrize("override,message", [
    ("loss.aggregation=dr_grpo", "error: loss: ValueError: aggregation='dr_grpo' must be one of"),
    # annotated parameters are checked by the config check, by name (exit 2 before the run)
    ("optimizer.lr=abc", "error: optimizer.lr (command-line override 'optimizer.lr=abc'): "
                         "'abc' is not a number"),
    ("loss.kl_coef=.nan", "error: loss.kl_coef (command-line override 'loss.kl_coef=.nan'): "
                          "nan is not a number (NaN)"),  # YAML's NaN
    ("model.embed_dim=-64", "error: model: ValueError: embed_dim=-64 must be an integer >= 1"),
    # settings the built model cannot run: refused before the first step, not in it
    ("dualkv.attention_backend=triton", "error: dualkv: attention_backend='triton' is a CUDA "
                                        "kernel and the model is on cpu"),
    ("max_generated_tokens=300", "error: max_generated_tokens=300: with prompts of up to 8 "
                                 "tokens it exceeds the model's context of 256"),
    ("model.vocab_size=5", "error: model: its vocabulary holds 5 ids, the tokenizer's 12"),
    ("tokenizer.alphabet=abcdefgh", "error: task: ValueError: the tokenizer's alphabet "
                                    "'abcdefgh' lacks ':', which ends every prompt"),
    # more packed lengths than the wrapper's recompile limit: once the run's fatal error
    ("max_tokens_per_micro_batch=100000", "error: dualkv.bucket_growth=1.0: micro-batches of "
                                          "2-100000 packed tokens (max_tokens_per_micro_batch="
                                          "100000) can take 782 packed lengths, each up to 2 "
                                          "compiles of the model, over the 256 Dynamo allows"),
    # these were tracebacks (ValueError: Overflow when unpacking long long; IndexError)
    ("seed=99999999999999999999", "error: seed (command-line override "
                                  "'seed=99999999999999999999'): 99999999999999999999 must be in"),
    ("optimizer.betas=[0.9]", "error: optimizer: IndexError:"),
])
def test_a_value_a_component_refuses_is_a_config_error(tmp_path, override, message):
    proc = tune(f"output_dir={tmp_path / 'run'}", "num_steps=1", override)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert any(x.startswith(message) for x in errors(proc)), errors(proc)


def test_a_model_vocabulary_padded_past_the_tokenizers_runs(tmp_path):
    # real checkpoints pad their vocabulary to a round size: the random model samples ids
    # 12-15, which the character tokenizer has no character for (an IndexError in step 1)
    proc = tune(f"output_dir={tmp_path / 'run'}", "num_steps=1", "model.vocab_size=16",
                "save_final_checkpoint=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
