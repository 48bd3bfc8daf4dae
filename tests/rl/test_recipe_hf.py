"""The real-checkpoint config path on CPU: a tiny transformers Qwen3 checkpoint, its tokenizer
files and a JSONL math dataset, written here, run for two steps through the Qwen3-1.7B config."""

import json
from pathlib import Path

import pytest
import torch
import transformers as tf  # a test dependency
from omegaconf import OmegaConf

from dualkv_compile.rl import HFTokenizer, MathJSONLTask, final_number

from recipe_helpers import load_recipe, write_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def write_checkpoint(folder: Path, vocab: int, intermediate_size: int = 64) -> None:
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=intermediate_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)
    tf.Qwen3ForCausalLM._from_config(cfg).save_pretrained(folder, safe_serialization=True)


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "qwen3-tiny"
    write_tokenizer(folder)
    write_checkpoint(folder, len(HFTokenizer(str(folder))._tok))
    data = tmp_path / "train.jsonl"
    rows = [{"question": f"what is {a}+{b}?", "answer": f"#### {a + b}"}
            for a in range(3) for b in range(3)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return folder, data


def test_two_steps_through_the_qwen3_config(tmp_path, checkpoint):
    folder, data = checkpoint
    cfg = OmegaConf.load(ROOT / "recipes" / "configs" / "qwen3_1_7b_grpo.yaml")
    for key, value in {"checkpoint_dir": str(folder), "task.path": str(data), "device": "cpu",
                       "dtype": "fp32", "output_dir": str(tmp_path / "run"), "num_steps": 2,
                       "groups_per_step": 2, "group_size": 2, "max_generated_tokens": 6,
                       "micro_batch_groups": 1}.items():
        OmegaConf.update(cfg, key, value)
    recipe = load_recipe().GRPORecipe(cfg)
    recipe.setup()
    # the weights are the checkpoint's: our model equals transformers on them
    hf = tf.Qwen3ForCausalLM.from_pretrained(folder).eval()
    tokens = torch.randint(3, 40, (1, 9))
    pos = torch.arange(9)[None]
    with torch.no_grad():
        ours = recipe.model.eval()(tokens, input_pos=pos)
        torch.testing.assert_close(ours, hf(input_ids=tokens, position_ids=pos).logits,
                                   rtol=1e-4, atol=1e-4)
    recipe.model.train()
    recipe.train()
    recipe.cleanup()
    assert [h["step"] for h in recipe.history] == [1, 2]
    assert all(h["rho"] > 1 for h in recipe.history)  # left-padded prompts, shared per group
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    # the torchtune checkpointer wrote transformers-format weights transformers can load
    saved = tmp_path / "run" / "hf" / "epoch_2"
    assert (saved / "config.json").is_file() and (saved / "tokenizer.json").is_file()
    again = tf.Qwen3ForCausalLM.from_pretrained(saved).eval()
    with torch.no_grad():
        torch.testing.assert_close(recipe.model.eval()(tokens, input_pos=pos),
                                   again(input_ids=tokens, position_ids=pos).logits,
                                   rtol=1e-4, atol=1e-4)
    from dualkv_compile.models import Qwen3HFCheckpointer

    reread = Qwen3HFCheckpointer(str(saved), str(tmp_path / "unused")).load_checkpoint()["model"]
    for name, value in recipe.model.state_dict().items():  # exactly what the recipe held
        assert torch.equal(reread[name], value), name


def test_math_reward_and_padding(checkpoint):
    folder, data = checkpoint
    tok = HFTokenizer(str(folder))
    task = MathJSONLTask(tok, path=str(data), seed=1)
    prompts, answers = task.sample_prompts(4)
    assert (prompts[:, -1] != tok.pad_id).all()  # left-padded
    good = torch.tensor([tok.encode(f"so {answers[0]}", add_bos=False)])
    bad = torch.tensor([tok.encode("so 99", add_bos=False)])
    assert task.rewards(good, answers[:1]).tolist() == [1.0]
    assert task.rewards(bad, answers[:1]).tolist() == [0.0]
    assert final_number("a 1,200.0 b") == "1200" and final_number("none") is None


def test_the_longest_prompt_is_checked_against_the_context_before_the_first_step(
        tmp_path, checkpoint):
    from dualkv_compile.rl.recipe_config import ConfigError

    folder, data = checkpoint
    cfg = OmegaConf.load(ROOT / "recipes" / "configs" / "qwen3_1_7b_grpo.yaml")
    tok, template = HFTokenizer(str(folder)), cfg.task.prompt_template
    longest = max(len(tok.encode(template.format(question=f"what is {a}+{b}?")))
                  for a in range(3) for b in range(3))
    assert MathJSONLTask(tok, path=str(data), prompt_template=template).max_prompt_len == longest
    for key, value in {"checkpoint_dir": str(folder), "task.path": str(data), "device": "cpu",
                       "dtype": "fp32", "output_dir": str(tmp_path / "run"),
                       "max_generated_tokens": 512 - longest + 1}.items():  # context: 512
        OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError, match=f"with prompts of up to {longest} tokens it exceeds "
                                          f"the model's context of 512"):
        load_recipe().GRPORecipe(cfg).setup()


