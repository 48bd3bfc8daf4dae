"""optimize(model) on CPU, fp64: logits, response logprobs and every parameter gradient of a
GRPO-style loss against the unmodified model run row by row."""

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.testing import (
    make_batch,
    mixed_batch,
    rel_err,
    row_by_row_logits,
    row_by_row_response_logprobs,
    same_dtype_numerics,
    tiny_model,
)

import transformers  # noqa: E402,F401  (a test dependency: fail loudly if it is missing)
FAMILIES = ["qwen2_5", "llama3_2", "hf_qwen3", "hf_llama"]
TOL = 1e-10


def grpo_loss(lp, mask, prompt_len, advantages):
    """Clipped-ratio surrogate at ratio 1 plus a KL-like square term: gradients touch every
    response token with a row-dependent weight."""
    valid = mask[:, prompt_len:].to(lp.dtype)
    ratio = torch.exp(lp - lp.detach())
    per_token = -advantages[:, None] * ratio + 0.05 * lp.pow(2)
    return (per_token * valid).sum() / valid.sum()


def assert_logprobs_and_gradients_match(model, tokens, mask, p, logprob_tol, grad_tol):
    """optimize(model)'s response logprobs and the GRPO-style loss's parameter gradients
    against the unmodified model run row by row."""
    advantages = torch.linspace(-1, 1, tokens.shape[0], dtype=torch.float64)
    lp = dk.optimize(model).response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    grpo_loss(lp, mask, p, advantages).backward()
    ours = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    ref = row_by_row_response_logprobs(model, tokens, mask, p)
    assert rel_err(lp.detach(), ref.detach()) < logprob_tol
    grpo_loss(ref, mask, p, advantages).backward()
    for name, param in model.named_parameters():
        assert rel_err(ours[name], param.grad) < grad_tol, name


@pytest.fixture(autouse=True)
def fresh_counters():
    dk.counters.clear()
    torch._dynamo.reset()


@pytest.mark.parametrize("pad_side", ["left", "right"])
@pytest.mark.parametrize("family", ["qwen2_5", "hf_qwen3"])
def test_prompts_of_one_length_and_a_repeated_prompt_match_row_by_row(family, pad_side):
    # groups told apart by their tokens alone (mixed_batch's prompts all differ in length, so
    # a grouping by length passed every other model-level test), one prompt listed as two
    # groups (pack merges them), and a shorter prompt padded on either side
    model = same_dtype_numerics(tiny_model(family)).double()
    tokens, mask, p = make_batch([5, 5, 5, 3], [[3, 2], [4, 1], [2, 2], [3, 1]], vocab=90,
                                 pad_side=pad_side, generator=torch.Generator().manual_seed(3))
    tokens[4:6, :p] = tokens[0:2, :p]  # group 2 draws group 0's prompt
    assert dk.pack(tokens, prompt_len=p, padding_mask=mask).num_groups == 3
    assert_logprobs_and_gradients_match(model, tokens, mask, p, TOL, TOL)


