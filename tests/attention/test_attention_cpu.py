"""shared_prefix_attention on CPU (the SDPA-per-segment path) against causal SDPA on the
replicated rows, fp64: outputs and dq/dk/dv."""

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualkv_compile import pack, shared_prefix_attention
from dualkv_compile.testing import (
    make_batch,
    packed_forward_backward,
    random_qkv,
    rel_err,
    replicated_forward_backward,
)

TOL = 1e-10


def response_lengths(kind, groups, group_size, g):
    if kind == "empty":
        return [[0] * group_size for _ in range(groups)]
    if kind == "one":
        return [[1] * group_size for _ in range(groups)]
    return [torch.randint(0, 40, (group_size,), generator=g).tolist() for _ in range(groups)]


# "auto" is the SDPA reference on CPU; "regions" is the two-KV-region backend (regions.py) with
# PyTorch's CPU flash kernel, the same merge and backward code that runs cuDNN on CUDA;
# "flash_regions" (flash_regions.py) runs the plan of its two flash-attn-4 calls with explicit math.
BACKENDS = ["auto", "regions", "flash_regions"]


def check_equivalence(tokens, mask, prompt_len, hq, hkv, d, g, scale=None, backend="auto"):
    pb = pack(tokens, prompt_len=prompt_len, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, hq, hkv, d, dtype=torch.float64, device="cpu", generator=g)
    ours = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot, scale=scale,
                                   attention_backend=backend)
    ref = replicated_forward_backward(q, k, v, pb, mask, cot, scale=scale)
    # relative to the reference; where that is 0 in exact arithmetic (dq and dk when every row
    # sees one key) it holds rounding noise only, so there relative to the largest result
    largest = max(float(b.double().norm()) for b in ref)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        err = float((a.double() - b.double()).norm()) / max(float(b.double().norm()),
                                                            1e-3 * largest)
        assert err < TOL, (name, err)
    return pb


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("responses", ["empty", "one", "ragged"])
@pytest.mark.parametrize("prompt", [1, 7, 129])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("group_size", [1, 2, 5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_replicated_causal_sdpa(group_size, groups, prompt, responses, hq, hkv, d,
                                        backend):
    seed = zlib.crc32(repr((group_size, groups, prompt, responses, hq, hkv, d)).encode())
    g = torch.Generator().manual_seed(seed)
    # groups differ in prompt length too (prompt, prompt - 1, ...), left-padded
    prompts = [max(1, prompt - i) for i in range(groups)]
    tokens, mask, p = make_batch(prompts, response_lengths(responses, groups, group_size, g),
                                 shuffle=True, generator=g)
    pb = check_equivalence(tokens, mask, p, hq, hkv, d, g, backend=backend)
    assert pb.num_groups == groups


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_scale_and_right_padded_prompts(backend):
    g = torch.Generator().manual_seed(7)
    tokens, mask, p = make_batch([5, 12], [[3, 9], [4]], pad_side="right", generator=g)
    check_equivalence(tokens, mask, p, 4, 2, 8, g, scale=0.3, backend=backend)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.integers(1, 40), st.lists(st.integers(0, 40), min_size=1, max_size=4)),
        min_size=1, max_size=4,
    ),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3)]),
    pad_side=st.sampled_from(["left", "right"]),
    seed=st.integers(0, 2**31 - 1),
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_layouts(layout, heads, pad_side, seed, backend):
    g = torch.Generator().manual_seed(seed)
    tokens, mask, p = make_batch([pl for pl, _ in layout], [rs for _, rs in layout],
                                 pad_side=pad_side, shuffle=True, generator=g)
    check_equivalence(tokens, mask, p, heads[0], heads[1], 8, g, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_positions_are_finite_and_get_no_gradient(backend):
    g = torch.Generator().manual_seed(8)
    tokens, mask, p = make_batch([3], [[2, 2]], generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 2, 2, 4, dtype=torch.float64, device="cpu", generator=g)
    out, dq, dk, dv = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot,
                                              attention_backend=backend)
    full = shared_prefix_attention(q, k, v, pb, attention_backend=backend)
    assert torch.isfinite(full).all()
    for grad in (dq, dk, dv):
        assert grad[:, :, pb.num_tokens:].abs().sum() == 0