def test_two_runs_may_not_share_a_checkpointer_output_dir(tmp_path, checkpoint):
    # runs with their own output_dir but one checkpointer.output_dir both ran, and the later
    # one's epoch_N folders replaced the other's trained weights
    from dualkv_compile.rl.recipe_config import ConfigError

    folder, data = checkpoint
    recipes = []
    for name in ("a", "b"):
        cfg = OmegaConf.load(ROOT / "recipes" / "configs" / "qwen3_1_7b_grpo.yaml")
        for key, value in {"checkpoint_dir": str(folder), "task.path": str(data),
                           "device": "cpu", "dtype": "fp32", "output_dir": str(tmp_path / name),
                           "max_generated_tokens": 6,
                           "checkpointer.output_dir": str(tmp_path / "shared")}.items():
            OmegaConf.update(cfg, key, value)
        recipes.append(load_recipe().GRPORecipe(cfg))
    recipes[0].setup()
    try:
        with pytest.raises(ConfigError, match=r"checkpointer.output_dir=.*shared' is in use by "
                                              r"another run \(pid"):
            recipes[1].setup()
        assert not (tmp_path / "b").exists()  # the refused run left no folder
    finally:
        recipes[0].cleanup()
    recipes[1].setup()  # free again
    recipes[1].cleanup()
    # a checkpointer.output_dir inside another run's output_dir (its default ${output_dir}/hf)
    # is locked too: it was taken only where it lay outside the run's own output_dir
    inside = []
    for name, hf in (("c", None), ("d", tmp_path / "c" / "hf")):
        cfg = OmegaConf.load(ROOT / "recipes" / "configs" / "qwen3_1_7b_grpo.yaml")
        for key, value in {"checkpoint_dir": str(folder), "task.path": str(data),
                           "device": "cpu", "dtype": "fp32", "output_dir": str(tmp_path / name),
                           "max_generated_tokens": 6}.items():
            OmegaConf.update(cfg, key, value)
        if hf is not None:
            OmegaConf.update(cfg, "checkpointer.output_dir", str(hf))
        inside.append(load_recipe().GRPORecipe(cfg))
    inside[0].setup()
    try:
        with pytest.raises(ConfigError, match=r"checkpointer.output_dir=.*c/hf' is in use"):
            inside[1].setup()
    finally:
        inside[0].cleanup()


def test_a_failed_weight_export_is_written_again_by_the_resumed_run(tmp_path, checkpoint):
    # checkpoint.pt was written before the epoch_N folder: a crash or full disk between them
    # left a checkpoint at step N whose trained weights no folder held, and no resume wrote them
    from dualkv_compile.rl.run_guard import RunFailed

    folder, data = checkpoint

    def recipe(**more):
        cfg = OmegaConf.load(ROOT / "recipes" / "configs" / "qwen3_1_7b_grpo.yaml")
        for key, value in {"checkpoint_dir": str(folder), "task.path": str(data),
                           "device": "cpu", "dtype": "fp32", "output_dir": str(tmp_path / "run"),
                           "num_steps": 2, "save_every": 1, "groups_per_step": 2,
                           "group_size": 2, "max_generated_tokens": 6, "micro_batch_groups": 1,
                           **more}.items():
            OmegaConf.update(cfg, key, value)
        r = load_recipe().GRPORecipe(cfg)
        r.setup()
        return r

    first = recipe()
    export = first.checkpointer.save_checkpoint

    def full_disk_at_step_2(state, epoch):
        if epoch == 2:
            raise OSError(28, "No space left on device")
        return export(state, epoch)

    first.checkpointer.save_checkpoint = full_disk_at_step_2
    with pytest.raises(RunFailed, match="step 2: .*No space left"):
        first.train()
    first.cleanup(failed=True)
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"] == 1
    again = recipe(resume_from_checkpoint=True)
    again.train()
    again.cleanup()
    assert sorted(p.name for p in (tmp_path / "run" / "hf").glob("epoch_*")) == ["epoch_1",
                                                                                "epoch_2"]


