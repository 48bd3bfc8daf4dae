"""The GRPO recipe data-parallel with FSDP2: `tune run --nproc_per_node 2` on CPU (gloo).
dualkv on and off agree at every step; a resumed 2-process run continues exactly."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUNE = str(Path(sys.executable).parent / "tune")


def tune_run(out: Path, *overrides: str) -> list[dict]:
    """Run the tiny config on 2 processes; the per-step metrics DiskLogger wrote."""
    cmd = [TUNE, "run", "--nproc_per_node", "2", "recipes/grpo_full_finetune.py", "--config",
           "recipes/configs/tiny_grpo.yaml", f"output_dir={out}",
           "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
           f"metric_logger.log_dir={out}/logs", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
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
        for key in ("loss", "kl", "grad_norm"):
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
    assert re.search(r"groups_per_step=4 must split into 2 rank", proc.stdout + proc.stderr)
