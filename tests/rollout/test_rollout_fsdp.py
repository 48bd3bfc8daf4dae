"""The rollout engine on an FSDP2-sharded model with a MixedPrecisionPolicy (float32 shards,
bfloat16 compute), one CPU process (gloo, world size 1): the default KV-cache dtype and the
attention choice follow the dtype the rollout computes in, not the sharded parameters'."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_MIXED_PRECISION = """
import copy, json, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from dualkv_compile.adapters import hf_decoder
from dualkv_compile.rollout import RolloutEngine
from dualkv_compile.testing import tiny_model
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
prompts = torch.randint(2, 101, (2, 8), generator=torch.Generator().manual_seed(0))
found = {}
for family in ("hf_qwen3", "qwen2_5"):
    model = tiny_model(family).eval()
    plain = copy.deepcopy(model)  # what the policy computes with, unsharded: bfloat16
    for p in plain.parameters():  # parameters (as the policy casts them), not buffers (inv_freq)
        p.data = p.data.to(torch.bfloat16)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = hf_decoder(model).layers if family.startswith("hf_") else model.layers
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    engine = RolloutEngine(model)
    chosen = []  # (cache dtype, compute dtype) each attention choice was made for
    real = engine._implementation
    engine._implementation = lambda *args: chosen.append(tuple(map(str, args[1:]))) or real(*args)
    def sample(eng, **kw):
        return eng.generate(prompts, group_size=2, max_generated_tokens=4, pad_id=0,
                            rng=torch.Generator().manual_seed(1), return_logprobs=True, **kw)
    tokens, logprobs = sample(engine)
    cache = str(engine._workspace.cache.prompt_k[0].dtype)
    default_bytes = engine.kv_bytes()
    engine.release()
    sample(engine, dtype=torch.bfloat16)
    want_tokens, want_logprobs = sample(RolloutEngine(plain))
    found[family] = dict(
        cache=cache, chosen=chosen[0], same_bytes=default_bytes == engine.kv_bytes(),
        same_tokens=torch.equal(tokens, want_tokens),
        same_logprobs=torch.equal(logprobs, want_logprobs),
        sharded=str(next(model.parameters()).dtype))
print("FOUND", json.dumps(found))
dist.destroy_process_group()
"""


def test_the_default_cache_dtype_is_the_mixed_precision_compute_dtype(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", _MIXED_PRECISION, str(tmp_path / "store")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FOUND "))
    for family, case in json.loads(line[6:]).items():
        assert case["sharded"] == "torch.float32", (family, case)  # the shards stay float32
        # before the fix: a float32 cache (2x the bytes) chosen from the sharded parameters
        assert case["cache"] == "torch.bfloat16", (family, case)
        assert case["chosen"] == ["torch.bfloat16", "torch.bfloat16"], (family, case)
        assert case["same_bytes"], (family, case)
        # the unsharded bfloat16 model's tokens and logprobs, exactly
        assert case["same_tokens"] and case["same_logprobs"], (family, case)