def test_shape_errors_name_the_shapes():
    tokens, mask, p = make_batch([3], [[2]])
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q = torch.zeros(1, 4, 128, 8)
    with pytest.raises(ValueError, match=r"q must be \[1, Hq, T=128, D\], got \(1, 4, 127, 8\)"):
        shared_prefix_attention(q[:, :, :127], q, q, pb)
    with pytest.raises(ValueError, match="Hkv=3 must divide Hq=4"):
        shared_prefix_attention(q, q[:, :3], q[:, :3], pb)
    with pytest.raises(ValueError, match="head dims differ"):
        shared_prefix_attention(q, q[..., :4], q[..., :4], pb)
    with pytest.raises(TypeError, match="PackedBatch"):
        shared_prefix_attention(q, q, q, tokens)
    # each a bare ZeroDivisionError
    with pytest.raises(ValueError, match=r"Hq=4, Hkv=0 and D=8 must be positive"):
        shared_prefix_attention(q, q[:, :0], q[:, :0], pb)
    with pytest.raises(ValueError, match=r"Hq=4, Hkv=4 and D=0 must be positive"):
        shared_prefix_attention(q[..., :0], q[..., :0], q[..., :0], pb, attention_backend="regions")
    from dualkv_compile.attention.selection import describe_attention_backend

    assert describe_attention_backend("cpu").startswith("CPU reference on cpu")
    with pytest.raises(ValueError, match="CUDA kernel only"):
        shared_prefix_attention(q, q, q, pb, kernel_options={"BLOCK_M": 64})
    with pytest.raises(ValueError, match="does not use it"):
        shared_prefix_attention(q, q, q, pb, kernel_options={"BLOCK_M": 64},
                                attention_backend="regions")


@pytest.mark.parametrize("seed", range(3))
def test_regions_math_kernel_is_exact(monkeypatch, seed):
    """The explicit math kernel that runs tiny regions on CUDA (cuDNN refuses 1x1), run here
    for every region: fp64 against the replicated batch."""
    from dualkv_compile.attention import regions

    calls = []

    def math_kernels(q):
        calls.append(q.shape)
        return regions._math_forward, regions._math_backward

    monkeypatch.setattr(regions, "_kernels", math_kernels)
    g = torch.Generator().manual_seed(seed)
    tokens, mask, p = make_batch([1, 9, 30], [[1, 0, 5], [17], [2, 40, 1]], shuffle=True,
                                 generator=g)
    check_equivalence(tokens, mask, p, 6, 2, 8, g, backend="regions")
    assert len(calls) == 2  # forward and backward both ran on the math kernel


def test_regions_bf16_error_is_that_of_dense_bf16():
    """The region merge adds one bf16 rounding per partial output; the CPU bf16 result stays
    within 2x of what dense bf16 SDPA on the replicated rows shows against fp32 (the GPU
    criterion)."""
    g = torch.Generator().manual_seed(11)
    tokens, mask, p = make_batch([70, 33], [[50, 3, 64], [90, 1]], shuffle=True, generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 4, 2, 32, dtype=torch.bfloat16, device="cpu", generator=g)
    ours = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot,
                                   attention_backend="regions")
    dense = replicated_forward_backward(q, k, v, pb, mask, cot)
    ref = replicated_forward_backward(q.double(), k.double(), v.double(), pb, mask, cot)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, dense, ref):
        assert a.dtype == torch.bfloat16, name
        assert rel_err(a, r) <= 2 * rel_err(b, r), (name, rel_err(a, r), rel_err(b, r))


def _spans(plan):
    return [(prompt, None if r is None else (r.start, r.end, r.n, r.r)) for prompt, r in plan]


