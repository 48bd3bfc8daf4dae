"""The fused response-region kernel (rollout/response_kernel.py) on CPU, under Triton's
interpreter: decode_attention(implementation="flex") with it equals dense masked softmax, called
eagerly and traced with fullgraph (where the kernel is an opaque op). The GPU tests
(tests/gpu/test_rollout_gpu.py) run it on CUDA, alone and inside the engine's captured step."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import torch
from dualkv_compile.rollout import decode_attention
from dualkv_compile.rollout import response_kernel
from tests.rollout.test_rollout_engine import dense_reference, split

traced = torch.compile(decode_attention, backend="aot_eager", fullgraph=True, dynamic=False)
g = torch.Generator().manual_seed(0)
x = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
# (query heads, kv heads, head dim): 4, 1 and 3 query heads a kv head
for hq, hkv, d in ((8, 2, 16), (2, 2, 32), (6, 2, 16)):
    torch._dynamo.reset()  # a few static shapes per head layout
    groups, n, p, r = 3, 4, 48, 150
    q, pk, pv = x(groups * n, hq, d), x(groups, hkv, p, d), x(groups, hkv, p, d)
    rk, rv = x(groups * n, hkv, r, d), x(groups * n, hkv, r, d)
    plen = torch.tensor([48, 1, 30])  # splits past a prompt's end hold no key
    resp = [t.float() for t in (rk, rv)]
    # 1 split; 3 and 6 (the kernel merges up to 4 a loop step: a partial last step); 16 (some
    # of them empty for every prompt)
    for splits, attend in ((1, decode_attention), (3, traced), (6, decode_attention),
                           (16, traced)):
        args = [t.float() for t in (q, split(pk, splits), split(pv, splits))]
        assert response_kernel.supports(args[0], *resp)
        for last in (0, 63, 64, 149):  # one key; a block boundary either side; every key
            got = attend(*args, plen, *resp, torch.tensor(last), scale=d ** -0.5,
                         implementation="flex")
            want = dense_reference(q, pk, pv, plen, rk, rv, last, d ** -0.5)
            err = float((got.double() - want).abs().max())
            assert err < 1e-5, (hq, hkv, splits, last, err)
    # the replicated layout (share_prompt=False): one "group" per row
    pk1, pv1 = pk.repeat_interleave(n, 0), pv.repeat_interleave(n, 0)
    plen1 = plen.repeat_interleave(n)
    args = [t.float() for t in (q, split(pk1, 4), split(pv1, 4))]
    got = traced(*args, plen1, *resp, torch.tensor(100), scale=d ** -0.5, implementation="flex")
    want = dense_reference(q, pk1, pv1, plen1, rk, rv, 100, d ** -0.5)
    assert float((got.double() - want).abs().max()) < 1e-5
print("ok")
"""


def _interpreter_skip_reason():
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (the [test] extra brings it on Linux x86_64)"
    major, minor = (int(x) for x in numpy.__version__.split(".")[:2])
    if (major, minor) >= (2, 3):  # int() of a 1-element array, which its loop bounds need
        return f"Triton's interpreter fails on numpy {numpy.__version__} (>= 2.3)"
    return None


@pytest.mark.skipif(_interpreter_skip_reason() is not None,
                    reason=str(_interpreter_skip_reason()))
def test_fused_response_kernel_equals_dense_softmax_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_kernel_status_names_what_it_cannot_run():
    import torch

    from dualkv_compile.rollout import response_kernel

    runs, why = response_kernel.status(torch.device("cpu"), 128, torch.bfloat16)
    if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter runs CPU tensors
        assert not runs and ("Triton is not installed" in why or "runs on CUDA" in why), why
    if response_kernel.triton is not None:
        cuda = torch.device("cuda")
        assert "power of two" in response_kernel.status(cuda, 80, torch.bfloat16)[1]
        assert "float64" in response_kernel.status(cuda, 128, torch.float64)[1]