@pytest.mark.parametrize("attention_backend", ["auto", "regions", "flash_regions"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_logprobs_and_gradients_match_row_by_row(family, attention_backend):
    """"auto" on CPU: the flex higher-order op's dense math; "regions": the opaque regions op
    (regions.py) with PyTorch's CPU flash kernel, partitioned by AOTAutograd; "flash_regions":
    its op (flash_regions.py) with the explicit math that stands in for FA4 on CPU."""
    model = same_dtype_numerics(tiny_model(family)).double()
    tokens, mask, p = mixed_batch()
    wrapper = dk.optimize(model, dk.DualKVConfig(attention_backend=attention_backend))

    logits = wrapper(tokens, prompt_len=p, padding_mask=mask)
    logits = logits.logits if hasattr(logits, "logits") else logits
    ref_rows = row_by_row_logits(model, tokens, mask)
    # torchtune's unembed returns float32 logits by design, even for a float64 model; the
    # float64 comparison of the same computation is response_logprobs below
    tol = TOL if logits.dtype == torch.float64 else 1e-6
    for b, ref in enumerate(ref_rows):
        assert rel_err(logits[b, mask[b]], ref.to(logits.dtype)) < tol, b
    assert logits[~mask].abs().sum() == 0

    advantages = torch.linspace(-1, 1, tokens.shape[0], dtype=torch.float64)
    lp = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask, temperature=0.7)
    assert lp.dtype == torch.float64 and lp.shape == (tokens.shape[0], tokens.shape[1] - p)
    grpo_loss(lp, mask, p, advantages).backward()
    ours = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()

    ref = row_by_row_response_logprobs(model, tokens, mask, p, temperature=0.7)
    assert rel_err(lp.detach(), ref.detach()) < TOL
    assert lp[~mask[:, p:]].abs().sum() == 0
    grpo_loss(ref, mask, p, advantages).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        assert rel_err(ours[name], param.grad) < TOL, (name, rel_err(ours[name], param.grad))

    assert dk.counters["attention_rewritten"] == 2 * 2  # 2 layers, in each of the 2 modes
    assert dk.counters["lm_head_pruned"] == 1
    assert dk.counters["dense_fallback"] == 0
    # the comparison above ran with RoPE's tables stored once (passes/position_tables.py):
    # transformers computes cos and sin from the positions once per call (2 per mode); the
    # torchtune models cast their gathered cache rows per layer for q and k (qwen2: cos and sin
    # apart, 8 per mode; llama3: one table, 4 per mode)
    stored = {"hf_qwen3": 2, "hf_llama": 2, "qwen2_5": 8, "llama3_2": 4}[family]
    assert dk.counters["position_tables_materialized"] == 2 * stored
    targets = [str(n.target) for n in wrapper._backends["hidden"].last_graph.graph.nodes]
    kernel = {"regions": "dualkv.regions_attention",
              "flash_regions": "dualkv.flash_regions_attention"}.get(attention_backend,
                                                                   "flex_attention")
    assert sum(kernel in t for t in targets) == 2, targets


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("family", ["qwen2_5", "hf_qwen3"])
def test_response_loss_matches_row_by_row(family, enabled):
    """The GRPO loss fused into the LM head (response_loss), packed and dense: loss, logprobs
    and every parameter's gradient against the row-by-row logprobs followed by the same loss;
    old logprobs away from the new ones so the clipping is active, a backward scale != 1."""
    from dualkv_compile.rl import GRPOLoss

    model = same_dtype_numerics(tiny_model(family)).double()
    tokens, mask, p = mixed_batch(seed=2)
    wrapper = dk.optimize(model, dk.DualKVConfig(enabled=enabled, logprob_chunk_size=5))
    resp = mask[:, p:]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        exact = row_by_row_response_logprobs(model, tokens, mask, p, temperature=0.7)
    old = (exact + 0.3 * torch.randn(exact.shape, dtype=torch.float64, generator=g)) * resp
    ref_lp = (exact + 0.1 * torch.randn(exact.shape, dtype=torch.float64, generator=g)) * resp
    adv = torch.linspace(-1, 1, tokens.shape[0], dtype=torch.float64)
    loss_fn = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, kl_coef=0.05)

    loss, lp = wrapper.response_loss(tokens, prompt_len=p, padding_mask=mask, temperature=0.7,
                                     token_loss=loss_fn.token_loss(old, ref_lp, adv, resp))
    (loss * 3).backward()
    ours = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()

    ref = row_by_row_response_logprobs(model, tokens, mask, p, temperature=0.7)
    ref_loss, stats = loss_fn(ref, old, ref_lp, adv, resp)
    (ref_loss * 3).backward()
    assert 0 < float(stats["clip_fraction"]) < 1
    assert not lp.requires_grad and rel_err(lp, ref.detach()) < TOL and (lp[~resp] == 0).all()
    assert rel_err(loss.detach(), ref_loss.detach()) < TOL
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        assert rel_err(ours[name], param.grad) < TOL, (name, rel_err(ours[name], param.grad))


