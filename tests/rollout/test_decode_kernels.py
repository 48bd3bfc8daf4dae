"""The decode step's Triton kernels (rollout/kernels/) on CPU, under Triton's interpreter:
decode_attention(implementation="triton") equals dense masked softmax, called eagerly and
traced with fullgraph (where the kernels are opaque ops), for prompts in one or several splits,
keys in one or several runs a program, with and without the merge kernel. The GPU tests
(tests/gpu/test_rollout_gpu.py) run them on CUDA, alone and inside the engine's captured
step."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import itertools
import torch
from dualkv_compile.rollout import decode_attention
from dualkv_compile.rollout import kernels
from dualkv_compile.rollout.kernels import prompt as prompt_kernel
from dualkv_compile.rollout.kernels import response as response_kernel
from tests.rollout.engine_helpers import dense_reference, split

traced = torch.compile(decode_attention, backend="aot_eager", fullgraph=True, dynamic=False)
g = torch.Generator().manual_seed(0)
x = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
# (query heads, kv heads, head dim, samples): 4, 1 and 3 query heads a kv head; 40 x 4 = 160
# queries a kv head (two prompt tiles of 128)
for hq, hkv, d, n in ((8, 2, 16, 4), (2, 2, 32, 4), (6, 2, 16, 4), (8, 2, 16, 40)):
    groups, p, r = 3, 48, 150
    q, pk, pv = x(groups * n, hq, d), x(groups, hkv, p, d), x(groups, hkv, p, d)
    rk, rv = x(groups * n, hkv, r, d), x(groups * n, hkv, r, d)
    plen = torch.tensor([48, 1, 30])  # splits past a prompt's end hold no key
    resp = [t.float() for t in (rk, rv)]
    # 1 split; 3 and 6 (the response kernel merges up to 4 a loop step: a partial last step);
    # 16 (some of them empty for every prompt). The response: 3 runs of 64 keys, a partial
    # third, and a merge kernel; with max_programs 1 (the first head layout), one run that
    # folds the prompt's partials itself
    for (splits, attend), max_programs in itertools.product(
            ((1, decode_attention), (3, traced), (6, decode_attention), (16, traced)),
            (1024, 1) if n == 4 and hq == 8 else (1024,)):
        response_kernel._MAX_PROGRAMS = max_programs
        torch._dynamo.reset()  # static shapes
        args = [t.float() for t in (q, split(pk, splits), split(pv, splits))]
        assert kernels.supports(args[0], *args[1:], *resp)
        for last in (0, 63, 64, 149):  # one key; a run boundary either side; every key
            got = attend(*args, plen, *resp, torch.tensor(last), scale=d ** -0.5,
                         implementation="triton")
            want = dense_reference(q, pk, pv, plen, rk, rv, last, d ** -0.5)
            err = float((got.double() - want).abs().max())
            assert err < 1e-5, (hq, hkv, n, splits, max_programs, last, err)
    # the replicated layout (share_prompt=False): one "group" per row
    pk1, pv1 = pk.repeat_interleave(n, 0), pv.repeat_interleave(n, 0)
    plen1 = plen.repeat_interleave(n)
    args = [t.float() for t in (q, split(pk1, 4), split(pv1, 4))]
    got = traced(*args, plen1, *resp, torch.tensor(100), scale=d ** -0.5, implementation="triton")
    want = dense_reference(q, pk1, pv1, plen1, rk, rv, 100, d ** -0.5)
    assert float((got.double() - want).abs().max()) < 1e-5
# one split of 300 keys, as the engine stores prompts for these kernels: 5 runs of 64 keys a
# prompt program, a partial last one (min_programs 132), or one run of 512 (min_programs 1)
q, pk, pv = x(8, 8, 16), x(2, 2, 300, 16), x(2, 2, 300, 16)
rk, rv = x(8, 2, 20, 16), x(8, 2, 20, 16)
plen = torch.tensor([300, 170])
for min_programs in (132, 1):
    prompt_kernel._MIN_PROGRAMS = min_programs
    args = [t.float() for t in (q, split(pk, 1), split(pv, 1), plen, rk, rv)]
    got = decode_attention(*args, torch.tensor(19), scale=0.25, implementation="triton")
    want = dense_reference(q, pk, pv, plen, rk, rv, 19, 0.25)
    assert float((got.double() - want).abs().max()) < 1e-5, min_programs
# per-split lengths [G, S] (each a prefix of its split) with empty splits between valid ones:
# the math path is the reference
q, pk, pv = x(8, 4, 16), x(2, 8, 2, 8, 16), x(2, 8, 2, 8, 16)
rk, rv = x(8, 2, 20, 16), x(8, 2, 20, 16)
lens = torch.tensor([[8, 0, 3, 8, 0, 0, 5, 0], [0, 0, 0, 0, 1, 8, 0, 0]])
args = [t.float() for t in (q, pk, pv, lens, rk, rv)]
got = decode_attention(*args, torch.tensor(7), scale=0.25, implementation="triton")
want = decode_attention(q, pk, pv, lens, rk, rv, torch.tensor(7), scale=0.25)
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
def test_decode_kernels_equal_dense_softmax_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_kernel_status_names_what_it_cannot_run():
    import torch

    from dualkv_compile.rollout import kernels

    runs, why = kernels.status(torch.device("cpu"), 128, torch.bfloat16)
    if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter runs CPU tensors
        assert not runs and ("Triton is not installed" in why or "run on CUDA" in why), why
    if kernels.triton is not None:
        cuda = torch.device("cuda")
        assert "power of two" in kernels.status(cuda, 80, torch.bfloat16)[1]
        assert "[16, 128]" in kernels.status(cuda, 256, torch.bfloat16)[1]
        assert "float64" in kernels.status(cuda, 128, torch.float64)[1]
