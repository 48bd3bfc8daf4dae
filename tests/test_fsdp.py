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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
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


def test_a_refusal_on_one_rank_stops_every_rank(cases):
    case = cases["refusals"]
    assert "error" not in case, case.get("error")
    rank0, rank1 = case["one_rank"]
    assert rank0.startswith("optimizer_step: another rank refused its inputs"), rank0
    assert rank1.startswith("loss_mask must be bool"), rank1
    rank0, rank1 = case["oov_one_rank"]  # refused inside the model's forward, after the others
    # had entered FSDP's all-gather: rank 0 waited there
    assert rank0.startswith("optimizer_step: another rank refused its inputs"), rank0
    assert "outside the model's vocabulary" in rank1, rank1
    assert all("needs an FSDP2-sharded model" in said for said in case["unsharded"]), case
    rank0, rank1 = case["logprobs_oov_one_rank"]
    assert rank0.startswith("micro_batched_logprobs: another rank refused its inputs"), rank0
    assert "outside the model's vocabulary" in rank1, rank1


_LAYOUTS = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from dualkv_compile.fsdp import check_fsdp_layout
from dualkv_compile.models import qwen3_tiny
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
def refusal(shard):
    model = qwen3_tiny(vocab_size=97)
    shard(model)
    try:
        check_fsdp_layout(model, model.layers)
    except ValueError as e:
        return str(e)
    return "accepted"
def each_layer(m):
    for layer in m.layers:
        fully_shard(layer)
    fully_shard(m)
def one_group(m):
    fully_shard(list(m.layers)); fully_shard(m)
def attention_only(m):
    fully_shard(m.layers[0].attn); fully_shard(m)
def hooked(m):
    each_layer(m); m.layers[1].register_forward_hook(lambda *a: None)
for shard in (each_layer, one_group, attention_only, hooked):
    print(shard.__name__, "|", refusal(shard))
dist.destroy_process_group()
"""


def test_fsdp_layouts_the_layer_region_cannot_drive_are_named(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", _LAYOUTS, str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = dict(line.split(" | ", 1) for line in proc.stdout.splitlines() if " | " in line)
    assert said["each_layer"] == "accepted"
    assert "sharded as one group" in said["one_group"]
    assert "FSDP unit 'layers.0.attn'" in said["attention_only"]
    assert "layer 1 has hooks (hooked.<locals>.<lambda>)" in said["hooked"]