@pytest.mark.parametrize("family", FAMILIES)
def test_unmodified_models_match_to_float32_rounding(family):
    # the families' own norms/RoPE compute in float32: the same float32 steps on both paths
    # give logprobs equal to float64 rounding (measured 5e-17 to 1.2e-16), and gradients to
    # float32 rounding (5e-8 to 2e-7), which same_dtype_numerics removes in the other tests
    model = tiny_model(family).double()
    tokens, mask, p = mixed_batch(seed=1)
    assert_logprobs_and_gradients_match(model, tokens, mask, p, 1e-12, 1e-5)


def test_rewritten_graph_has_no_sdpa_and_no_lm_head():
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    tokens, mask, p = mixed_batch()
    wrapper = dk.optimize(model)
    seen = {}
    real = dk.optimize.__globals__["chunked_logprobs"]

    def spy(hidden, weight, targets, **kw):
        seen["rows"] = hidden.shape[0]
        return real(hidden, weight, targets, **kw)

    dk.optimize.__globals__["chunked_logprobs"] = spy
    try:
        wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    finally:
        dk.optimize.__globals__["chunked_logprobs"] = real
    gm = wrapper._backends["hidden"].last_graph
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not any("scaled_dot_product_attention" in t for t in targets)
    assert sum("flex_attention" in t for t in targets) == 2
    assert not any("layout_anchor" in t for t in targets)
    (out,) = gm.graph.output_node().args[0]
    assert tuple(out.meta["example_value"].shape) == (1, 128, 32)  # hidden [1, T, d], no vocab
    # the LM head ran on exactly the positions that predict response tokens
    assert seen["rows"] == int(mask[:, p:].sum())


def test_hf_model_mask_code_is_removed():
    model = same_dtype_numerics(tiny_model("hf_qwen3")).double()
    tokens, mask, p = mixed_batch()
    wrapper = dk.optimize(model)
    wrapper(tokens, prompt_len=p, padding_mask=mask)
    gm = wrapper._backends["logits"].last_graph
    names = {str(n.target) for n in gm.graph.nodes}
    # transformers derives a mask from position_ids (cumsum/diff/arange); all of it is dead now
    assert not any(x in " ".join(names) for x in ("cumsum", "diff", "arange"))
    assert dk.counters["mask_nodes_removed"] > 0