def test_a_resume_must_build_the_checkpoints_model(tmp_path, checkpoint):
    # model.path and checkpoint_dir are locations: another model behind them resumed (same
    # shapes: an architecture the weights were not trained under) or failed with a traceback
    # (RuntimeError: size mismatch)
    from dualkv_compile.rl.recipe_config import ConfigError

    folder, data = checkpoint

    def recipe(source, **more):
        cfg = OmegaConf.load(ROOT / "recipes" / "configs" / "qwen3_1_7b_grpo.yaml")
        for key, value in {"checkpoint_dir": str(source), "task.path": str(data),
                           "device": "cpu", "dtype": "fp32", "output_dir": str(tmp_path / "run"),
                           "num_steps": 2, "groups_per_step": 2, "group_size": 2,
                           "max_generated_tokens": 6, "micro_batch_groups": 1,
                           **more}.items():
            OmegaConf.update(cfg, key, value)
        return load_recipe().GRPORecipe(cfg)

    first = recipe(folder, num_steps=1)
    first.setup()
    first.train()
    first.cleanup()
    config = json.loads((folder / "config.json").read_text())
    for change, message in [({"rope_theta": 1234.0}, r"config.json rope_theta: .* now"),
                            ({"intermediate_size": 48}, r"config.json intermediate_size: 64 "
                                                        r"when .* 48 now(.|\n)*mlp.*\(64, 32\) "
                                                        r"-> \(48, 32\)")]:
        other = tmp_path / f"other_{next(iter(change))}"
        other.mkdir()
        for f in folder.iterdir():
            (other / f.name).write_bytes(f.read_bytes())
        (other / "config.json").write_text(json.dumps({**config, **change}))
        if "intermediate_size" in change:
            write_checkpoint(other, len(HFTokenizer(str(folder))._tok), intermediate_size=48)
            (other / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=message):
            recipe(other, resume_from_checkpoint=True).setup()
    again = recipe(folder, resume_from_checkpoint=True)  # the same model resumes
    again.setup()
    again.cleanup()


def test_a_dataset_line_that_is_not_json_is_named(tmp_path, checkpoint):
    folder, _ = checkpoint
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", answer: 4}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not JSON"):
        MathJSONLTask(HFTokenizer(str(folder)), path=str(data))
    # an integer past Python's 4300 digits, or nesting past the recursion limit, in a field the
    # task does not read: a bare ValueError or RecursionError without the line
    good = '{"question": "1+1?", "answer": "2"}\n'
    for extra in ('"id": ' + "9" * 5000, '"meta": ' + "[" * 100000 + "]" * 100000):
        data.write_text(good + '{"question": "q", "answer": "5", ' + extra + "}\n")
        with pytest.raises(ValueError, match=r"bad.jsonl:2 is not JSON we read: "):
            MathJSONLTask(HFTokenizer(str(folder)), path=str(data))
    data.write_text(good)  # a draw of 0 prompts (a rank's need of 0) is [0, P]
    prompts, answers = MathJSONLTask(HFTokenizer(str(folder)), path=str(data)).sample_prompts(0)
    assert prompts.shape[0] == 0 and prompts.dim() == 2 and answers == []


def test_a_save_that_fails_midway_leaves_the_saved_folder_whole(tmp_path, checkpoint,
                                                                 monkeypatch):
    from dualkv_compile.models import Qwen3HFCheckpointer
    from dualkv_compile.models import checkpointer as module

    folder, _ = checkpoint
    out = tmp_path / "out"
    saver = Qwen3HFCheckpointer(str(folder), str(out))
    state = saver.load_checkpoint()
    first = saver.save_checkpoint(state, epoch=3)
    before = (first / "model.safetensors").read_bytes()

    def fails_midway(state, directory, rename=True):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "model.safetensors").write_bytes(b"half a file")
        raise OSError("No space left on device")

    with monkeypatch.context() as m:
        m.setattr(module, "write_hf_state", fails_midway)
        with pytest.raises(OSError, match="No space left"):
            saver.save_checkpoint(state, epoch=3)  # the same step again, as a resumed run does
    assert (first / "model.safetensors").read_bytes() == before
    saver.save_checkpoint(state, epoch=3)  # the next save replaces it and clears the leftovers
    assert sorted(p.name for p in out.iterdir()) == ["epoch_3"]
    assert (first / "model.safetensors").read_bytes() == before  # the same weights again