@settings(max_examples=30, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.integers(1, 30), st.lists(st.integers(0, 30), min_size=1, max_size=4)),
        min_size=1, max_size=4,
    ),
    pad_side=st.sampled_from(["left", "right"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_regions_plan_from_segment_tables_equals_the_packed_plan(layout, pad_side, seed):
    """What a compiled graph has (the 1-D segment tables) gives the same regions as the
    PackedBatch."""
    from dualkv_compile.attention.regions import plan_of_packed, plan_of_segments

    g = torch.Generator().manual_seed(seed)
    tokens, mask, p = make_batch([pl for pl, _ in layout], [rs for _, rs in layout],
                                 pad_side=pad_side, shuffle=True, generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    from_tables = plan_of_segments(pb.segment_ids[0], pb.prefix_segment_ids[0])
    assert _spans(from_tables) == _spans(plan_of_packed(pb, torch.device("cpu")))


@pytest.mark.parametrize("op", ["regions_attention", "flash_regions_attention"])
def test_regions_custom_ops_match_replicated_fp64(op):
    """The opaque ops optimize() puts in compiled graphs for attention_backend "regions" and
    "flash_regions", called eagerly: out and gradients against the replicated rows."""
    g = torch.Generator().manual_seed(21)
    tokens, mask, p = make_batch([9, 30], [[4, 0, 17], [1, 25]], shuffle=True, generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 6, 3, 8, dtype=torch.float64, device="cpu", generator=g)
    seg, pre = pb.segment_ids[0], pb.prefix_segment_ids[0]
    overload = getattr(torch.ops.dualkv, op)

    def call(q, k, v, packed):
        return overload(q, k, v, seg, pre, 8 ** -0.5)[0]

    ours = packed_forward_backward(call, q, k, v, pb, cot)
    ref = replicated_forward_backward(q, k, v, pb, mask, cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))
    torch.library.opcheck(overload.default,
                          (q.detach().requires_grad_(), k.detach().requires_grad_(),
                           v.detach().requires_grad_(), seg, pre, 0.5))


def test_regions_plan_indices_and_a_misplaced_response_raises():
    from dualkv_compile.attention.regions import plan_of_packed, plan_of_segments

    g = torch.Generator().manual_seed(3)
    tokens, mask, p = make_batch([4, 6], [[3, 0, 5], [2, 2]], shuffle=True, generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    a = plan_of_segments(pb.segment_ids[0], pb.prefix_segment_ids[0])
    b = plan_of_packed(pb, torch.device("cpu"))
    for (_, ra), (_, rb) in zip(a, b):
        if ra is not None and ra.idx is not None:  # ragged: the gather indices agree too
            assert torch.equal(ra.idx, rb.idx) and torch.equal(ra.valid, rb.valid)
    seg, pre = pb.segment_ids[0].clone(), pb.prefix_segment_ids[0].clone()
    first_response = int((seg != pre).nonzero()[0])
    pre[first_response:first_response + 3] = seg[-1]  # names a prompt that is not before it
    with pytest.raises(ValueError, match="which is not the prompt before it"):
        plan_of_segments(seg, pre)


def test_regions_op_lse_is_not_differentiable_and_double_backward_is_refused():
    g = torch.Generator().manual_seed(4)
    tokens, mask, p = make_batch([5], [[3, 4]], generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 2, 1, 4, dtype=torch.float64, device="cpu", generator=g)
    q.requires_grad_()
    out, lse = torch.ops.dualkv.regions_attention(q, k, v, pb.segment_ids[0],
                                                  pb.prefix_segment_ids[0], 0.5)
    assert out.requires_grad and not lse.requires_grad
    out = shared_prefix_attention(q, k, v, pb, attention_backend="regions")
    (gq,) = torch.autograd.grad((out * cot).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        gq.sum().backward()


def test_regions_inside_a_users_torch_compile_fullgraph():
    """Traced by Dynamo, the op becomes the opaque regions op (fp64, aot_eager)."""
    g = torch.Generator().manual_seed(5)
    tokens, mask, p = make_batch([7, 3], [[5, 0, 9], [4]], shuffle=True, generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 4, 2, 8, dtype=torch.float64, device="cpu", generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, packed: shared_prefix_attention(q, k, v, packed,
                                                        attention_backend="regions"),
        backend="aot_eager", fullgraph=True)
    ours = packed_forward_backward(compiled, q, k, v, pb, cot)
    ref = replicated_forward_backward(q, k, v, pb, mask, cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_major_strided_inputs(backend):
    """q/k/v as models produce them: [1, T, H, D] tensors seen as [1, H, T, D] (transposed
    views), the layout the compiled graph hands the attention."""
    g = torch.Generator().manual_seed(13)
    tokens, mask, p = make_batch([20, 6], [[9, 9, 9], [3, 12]], shuffle=True, generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 6, 2, 8, dtype=torch.float64, device="cpu", generator=g)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not q.is_contiguous()
    ours = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot,
                                   attention_backend=backend)
    ref = replicated_forward_backward(q, k, v, pb, mask, cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))


def test_flash_regions_plan_has_one_cross_run_per_group_with_responses():
    from dualkv_compile.attention.flash_regions import flash_plan_of_segments

    g = torch.Generator().manual_seed(23)
    tokens, mask, p = make_batch([9, 30, 4], [[4, 0, 17], [1, 25], [0, 0]], shuffle=True,
                                 generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    plan = flash_plan_of_segments(pb.segment_ids[0], pb.prefix_segment_ids[0])
    cross = [(spans[0][0], spans[-1][1], ps, pe)
             for ps, pe, spans in pb.group_spans if any(e > s for s, e in spans)]
    assert plan.cross == tuple(cross) and len(cross) == 2
    segments = [b for ps, pe, spans in pb.group_spans for b in [ps] + [s for s, e in spans if e > s]]
    assert plan.bounds == tuple(segments) + (pb.padding_span[0], pb.seq_len)
    # FA4's cu_seqlens: int32 on the tables' device; the longest segment is the 30-token prompt
    # or the padding, whichever is longer
    assert plan.cu.dtype == torch.int32 and plan.cu.device == pb.segment_ids.device
    assert plan.max_len == max(30, pb.padding_span[1] - pb.padding_span[0])
    # the one varlen cross call: each group's responses from cu_q for used_q tokens, against its
    # prompt from cu_k for used_k tokens
    x = plan.cross_tables
    assert x.cu_q.tolist() == [c[0] for c in cross] + [pb.seq_len]
    assert x.used_q.tolist() == [re - rs for rs, re, _, _ in cross]
    assert x.cu_k.tolist() == [c[2] for c in cross] + [pb.seq_len]
    assert x.used_k.tolist() == [pe - ps for _, _, ps, pe in cross]
    assert (x.max_q, x.max_k) == (max(x.used_q.tolist()), max(x.used_k.tolist()))
    assert all(t.dtype == torch.int32 for t in (x.cu_q, x.used_q, x.cu_k, x.used_k))


def test_flash_regions_plan_refuses_a_misplaced_response():
    from dualkv_compile.attention.flash_regions import flash_plan_of_segments

    tokens, mask, p = make_batch([4, 6], [[3, 5], [2, 2]])
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    seg, pre = pb.segment_ids[0].clone(), pb.prefix_segment_ids[0].clone()
    first_response = int((seg != pre).nonzero()[0])
    pre[first_response:first_response + 3] = seg[-1]
    with pytest.raises(ValueError, match="which is not the prompt before it"):
        flash_plan_of_segments(seg, pre)


def test_flash_regions_refuses_integer_inputs():
    # on the CPU it computed in float32 and cast the result back: truncated integers
    pb = pack(torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6]]), prompt_len=2)
    q = torch.randint(-3, 4, (1, 2, pb.seq_len, 4))
    with pytest.raises(ValueError, match="needs floating q, k and v .*got torch.int64"):
        shared_prefix_attention(q, q, q, pb, attention_backend="flash_regions")


@pytest.mark.parametrize("backend", ["regions", "flash_regions"])
def test_fp64_q_with_fp32_k_and_v_runs_in_fp64(backend):
    # flash_regions' explicit math met it as "expected scalar type Double but found Float"
    g = torch.Generator().manual_seed(15)
    tokens, mask, p = make_batch([20, 6], [[9, 9, 9], [3, 12]], generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 4, 2, 8, dtype=torch.float64, device="cpu", generator=g)
    ours = packed_forward_backward(shared_prefix_attention, q, k.float(), v.float(), pb, cot,
                                   attention_backend=backend)
    ref = replicated_forward_backward(q, k.float().double(), v.float().double(), pb, mask, cot)
    assert [x.dtype for x in ours] == [torch.float64, torch.float64, torch.float32, torch.float32]
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(a.double(), b) < 1e-6, (name, rel_err(a.double(), b))


@pytest.mark.parametrize("backend", ["regions", "flash_regions"])
def test_mixed_float_dtypes_run_as_their_common_dtype(backend):
    """CPU autocast hands attention fp32 q and k (after RoPE's fp32 tables) and a bf16 v: the
    region kernels run them as fp32 (regions raised aten's bare dtype error), and every
    gradient comes back in its input's dtype. ("auto" is SDPA on CPU, which takes them under
    autocast only, as the plain model's does: test_region_kernels_under_cpu_autocast.)"""
    g = torch.Generator().manual_seed(14)
    tokens, mask, p = make_batch([20, 6], [[9, 9, 9], [3, 12]], generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 4, 2, 8, dtype=torch.float32, device="cpu", generator=g)
    v = v.bfloat16()
    ours = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot,
                                   attention_backend=backend)
    ref = replicated_forward_backward(q, k, v.float(), pb, mask, cot)
    assert [x.dtype for x in ours[1:]] == [torch.float32, torch.float32, torch.bfloat16]
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(a.float(), b) < 1e-2, (name, rel_err(a.float(), b))


