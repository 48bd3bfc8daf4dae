"""optimize() on FSDP2-sharded models: two CPU processes (gloo) under torchrun run
tests/fsdp_worker.py; fp64 logprobs (with and without grad) and the gathered gradients of two
accumulated micro-batches match the unsharded model row by row; a sharded reference model shares
the policy's compiled graphs; the rollout engine samples the unsharded model's tokens and gathers
the weights once per rollout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-10


@pytest.fixture(scope="module")
def cases():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "tests" / "fsdp_worker.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    return {c["case"]: c for c in found}


@pytest.mark.parametrize("name", ["layers", "layers_checkpointed", "llama_layers", "root_only"])
def test_sharded_model_matches_unsharded(cases, name):
    case = cases[name]
    assert "error" not in case, case["error"]
    assert case["region"] == "layer"
    assert case["logprob_err"] < TOL and case["no_grad_err"] < TOL, case
    assert case["grad_err"] < TOL, case
    counters = case["counters"]
    # one layer graph per grad mode, reused by both layers
    assert counters["graphs_compiled"] == 2 and counters["attention_rewritten"] == 2, counters
    assert counters.get("dense_fallback", 0) == 0
    assert counters.get("checkpoints_inlined", 0) == (2 if name == "layers_checkpointed" else 0)


def test_disabled_wrapper_runs_the_sharded_model(cases):
    case = cases["disabled"]
    assert "error" not in case, case["error"]
    assert case["logprob_err"] < TOL and case["grad_err"] < TOL, case
    assert case["counters"].get("graphs_compiled", 0) == 0


def test_model_region_refuses_a_sharded_model(cases):
    assert "compile_region='model' cannot drive an FSDP2-sharded model" in cases["model_region"]["error"]


def test_a_sharded_reference_shares_the_policys_graphs(cases):
    case = cases["shared_reference"]
    assert "error" not in case, case["error"]
    assert case["policy_err"] < TOL and case["ref_err"] < TOL, case
    assert case["counters"]["graphs_compiled"] == 1, case["counters"]  # one no-grad layer graph


def test_rollout_engine_gathers_the_weights_once_per_rollout(cases):
    case = cases["rollout"]
    assert "error" not in case, case["error"]
    assert case["same_tokens"] and case["resharded"], case
    # one all-gather per sharded module (2 layers + the root), for 3 and for 11 decode steps
    assert case["gathers_short"] == case["gathers_long"] == 3, case


def test_token_budget_micro_batches_match_one_micro_batch_on_two_ranks(cases):
    case = cases["micro_batches"]
    assert "error" not in case, case.get("error")
    counts = case["micro_batches_per_rank"]
    assert counts[0] != counts[1], counts  # the shorter rank pads with weight-0 repeats
    assert case["sequence_err"] < TOL and case["token_err"] < TOL, case
