"""GPU: the FlexAttention path in bf16 against the replicated batch.

Error criterion (per output and per gradient): ||ours_bf16 - ref_fp32|| / ||ref_fp32|| is at
most twice what dense causal SDPA in bf16 on the replicated rows shows against the same fp32
reference. The fp32 reference runs on the bf16 inputs upcast, so both see identical inputs.
Every check runs on the four CUDA kernels: Triton flex, FLASH (FA4), "regions" (cuDNN over the
two KV regions, regions.py) and "flash_regions" (FA4's dense kernels over them,
flash_regions.py); the FA4 ones are skipped, with the reason, where flash-attn-4 is not
installed or the GPU is not sm_90/sm_100.
Run with `pytest -m gpu -s tests/gpu/test_attention_gpu.py` on a CUDA machine.
"""

import json
import os

import pytest
import torch

from dualkv_compile import pack, shared_prefix_attention
from dualkv_compile.testing import (
    make_batch,
    packed_forward_backward,
    random_qkv,
    rel_err,
    replicated_forward_backward,
)

pytestmark = pytest.mark.gpu
BACKENDS = ["triton", "flash", "regions", "flash_regions"]
NAMES = ("out", "dq", "dk", "dv")
RESULTS = []


@pytest.fixture(params=BACKENDS)
def backend(request):
    from dualkv_compile.attention.selection import flash_status

    if request.param in ("flash", "flash_regions") and torch.cuda.is_available():
        available, reason = flash_status(torch.device("cuda"))
        if not available:
            pytest.skip(f"FLASH backend unavailable: {reason}")
    return request.param


def compare_bf16(prompts, responses, hq, hkv, d, seed, backend, shuffle=True,
                 token_major=False):
    g = torch.Generator().manual_seed(seed)
    tokens, mask, p = make_batch(prompts, responses, shuffle=shuffle, generator=g, device="cuda")
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, hq, hkv, d, dtype=torch.bfloat16, device="cuda", generator=g)
    if token_major:  # [1, T, H, D] tensors seen as [1, H, T, D], as models hand them over
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    ours = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot,
                                   attention_backend=backend)
    dense = replicated_forward_backward(q, k, v, pb, mask, cot)
    ref = replicated_forward_backward(q.float(), k.float(), v.float(), pb, mask, cot)
    row = {"backend": backend, "T": pb.seq_len, "tokens": pb.num_tokens, "rows": tokens.shape[0], "groups": pb.num_groups,
           "hq": hq, "hkv": hkv, "d": d}
    for name, a, b, r in zip(NAMES, ours, dense, ref):
        assert torch.isfinite(a).all(), name
        row[name] = {"ours": rel_err(a, r), "dense_bf16": rel_err(b, r)}
    RESULTS.append(row)
    print(json.dumps(row))
    for name in NAMES:
        e = row[name]
        assert e["ours"] <= 2 * e["dense_bf16"], (name, e)
    return pb


LAYOUTS = [
    # prompts, responses per group, hq, hkv, d
    ([129], [[0, 1, 40, 200, 7]], 8, 2, 64),
    ([7, 300, 1], [[1] * 5, [100, 3], [500]], 4, 4, 16),
    ([1000, 900, 1], [[600, 1, 0, 333, 128], [257] * 5, [64, 64]], 32, 8, 128),
    ([2048], [[512] * 16], 32, 8, 128),
    # groups without responses between groups with them (flash_regions' cross call skips them)
    ([50, 400, 9, 77], [[0, 0], [33, 200, 1], [0], [5, 130]], 16, 4, 128),
    # head dim 64 at GQA 1 and 8: the tuned sm_90 Triton entries (kernel_options.py)
    ([300, 17], [[200, 0, 90], [64] * 4], 8, 8, 64),
    ([513], [[128, 300, 5]], 16, 2, 64),
    # head dim 256 at GQA 4, 1 and 8 (tuned entries); FLASH is not used at 256 (FLASH_HEAD_DIMS)
    ([700, 40], [[256, 3, 100], [90, 90]], 8, 2, 256),
    ([300], [[200, 17]], 4, 4, 256),
    ([129, 5], [[64, 300], [1, 2, 3]], 16, 2, 256),
]


@pytest.mark.parametrize("prompts,responses,hq,hkv,d", LAYOUTS)
def test_bf16_matches_replicated(prompts, responses, hq, hkv, d, backend):
    if backend in ("flash", "flash_regions") and d not in (64, 128):  # FA4: wrong dq at 16
        with pytest.raises(ValueError, match=f"head dim {d}"):
            compare_bf16(prompts, responses, hq, hkv, d, seed=1, backend=backend)
        return
    compare_bf16(prompts, responses, hq, hkv, d, seed=len(prompts) * 1000 + d, backend=backend)


@pytest.mark.parametrize("responses", [[[512] * 8], [[700, 1, 64, 300]]])
def test_bf16_token_major_strided_inputs(responses, backend):
    compare_bf16([1000], responses, 16, 4, 128, seed=17, backend=backend, token_major=True)


def test_bf16_long_context_32k_prompt(backend):
    """P = 32K, N = 16, R = 2K, against the row-by-row fp32 reference."""
    pb = compare_bf16([32768], [[2048] * 16], 8, 2, 128, seed=7, backend=backend, shuffle=False)
    assert pb.num_tokens == 32768 + 16 * 2048