@pytest.mark.parametrize("backend", ["regions", "flash_regions"])
def test_the_region_math_under_autocast_is_the_math_without_it(backend):
    """Under autocast the explicit math's matmuls ran in bf16, so the forward's lse did not
    match the scores its backward (outside autocast) recomputed: dv was 16x the plain model's
    error. It now computes in fp32 under autocast too, so both runs agree exactly."""
    g = torch.Generator().manual_seed(16)
    tokens, mask, p = make_batch([20, 6], [[9, 0, 9], [3, 12]], generator=g)
    pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 4, 2, 8, dtype=torch.float32, device="cpu", generator=g)
    q = q * 30  # large logits: bf16 scores are far from fp32's

    def run(autocast):  # the forward under autocast, the backward outside, as in training
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = shared_prefix_attention(*leaves, pb, attention_backend=backend)
        (out.float() * cot).sum().backward()
        return (out.detach(), *(x.grad for x in leaves))

    plain = run(False)
    under = run(True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), under, plain):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_packed_under_inference_mode_trains(backend):
    """A batch packed once under torch.inference_mode (for the old logprobs) and reused with
    gradients: flash_regions' backward could not save its inference-mode segment tables (a bare
    "Inference tensors cannot be saved for backward"), also after a call inside the mode."""
    g = torch.Generator().manual_seed(15)
    tokens, mask, p = make_batch([20, 6], [[9, 0, 9], [3, 12]], generator=g)
    with torch.inference_mode():
        pb = pack(tokens, prompt_len=p, padding_mask=mask)
    q, k, v, cot = random_qkv(pb, 4, 2, 8, dtype=torch.float64, device="cpu", generator=g)
    with torch.inference_mode():
        shared_prefix_attention(q, k, v, pb, attention_backend=backend)
    ours = packed_forward_backward(shared_prefix_attention, q, k, v, pb, cot,
                                   attention_backend=backend)
    ref = replicated_forward_backward(q, k, v, pb, mask, cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))
