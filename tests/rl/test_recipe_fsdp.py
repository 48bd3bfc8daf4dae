"""The GRPO recipe data-parallel with FSDP2: `tune run --nproc_per_node 2` on CPU (gloo).
dualkv on and off agree at every step; a resumed 2-process run continues exactly."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUNE = str(Path(sys.executable).parent / "tune")


def tune_run(out: Path, *overrides: str, config="tiny_grpo.yaml", timeout=600,
             output: list | None = None) -> list[dict]:
    """Run a config on 2 processes; the per-step metrics DiskLogger wrote (and what the run
    printed appended to `output`)."""
    cmd = [TUNE, "run", "--nproc_per_node", "2", "recipes/grpo_full_finetune.py", "--config",
           f"recipes/configs/{config}", f"output_dir={out}",
           "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
           f"metric_logger.log_dir={out}/logs", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    if output is not None:
        output.append(proc.stdout + proc.stderr)
    rows = []
    for log in sorted((out / "logs").glob("*.txt")):
        for line in log.read_text().splitlines():
            step, _, rest = line.partition(" | ")
            values = dict(kv.split(":", 1) for kv in rest.split())
            rows.append({"step": int(step.split()[1]), **{k: float(v) for k, v in values.items()}})
    return rows


def close(a, b, rel=1e-5, floor=1e-6):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + floor


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp")
    return {"on": tune_run(base / "on", "num_steps=3"),
            "off": tune_run(base / "off", "num_steps=3", "dualkv.enabled=false"),
            "base": base}


def test_dualkv_on_and_off_agree_on_two_ranks(runs):
    on, off = runs["on"], runs["off"]
    assert [r["step"] for r in on] == [1, 2, 3] == [r["step"] for r in off]
    for a, b in zip(on, off):
        assert a["reward"] == b["reward"], (a, b)  # same rollouts
        for key in ("loss", "kl", "grad_norm", "response_logprob"):
            assert close(a[key], b[key]), (key, a, b)
        assert a["rho"] > 1.5 and a["grad_norm"] > 0


def test_two_rank_resume_continues_the_run(runs):
    out = runs["base"] / "resumed"
    tune_run(out, "num_steps=2")
    resumed = tune_run(out, "num_steps=3", "resume_from_checkpoint=true")
    last = [r for r in resumed if r["step"] == 3]
    assert last, resumed
    for key in ("reward", "loss", "kl", "grad_norm"):
        assert close(last[-1][key], runs["on"][2][key]), (key, last[-1], runs["on"][2])


def test_groups_must_split_over_ranks(tmp_path):
    cmd = [TUNE, "run", "--nproc_per_node", "2", "recipes/grpo_full_finetune.py", "--config",
           "recipes/configs/tiny_grpo.yaml", f"output_dir={tmp_path}", "groups_per_step=4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    # refused by the config check, before any rank builds anything
    assert re.search(r"error: groups_per_step \(command-line override 'groups_per_step=4'\): 4 "
                     r"must split into 2 rank\(s\)", proc.stdout + proc.stderr)


SHRUNK_1_7B = ["device=cpu", "dtype=fp32", "group_size=3", "max_generated_tokens=5",
               "tokenizer.vocab_size=300", "task.prompt_len=20", "model.vocab_size=300",
               "model.num_layers=2", "model.embed_dim=64", "model.num_heads=4",
               "model.num_kv_heads=2", "model.head_dim=16", "model.intermediate_dim=128",
               "model.max_seq_len=64"]


SHRUNK_30B_A3B = [x for x in SHRUNK_1_7B if not x.startswith("model.intermediate_dim")] + [
    "model.moe_intermediate_dim=32", "model.num_experts=4", "model.experts_per_token=2",
    "groups_per_step=4", "rollout_batch_rows=2"]


@pytest.mark.parametrize("config,extra", [
    ("qwen3_1_7b_shaped_fsdp.yaml", SHRUNK_1_7B),
    # the 8-GPU config: 2 groups a rank in one micro-batch, each group's 3 samples decoded 2 + 1
    ("qwen3_8b_shaped_8gpu.yaml", SHRUNK_1_7B + ["groups_per_step=4", "micro_batch_groups=2",
                                                 "rollout_batch_rows=2"]),
    # the 16-GPU MoE config (issue #27 item 6): the grouped expert op under FSDP2
    ("qwen3_30b_a3b_shaped_16gpu.yaml", SHRUNK_30B_A3B),
])
def test_multi_gpu_configs_shrunk_run_both_ways(tmp_path, config, extra):
    """The 2-GPU (issue #5), 8-GPU (issue #7) and 16-GPU MoE (issue #27) configs at CPU size on
    2 processes: same components, checkpointing and sharding; dualkv on and off agree."""
    on = tune_run(tmp_path / "on", *extra, config=config)
    off = tune_run(tmp_path / "off", *extra, "dualkv.enabled=false", config=config)
    assert [r["step"] for r in on] == [1, 2] == [r["step"] for r in off]
    for a, b in zip(on, off):
        for key in ("loss", "kl", "grad_norm", "response_logprob"):
            assert close(a[key], b[key]), (key, a, b)
        # a reward signal: groups whose samples all score alike have zero advantages and
        # zero gradients, and on/off would agree trivially
        assert a["grad_norm"] > 1e-3, a


def test_real_checkpoint_config_on_two_ranks(tmp_path):
    """The Qwen3 config that reads a local transformers checkpoint, sharded over 2 processes:
    it trains, and the weights it writes in transformers' format are the trained full state."""
    import json

    import torch
    import transformers as tf
    from recipe_helpers import write_tokenizer
    from test_recipe_hf import write_checkpoint

    from dualkv_compile.rl import HFTokenizer

    folder, data = tmp_path / "qwen3-tiny", tmp_path / "train.jsonl"
    write_tokenizer(folder)
    write_checkpoint(folder, len(HFTokenizer(str(folder))._tok))
    problems = [{"question": f"what is {a}+{b}?", "answer": f"#### {a + b}"}
                for a in range(3) for b in range(3)]
    data.write_text("\n".join(json.dumps(p) for p in problems))
    out = tmp_path / "run"
    rows = tune_run(out, f"checkpoint_dir={folder}", f"task.path={data}", "device=cpu",
                    "dtype=fp32", "num_steps=2", "groups_per_step=2", "group_size=2",
                    "max_generated_tokens=6", "micro_batch_groups=1",
                    config="qwen3_1_7b_grpo.yaml")
    assert [r["step"] for r in rows] == [1, 2]
    trained = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
    hf = tf.Qwen3ForCausalLM.from_pretrained(out / "hf" / "epoch_2")
    start = tf.Qwen3ForCausalLM.from_pretrained(folder)
    assert not torch.equal(hf.model.embed_tokens.weight, start.model.embed_tokens.weight)
    torch.testing.assert_close(hf.model.embed_tokens.weight, trained["tok_embeddings.weight"],
                               rtol=0, atol=0)


def test_dynamic_sampling_ranks_refill_different_amounts(tmp_path):
    """Sharded generation is collective: a rank that needs fewer rows (or none) in a refill
    round must still join the others' generate() calls, or the run hangs. Round 1: rank 0
    keeps 1 of its 2 groups, rank 1 none; round 2: rank 0 refills 1 group (1 call of 8 rows),
    rank 1 refills 2 (2 calls) and keeps 1; round 3: rank 0 is full, rank 1 refills 1."""
    rows = tune_run(tmp_path / "ds", "num_steps=1", "groups_per_step=4", "group_size=8",
                    "micro_batch_groups=1", "rollout_batch_rows=8", "dynamic_sampling=true",
                    "task._component_=tests.rank_dependent_task.RankDependentTask",
                    "task.group_size=8", timeout=300)
    (step,) = rows
    assert step["reward"] == 0.5  # every kept group: 0, 1, 0, 1, ...
    # sampled: rank 0 24 rows, 8 rewarded; rank 1 40 rows, 8 rewarded
    assert step["sampled_reward"] == 16 / 64
    assert step["grad_norm"] > 0


def test_dynamic_sampling_runs_on_when_one_rank_keeps_no_group(tmp_path):
    """Rank 1 finds no group with a reward signal in its 4 rounds, rank 0 keeps both of its
    own. The run stopped with a RuntimeError; now rank 1 trains on its last round's groups at
    weight 0 and the step is rank 0's groups alone (reward and normalisers over them)."""
    rows = tune_run(tmp_path / "silent", "num_steps=1", "groups_per_step=4", "group_size=8",
                    "micro_batch_groups=1", "rollout_batch_rows=8", "dynamic_sampling=true",
                    "task._component_=tests.rank_dependent_task.RankDependentTask",
                    "task.group_size=8", "task.plan=rank1_silent", timeout=300)
    (step,) = rows
    assert step["reward"] == 0.5  # rank 0's two groups: 0, 1, 0, 1, ...
    # sampled: rank 0 one round of 16 rows, 8 rewarded; rank 1 four rounds of 16 rows, none
    assert step["sampled_reward"] == 8 / 80
    assert step["grad_norm"] > 0



def test_a_filler_ranks_groups_add_no_update(tmp_path):
    """Rank 0 keeps one group, rank 1 none (it trains on fillers at weight 0). The number of
    updates counted the filler rank's two groups: with updates_per_step=2 the step ran a
    second update with no counted row anywhere, skipped with a warning about truncated
    responses, and its zeros halved the step's loss and grad_norm."""
    said = []
    rows = tune_run(tmp_path / "one", "num_steps=1", "groups_per_step=4", "group_size=8",
                    "micro_batch_groups=1", "rollout_batch_rows=8", "dynamic_sampling=true",
                    "updates_per_step=2",
                    "task._component_=tests.rank_dependent_task.RankDependentTask",
                    "task.group_size=8", "task.plan=rank0_one_rank1_silent", timeout=300,
                    output=said)
    (step,) = rows
    assert step["updates"] == 1 and step["grad_norm"] > 0
    assert "counts no response token" not in said[0], said[0][-3000:]


FULL_DISK_ON_RANK_0 = '''
import os
if os.environ.get("RANK") == "0":
    import torch
    _save = torch.save
    def _full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("checkpoint.tmp"):
            raise OSError(28, "No space left on device")
        return _save(obj, f, *args, **kwargs)
    torch.save = _full_disk
'''


# rank 1's grader returns NaN for one response
NAN_REWARD_ON_RANK_1 = '''
import os
if os.environ.get("RANK") == "1":
    from dualkv_compile.rl import recipe_rollouts
    _score = recipe_rollouts.RecipeRollouts._score
    def _nan(self, responses, answers, lengths):
        r = _score(self, responses, answers, lengths).clone()
        r[0] = float("nan")
        return r
    recipe_rollouts.RecipeRollouts._score = _nan
'''


def _full_disk_run(tmp_path, *overrides, hook_code=FULL_DISK_ON_RANK_0):
    """A 2-rank tiny run whose rank 0 cannot write its checkpoint (or with another
    sitecustomize `hook_code`): the `error: step` lines."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_code)
    cmd = [TUNE, "run", "--nproc_per_node", "2", "recipes/grpo_full_finetune.py", "--config",
           "recipes/configs/tiny_grpo.yaml", f"output_dir={tmp_path / 'run'}", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{hook}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if line.startswith("error: step")]
    assert proc.returncode != 0 and len(errors) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    return errors


def test_a_failed_periodic_save_on_two_ranks_ends_both_alike(tmp_path):
    # rank 0 named the full disk and exited; rank 1 went on into the next collective and died
    # with gloo's "Connection closed by peer"
    errors = _full_disk_run(tmp_path, "num_steps=3", "save_every=1")
    assert errors[0] == errors[1] and "No space left on device" in errors[0], errors


def test_a_grader_failing_on_one_rank_stops_both_with_the_step_before_saved(tmp_path):
    # rank 1 raised the NaN-reward error as a traceback; rank 0 died in the next collective
    # with gloo's "Connection closed by peer", not saying why
    errors = _full_disk_run(tmp_path, "num_steps=3", "save_every=0",
                            hook_code=NAN_REWARD_ON_RANK_1)
    saved = "; the weights of step 0 were saved in "
    assert all(e.startswith("error: step 1: ") and saved in e for e in errors), errors
    assert any("score() returned non-finite rewards for responses [0]" in e for e in errors)
    assert any("another rank refused its inputs" in e for e in errors), errors


def test_a_non_finite_gradient_on_two_ranks_ends_with_one_outcome(tmp_path):
    # rank 1 left at once saying the step before was saved, while rank 0's write failed (or
    # was still running when torchrun ended it), and each rank named its own share of the loss
    errors = _full_disk_run(tmp_path, "num_steps=8", "save_every=0", "optimizer.lr=1e3")
    assert errors[0] == errors[1], errors  # the same loss, and the same outcome of the save
    assert re.search(r"gradient norm is (nan|inf) .*; saving the weights of step \d failed too: "
                     r".*No space left on device", errors[0]), errors[0]


# rank 1's grader raises its own error
GRADER_ERROR_ON_RANK_1 = '''
import os
if os.environ.get("RANK") == "1":
    from dualkv_compile.rl import recipe_rollouts
    def _broken(self, responses, answers, lengths):
        raise KeyError("grader lost its table")
    recipe_rollouts.RecipeRollouts._score = _broken
'''


def test_a_grader_error_on_one_rank_keeps_its_traceback_and_both_save_the_step_before(tmp_path):
    # rank 0 raised BatchRefused and went into the save's collective while rank 1 left with
    # its traceback: torchrun ended rank 0, and the step before was not saved
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(GRADER_ERROR_ON_RANK_1)
    cmd = [TUNE, "run", "--nproc_per_node", "2", "recipes/grpo_full_finetune.py", "--config",
           "recipes/configs/tiny_grpo.yaml", f"output_dir={tmp_path / 'run'}", "num_steps=3",
           "save_every=0"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{hook}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    saved = "the weights of step 0 were saved in "
    assert re.search(r"error: step 1: scored_groups: another rank refused its inputs.*" + saved,
                     out), out[-3000:]
    assert "KeyError: 'grader lost its table'" in out and "step 1: " + saved in out, out[-3000:]
    assert "recipe_rollouts" in out  # rank 1's traceback, through the grader
    path = re.search(saved + r"(\S+) ", out).group(1)
    assert Path(path).is_file() and str(tmp_path / "run") in path, path