def test_bf16_more_than_262144_packed_tokens(backend):
    pb = compare_bf16([4096], [[4096] * 64], 8, 2, 64, seed=5, backend=backend, shuffle=False)
    assert pb.num_tokens > 262_144


def test_recompiles_stay_bounded_over_new_batches_and_lengths(backend):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # start cold, so the first batch must compile
    g = torch.Generator().manual_seed(9)

    def run(batches):
        before = counters["stats"]["unique_graphs"]
        seen = []
        for lengths in batches:
            tokens, mask, p = make_batch([100], lengths, generator=g, device="cuda")
            pb = pack(tokens, prompt_len=p, padding_mask=mask)
            q, k, v, cot = random_qkv(pb, 8, 2, 64, dtype=torch.bfloat16, device="cuda",
                                      generator=g)
            packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot,
                                    attention_backend=backend)
            seen.append(pb.seq_len)
        return seen, counters["stats"]["unique_graphs"] - before

    seen, compiles = run(([[300, 200]], [[250, 250]], [[900, 700, 10]], [[800, 810, 0]],
                          [[2000]]))
    # the same kinds of layout again, with new lengths in the buckets seen
    again, recompiles = run(([[310, 190]], [[240, 240]], [[850, 700, 30]], [[820, 800, 0]],
                             [[1990]]))
    print(json.dumps({"backend": backend, "lengths": seen + again, "new_graphs": compiles,
                      "new_graphs_second_pass": recompiles}))
    assert len(set(seen)) == 3  # two batches share T=640, another two T=1792
    assert sorted(set(again)) == sorted(set(seen))
    assert recompiles == 0, recompiles  # no compile per batch
    if backend not in ("regions", "flash_regions"):  # flex: one static compile per bucket
        assert compiles == 3, compiles
    # regions: cuDNN (or FA4) calls, plus a merge kernel compiled with dynamic shapes (per
    # rank and size-1 dimensions, not per length)


def teardown_module():
    path = os.environ.get("DUALKV_GPU_RESULTS")
    if path and RESULTS:
        with open(path, "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                       "results": RESULTS}, f, indent=1)


@pytest.mark.parametrize("prompts,responses,causal_form", [
    ([2048], [[512] * 8], True), ([256, 384], [[128, 256], [384] * 3], True),
    ([1000], [[512] * 8], False)])
def test_flash_causal_form_equals_flex_flash(prompts, responses, causal_form):
    """FLASH runs FA4's causal form on block-aligned layouts (flash_causal.py) and flex on
    ragged ones; on aligned ones it equals flex FLASH: the output bit for bit, the gradients up
    to FA4's atomic accumulation order (dq always; dk and dv under GQA: flex against itself
    differs there too)."""
    from dualkv_compile.attention.op import _flex_attention
    from dualkv_compile.attention.selection import flash_status
    from dualkv_compile.stats import counters

    available, reason = flash_status(torch.device("cuda"), 128, torch.bfloat16)
    if not available:
        pytest.skip(f"FLASH backend unavailable: {reason}")
    g = torch.Generator().manual_seed(3)
    tokens, mask, p = make_batch(prompts, responses, shuffle=True, generator=g, device="cuda")
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 32, 8, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    before = counters["flash_causal_calls"]
    ours = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot,
                                   attention_backend="flash")
    assert counters["flash_causal_calls"] - before == int(causal_form)
    flex = packed_forward_backward(
        lambda *a, **kw: _flex_attention(*a, None, None, attention_backend="flash"),
        q, k, v, pb, cot)
    diffs = {n: (a.float() - b.float()).abs().max().item() for n, a, b in zip(NAMES, ours, flex)}
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, ours, flex)}
    print(json.dumps({"layout": [prompts, responses], "causal_form": causal_form,
                      "max_abs_diff_vs_flex": diffs, "rel_err_vs_flex": errs}))
    assert diffs["out"] == 0, diffs
    for name in ("dq", "dk", "dv"):  # a bf16 ulp is 2^-8; a wrong mask errs by O(0.1) or more
        assert errs[name] <= 4e-3, errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lse_merge_kernel_matches_the_eager_merge(dtype):
    """flash_regions' in-place merge on CUDA (a Triton kernel) against its eager reference,
    on views like the ones it gets: rows of a token-major buffer, a strided [H, L] slice of
    the log-sum-exps, and a row count that is not a multiple of the kernel's block."""
    from dualkv_compile.attention import lse_merge_kernel
    from dualkv_compile.attention.flash_regions import _merge_into_eager

    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, d, rs, re = 1000, 4, 128, 123, 900
    out = torch.randn(t, h, d, device="cuda", generator=g).to(dtype)
    lse = torch.randn(h, t, device="cuda", generator=g) * 5
    out_x = torch.randn(re - rs, h, d, device="cuda", generator=g).to(dtype)
    lse_x = torch.randn(h, re - rs, device="cuda", generator=g) * 5
    ref_out, ref_lse = out.clone(), lse.clone()
    _merge_into_eager(ref_out[rs:re], ref_lse[:, rs:re], out_x, lse_x)
    assert lse_merge_kernel.supports(out[rs:re], lse[:, rs:re], out_x, lse_x)
    lse_merge_kernel.merge_into(out[rs:re], lse[:, rs:re], out_x, lse_x)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert torch.allclose(lse, ref_lse, atol=1e-5, rtol=1e-6)
    assert torch.equal(out[:rs], ref_out[:rs]) and torch.equal(out[re:], ref_out[re:])
    assert torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol)