def _dataset(tmp_path, *rows):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(data)


@pytest.mark.parametrize("answer", ["yes", "", None, True, [1, 2], "\\sqrt{2}",
                                    "The answer is 4"])
def test_an_answer_without_a_number_is_refused_at_load(tmp_path, checkpoint, answer):
    # it loaded, and every response then scored 0
    folder, _ = checkpoint
    path = _dataset(tmp_path, {"question": "1+1?", "answer": "2"},
                    {"question": "2+2?", "answer": answer})
    with pytest.raises(ValueError, match=r"data.jsonl:2: answer .*(not one number|string or a number)"):
        MathJSONLTask(HFTokenizer(str(folder)), path=path)


def test_dataset_values_are_read_as_written(tmp_path, checkpoint):
    folder, _ = checkpoint
    tok = HFTokenizer(str(folder))
    # a JSON number 0.00001 (str() gives "1e-05"); a question holding U+2028, which
    # str.splitlines() took for a line end
    path = _dataset(tmp_path, {"question": "tiny?\u2028", "answer": 0.00001})
    task = MathJSONLTask(tok, path=path, prompt_template="{question} \\boxed{{}} please")
    prompts, answers = task.sample_prompts(1)
    assert answers == ["1/100000"]
    assert prompts[0].tolist() == tok.encode("tiny?\u2028 \\boxed{} please")  # {{}} is {}
    responses = torch.tensor([tok.encode(text, add_bos=False) + [tok.eos_id]
                              for text in ("0.00001", "-5.0000")])
    assert task.rewards(responses, answers * 2).tolist() == [1.0, 0.0]
    # a literal brace was an IndexError from inside the run, a misspelt field a KeyError
    for template in ("no placeholder", "{q}", "{question} \\boxed{}", "{question} }", 3):
        with pytest.raises(ValueError, match="only field is {question}"):
            MathJSONLTask(tok, path=path, prompt_template=template)
    with pytest.raises(ValueError, match=r"data.jsonl:1: question None must be a non-empty"):
        MathJSONLTask(tok, path=_dataset(tmp_path, {"question": None, "answer": "1"}))


@pytest.mark.parametrize("content,message", [
    (b"\x1f\x8b\x08\x00rest", "is gzip-compressed; MathJSONLTask reads plain UTF-8 JSONL"),
    (b"PAR1rest", "is a Parquet file"),
    (b'{"question": "1+1?", "answer": "2"}\n{"question": "caf\xe9?", "answer": "1"}\n',
     r"data.jsonl:2 is not UTF-8 \(invalid continuation byte at byte 17 of the line\)"),
])
def test_a_dataset_that_is_not_utf8_jsonl_is_named(tmp_path, checkpoint, content, message):
    # a UnicodeDecodeError with a byte offset, naming neither the file nor the line
    folder, _ = checkpoint
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        MathJSONLTask(HFTokenizer(str(folder)), path=str(data))


def test_a_byte_order_mark_and_a_directory(tmp_path, checkpoint):
    folder, _ = checkpoint
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'\xef\xbb\xbf{"question": "1+1?", "answer": "2"}\n')  # was refused
    assert MathJSONLTask(HFTokenizer(str(folder)), path=str(data)).answers == ["2"]
    with pytest.raises(IsADirectoryError, match="is a directory; path= takes a JSONL file"):
        MathJSONLTask(HFTokenizer(str(folder)), path=str(tmp_path))  # said "does not exist"


def test_a_resume_over_a_changed_dataset_says_so(tmp_path, checkpoint, caplog):
    # only the path was compared: other lines behind it changed the prompt order unsaid
    folder, _ = checkpoint
    tok = HFTokenizer(str(folder))
    path = _dataset(tmp_path, {"question": "1+1?", "answer": "2"})
    state = MathJSONLTask(tok, path=path).state_dict()
    MathJSONLTask(tok, path=path).load_state_dict(state)
    assert "changed since the checkpoint" not in caplog.text
    path = _dataset(tmp_path, {"question": "1+1?", "answer": "2"},
                    {"question": "2+3?", "answer": "5"})
    MathJSONLTask(tok, path=path).load_state_dict(state)
    assert "data.jsonl changed since the checkpoint was written" in caplog.text