class _TimeMixer(torch.nn.Module):
    """Mixes tokens outside attention: a causal running mean over the sequence."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + x.cumsum(dim=1) * 0.01


def mixing_model():
    model = same_dtype_numerics(tiny_model("llama3_2")).double()
    model.layers[1].mlp = _TimeMixer(model.layers[1].mlp)
    return model


def test_refusal_error_names_op_and_line():
    from dualkv_compile.passes._common import Refusal

    tokens, mask, p = mixed_batch()
    wrapper = dk.optimize(mixing_model(), dk.DualKVConfig(fallback="error"))
    with pytest.raises(Refusal, match=r"cumsum.*test_optimize_cpu\.py.*x\.cumsum\(dim=1\)"):
        wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)


def test_refusal_dense_fallback_runs_the_plain_model_logged_once(caplog):
    model = mixing_model()
    g = torch.Generator().manual_seed(3)
    tokens, mask, p = make_batch([6], [[5, 5, 5]], vocab=99, generator=g)  # no padding
    wrapper = dk.optimize(model, dk.DualKVConfig(fallback="dense"))
    with caplog.at_level("WARNING", logger="dualkv_compile.optimize"):
        lp = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
        lp2 = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    ref = row_by_row_response_logprobs(model, tokens, mask, p)
    assert rel_err(lp.detach(), ref.detach()) < TOL
    assert torch.equal(lp, lp2)
    assert dk.counters["dense_fallback"] == 1
    assert "cumsum" in wrapper.dense_reason
    assert len([r for r in caplog.records if "unoptimised" in r.message]) == 1


def test_disabled_runs_the_plain_model():
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    tokens, mask, p = mixed_batch()
    lp = dk.optimize(model, dk.DualKVConfig(enabled=False)).response_logprobs(
        tokens, prompt_len=p, padding_mask=mask)
    ref = row_by_row_response_logprobs(model, tokens, mask, p)
    assert rel_err(lp.detach(), ref.detach()) < TOL
    assert dk.counters["graphs_compiled"] == 0


@pytest.mark.parametrize("attention_backend", ["auto", "regions", "flash_regions"])
def test_logprobs_under_inference_mode(attention_backend):
    # old and reference logprobs are often computed under inference_mode: pack() there makes
    # inference tensors, which have no version counter, and the region kernels' plan cache read
    # it (a bare RuntimeError)
    model = same_dtype_numerics(tiny_model("hf_llama")).double()
    tokens, mask, p = mixed_batch()
    wrapper = dk.optimize(model, dk.DualKVConfig(attention_backend=attention_backend))
    with torch.inference_mode():
        lp = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert rel_err(lp, row_by_row_response_logprobs(model, tokens, mask, p).detach()) < TOL


def test_region_kernels_under_cpu_autocast():
    # autocast gives fp32 q and k (after RoPE's fp32 tables) and a bf16 v: the CPU forms run
    # them in fp32 as before, not refused as mixed dtypes (which only CUDA cannot run); the
    # regions kernel raised aten's bare "expected scalar type Float but found BFloat16"
    model = tiny_model("hf_llama")
    tokens, mask, p = mixed_batch()
    out = {}
    for backend in ("auto", "flash_regions", "regions"):
        wrapper = dk.optimize(model, dk.DualKVConfig(attention_backend=backend))
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            out[backend] = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert torch.allclose(out["auto"], out["flash_regions"], rtol=2e-2, atol=2e-2)
    assert torch.allclose(out["auto"], out["regions"], rtol=2e-2, atol=2e-2)


def test_wrapper_shares_parameters_and_state_dict_keys():
    model = tiny_model("qwen2_5")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forward_before, sdpa_before = type(model).forward, torch.nn.functional.scaled_dot_product_attention
    wrapper = dk.optimize(model)
    assert list(wrapper.state_dict()) == list(model.state_dict())
    assert {id(p) for p in wrapper.parameters()} == {id(p) for p in model.parameters()}
    tokens, mask, p = mixed_batch()
    wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask).sum().backward()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model).forward is forward_before  # nothing patched: the class, SDPA itself
    assert torch.nn.functional.scaled_dot_product_attention is sdpa_before
    assert "forward" not in vars(model)
    model(tokens[:1], input_pos=torch.arange(tokens.shape[1])[None])  # model still usable
    wrapper.load_state_dict(before)


def test_one_compile_per_length_bucket():
    model = tiny_model("qwen2_5")
    wrapper = dk.optimize(model)
    g = torch.Generator().manual_seed(4)
    for responses in ([[5, 6]], [[7, 2]], [[100, 90]], [[95, 99]]):
        tokens, mask, p = make_batch([20], responses, vocab=99, generator=g)
        wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert dk.counters["graphs_compiled"] == 2  # T=128 twice, T=256 twice


def test_geometric_buckets_bound_the_compiles():
    """bucket_growth=2: packed lengths 256..1024 share the buckets 256, 512, 1024 (pad_to 128
    alone would make 7), and the logprobs do not depend on the bucket."""
    model = same_dtype_numerics(tiny_model("qwen2_5", max_seq_len=1024)).double()
    grown = dk.optimize(model, dk.DualKVConfig(bucket_growth=2.0))
    plain = dk.optimize(model)
    g = torch.Generator().manual_seed(5)
    lengths = [200, 300, 420, 560, 700, 830, 950]  # packed T: 2..8 blocks of 128 with pad_to
    dk.counters.clear()
    for n in lengths:
        tokens, mask, p = make_batch([20], [[n // 2, n - n // 2 - 20]], vocab=99, generator=g)
        ours = grown.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
        ref = row_by_row_response_logprobs(model, tokens, mask, p)
        assert rel_err(ours, ref) < 1e-10
    assert dk.counters["graphs_compiled"] == 3
    assert {dk.pack(make_batch([20], [[n // 2, n - n // 2 - 20]], vocab=99)[0], prompt_len=20,
                    bucket_growth=2.0).seq_len for n in lengths} == {256, 512, 1024}
    assert plain.config.bucket_growth == 1.0
