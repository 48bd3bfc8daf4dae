"""Wrong inputs to the public API are refused by name instead of giving a wrong result or an
error deep inside Dynamo: GRPOLoss.token_loss closures of the wrong shape, token dtypes,
containers and devices, conflicting masks and inputs_embeds in the drop-in forward; and
docs/api.md's signatures and DualKVConfig table against the code (CPU)."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.rl import GRPOLoss, overlong_penalty
from dualkv_compile.testing import mixed_batch, same_dtype_numerics, tiny_model

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


@pytest.fixture(scope="module")
def setup():
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    tokens, mask, p = mixed_batch()
    return dk.optimize(model), tokens, mask, p


def grpo_inputs(tokens, mask, p):
    resp = mask[:, p:]
    g = torch.Generator().manual_seed(0)
    old = (torch.randn(resp.shape, dtype=torch.float64, generator=g) - 3) * resp
    ref = (torch.randn(resp.shape, dtype=torch.float64, generator=g) - 3) * resp
    adv = torch.linspace(-1, 1, tokens.shape[0], dtype=torch.float64)
    return old, ref, adv, resp


def test_a_loss_mask_wider_than_the_padding_mask_is_refused(setup):
    # a mask counting padding tokens was taken silently: they weighed in the normaliser
    # ("token", "sequence") while the LM head never evaluated them
    wrapper, tokens, mask, p = setup
    old, ref, adv, resp = grpo_inputs(tokens, mask, p)
    assert not resp.all()
    for aggregation in ("token", "sequence"):
        every = GRPOLoss(aggregation=aggregation).token_loss(old, ref, adv, torch.ones_like(resp))
        with pytest.raises(ValueError, match=r"counts \d+ token\(s\) that padding_mask marks "
                                             r"as padding \(the first at .* \[0, \d+\]\)"):
            wrapper.response_loss(tokens, prompt_len=p, padding_mask=mask, token_loss=every)
    subset = resp.clone()
    subset[0] = False  # a subset (DAPO's overlong filtering) runs
    wrapper.response_loss(tokens, prompt_len=p, padding_mask=mask,
                          token_loss=GRPOLoss().token_loss(old, ref, adv, subset))


@pytest.mark.parametrize("temperature, match", [
    (1e-40, "temperature=1e-40 must be a finite number >= 1e-05"),
    (float("inf"), "temperature=inf"),
    (True, "temperature=True"),
    ("0.7", "temperature='0.7'"),
])
def test_temperature_follows_the_rollout_rule(setup, temperature, match):
    # 1e-40 gave NaN logprobs and inf a uniform distribution, without an error
    wrapper, tokens, mask, p = setup
    old, ref, adv, resp = grpo_inputs(tokens, mask, p)
    with pytest.raises(ValueError, match=match):
        wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask,
                                  temperature=temperature)
    with pytest.raises(ValueError, match=match):
        wrapper.response_loss(tokens, prompt_len=p, padding_mask=mask, temperature=temperature,
                              token_loss=GRPOLoss().token_loss(old, ref, adv, resp))
    with pytest.raises(ValueError, match=match):
        dk.rollout.SamplingParams(temperature=temperature)


def test_temperature_and_token_loss_are_checked_before_the_model_runs(setup):
    # they were checked in the LM head only: after a compile and a forward, and never without
    # response columns (prompt_len == L took temperature=-1 and token_loss=None)
    _, tokens, mask, p = setup
    wrapper = dk.optimize(same_dtype_numerics(tiny_model("qwen2_5")).double())  # nothing compiled
    full = tokens.shape[1]
    dk.counters.clear()
    for prompt_len in (p, full):
        with pytest.raises(ValueError, match="temperature=-1.0"):
            wrapper.response_logprobs(tokens, prompt_len=prompt_len, padding_mask=mask,
                                      temperature=-1.0)
        with pytest.raises(ValueError, match="temperature=nan"):
            wrapper.response_loss(tokens, prompt_len=prompt_len, padding_mask=mask,
                                  temperature=float("nan"), token_loss=lambda lp, i: -lp)
        with pytest.raises(TypeError, match="token_loss must be a function .* got NoneType"):
            wrapper.response_loss(tokens, prompt_len=prompt_len, padding_mask=mask,
                                  token_loss=None)
    assert dk.counters["graphs_compiled"] == 0


def test_chunked_logprobs_refuses_a_bad_chunk_or_target_count():
    from dualkv_compile.lm_head.logprobs import chunked_logprobs

    h, w = torch.randn(5, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="chunk_size=-1 must be an integer >= 1"):
        chunked_logprobs(h, w, torch.zeros(5, dtype=torch.long), chunk_size=-1)
    with pytest.raises(ValueError, match=r"targets \(4,\) must be \[M\] with M = 5"):
        chunked_logprobs(h, w, torch.zeros(4, dtype=torch.long))
    # a float or bool id matched no column: the logprob was -lse, without an error
    for dtype in (torch.float64, torch.bool):
        with pytest.raises(ValueError, match=f"targets must be int64 or int32 token ids, got "
                                             f"{dtype}"):
            chunked_logprobs(h, w, torch.zeros(5, dtype=dtype))


# ---- GRPOLoss.token_loss closures ----------------------------------------------------------
def test_token_loss_refuses_the_padding_mask_for_the_response_mask(setup):
    # the [B, L] padding mask instead of mask[:, P:] used to give a wrong loss silently: the
    # weights were gathered with [B, L - P] flat indices from a [B, L] table
    _, tokens, mask, p = setup
    old, ref, adv, _ = grpo_inputs(tokens, mask, p)
    with pytest.raises(ValueError, match=r"'mask': \(6, 20\)"):
        GRPOLoss().token_loss(old, ref, adv, mask)
    with pytest.raises(ValueError, match=r"advantages \[B\]; got .*'advantages': \(5,\)"):
        GRPOLoss().token_loss(old, ref, adv[:5], mask[:, p:])
    with pytest.raises(ValueError, match=r"'ref_logprobs': \(6, 10\)"):
        GRPOLoss().token_loss(old, ref[:, 1:], adv, mask[:, p:])


def test_response_loss_refuses_a_closure_built_for_other_rows(setup):
    # built for the whole batch and used for a micro-batch of rows [2, 3], it read rows 0 and
    # 1's old logprobs, advantages and weights
    wrapper, tokens, mask, p = setup
    old, ref, adv, resp = grpo_inputs(tokens, mask, p)
    whole = GRPOLoss().token_loss(old, ref, adv, resp)
    assert whole.response_shape == (6, 11)
    rows = torch.tensor([2, 3])
    with pytest.raises(ValueError, match=r"built for responses of shape \(6, 11\), but these "
                                         r"tokens have \(2, 11\)"):
        wrapper.response_loss(tokens[rows], prompt_len=p, padding_mask=mask[rows],
                              token_loss=whole)
    # [B, L]-shaped inputs throughout: consistent with each other, not with the tokens
    full = lambda x: torch.cat([torch.zeros(6, p, dtype=x.dtype), x], 1)  # noqa: E731
    wide = GRPOLoss().token_loss(full(old), full(ref), adv, mask)
    with pytest.raises(ValueError, match=r"\(6, 20\), but these tokens have \(6, 11\)"):
        wrapper.response_loss(tokens, prompt_len=p, padding_mask=mask, token_loss=wide)
    # the micro-batch's own closure runs, and gives the loss of those rows' logprobs
    loss, _ = wrapper.response_loss(tokens[rows], prompt_len=p, padding_mask=mask[rows],
                                    token_loss=GRPOLoss().token_loss(old[rows], ref[rows],
                                                                     adv[rows], resp[rows]))
    logprobs = wrapper.response_logprobs(tokens[rows], prompt_len=p, padding_mask=mask[rows])
    expect, _ = GRPOLoss()(logprobs, old[rows], ref[rows], adv[rows], resp[rows])
    assert torch.allclose(loss, expect, rtol=1e-10, atol=1e-12)


# ---- tokens: dtype, container, device --------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    (lambda t: t.to(torch.uint8), r"int64 or int32, got Tensor \(6, 20\) torch.uint8"),
    (lambda t: t.bool(), r"int64 or int32, got Tensor \(6, 20\) torch.bool"),
    (lambda t: t.tolist(), r"int64 or int32, got list"),
    (lambda t: t.double(), r"int64 or int32, got Tensor \(6, 20\) torch.float64"),
])
def test_tokens_must_be_an_int64_or_int32_tensor(setup, bad, match):
    wrapper, tokens, mask, p = setup
    with pytest.raises(ValueError, match=match):
        dk.pack(bad(tokens), prompt_len=p, padding_mask=mask)
    calls = [lambda t: wrapper.response_logprobs(t, prompt_len=p, padding_mask=mask),
             lambda t: wrapper.response_loss(t, prompt_len=p, padding_mask=mask,
                                             token_loss=lambda lp, i: lp),
             lambda t: wrapper(t, padding_mask=mask, prompt_len=p),
             lambda t: wrapper.token_rows(t, prompt_len=p, padding_mask=mask)]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call(bad(tokens))


def test_int32_tokens_give_the_int64_result(setup):
    wrapper, tokens, mask, p = setup
    ref = wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    assert torch.equal(wrapper.response_logprobs(tokens.int(), prompt_len=p, padding_mask=mask),
                       ref)


def test_tokens_on_another_device_than_the_model_are_named():
    # the model on the meta device stands in for a GPU model given CPU tokens: without the check
    # Dynamo failed with a fake-tensor device mismatch
    model = tiny_model("qwen2_5").to("meta")
    tokens, mask, p = mixed_batch()
    wrapper = dk.optimize(model)
    with pytest.raises(ValueError, match=r"tokens are on cpu but the model is on meta"):
        wrapper.response_logprobs(tokens, prompt_len=p, padding_mask=mask)
    with pytest.raises(ValueError, match=r"tokens are on cpu but the model is on meta"):
        wrapper(tokens, padding_mask=mask, prompt_len=p)


# ---- the drop-in forward ---------------------------------------------------------------------
def test_transformers_forward_refuses_conflicting_masks_and_ignored_arguments():
    model = same_dtype_numerics(tiny_model("hf_llama")).double()
    tokens, mask, p = mixed_batch()
    wrapper = dk.optimize(model)
    out = wrapper(input_ids=tokens, attention_mask=mask.long(), padding_mask=mask, prompt_len=p)
    assert torch.equal(out.logits, wrapper(input_ids=tokens, attention_mask=mask,
                                           prompt_len=p).logits)
    other = mask.clone()
    other[0, -1] = ~other[0, -1]
    with pytest.raises(ValueError, match="attention_mask and padding_mask describe different"):
        wrapper(input_ids=tokens, attention_mask=mask, padding_mask=other, prompt_len=p)
    with pytest.raises(ValueError, match="pass only the tokens positionally, got 2"):
        wrapper(tokens, mask, prompt_len=p)  # the mask was ignored: logits without padding
    embeds = model.get_input_embeddings()(tokens)
    with pytest.raises(ValueError, match=r"unsupported arguments.*'inputs_embeds'"):
        wrapper(inputs_embeds=embeds, attention_mask=mask, prompt_len=p)


# ---- docs/api.md against the code ------------------------------------------------------------
def plain_signature(name, fn, rename=None):
    """`name(a, *, b=1)` as docs/api.md writes it: no annotations, no self, double quotes."""
    parts, rename = [], rename or {}
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        shown = rename.get(p.name, p.name)
        parts.append(shown if p.default is p.empty else f"{shown}={p.default!r}")
    return f"{name}({', '.join(parts)})".replace("'", '"')


@pytest.mark.parametrize("config", [dict(enabled=False), dict()])
def test_the_dense_forward_refuses_what_the_packed_one_refuses(setup, config):
    # with enabled=False (the baseline) or after a fallback, forward() ran the model on any
    # prompt_len and on masks with holes, which the packed path refuses
    _, tokens, mask, p = setup
    model = same_dtype_numerics(tiny_model("qwen2_5")).double()
    wrapper = dk.optimize(model, dk.DualKVConfig(**config))
    holed = mask.clone()
    holed[0, p + 1] = False  # a hole inside row 0's response
    assert holed[0, p + 2:].any()
    for kw, match in [(dict(prompt_len=0), r"prompt_len=0 is outside"),
                      (dict(prompt_len=2.5), r"prompt_len=2\.5 must be an integer"),
                      (dict(prompt_len=p, padding_mask=holed), "hole inside the response")]:
        with pytest.raises(ValueError, match=match):
            wrapper(tokens, **({"padding_mask": mask} | kw))


@pytest.mark.parametrize("kw, match", [
    (dict(pad_to=True), r"pad_to=True must be an integer"),
    (dict(group_size=True), r"group_size=True must be an integer"),
    (dict(padding_mask=[[1, 1]]), r"padding_mask must be a bool or 0/1 integer tensor, got list"),
])
def test_pack_reads_integers_by_the_one_rule(setup, kw, match):
    import numpy as np

    _, tokens, mask, p = setup
    with pytest.raises(ValueError, match=match):
        dk.pack(tokens, prompt_len=p, **kw)
    want = dk.pack(tokens, prompt_len=p, padding_mask=mask).seq_len  # numpy ints were refused
    for pad_to in (np.int64(128), torch.tensor(128)):
        assert dk.pack(tokens, prompt_len=p, padding_mask=mask, pad_to=pad_to).seq_len == want


def test_api_md_signatures_match_the_code():
    text = " ".join(API.read_text().split()).replace("( ", "(")  # a signature may wrap
    for sig in [plain_signature("GRPOLoss", GRPOLoss),
                plain_signature("overlong_penalty", overlong_penalty),
                plain_signature("loss_fn", GRPOLoss.__call__),
                plain_signature("loss_fn.token_loss", GRPOLoss.token_loss),
                plain_signature("loss_fn.stats", GRPOLoss.stats),
                plain_signature("GRPOLoss.token_loss", GRPOLoss.token_loss)]:
        assert sig in text, sig


def test_api_md_config_table_lists_every_field_with_its_default():
    text = API.read_text()
    table = text[text.index("## `dualkv_compile.DualKVConfig`"):]
    table = table[:table.index("\n\n**")]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, flags=re.M))
    fields = {f.name: f for f in dataclasses.fields(dk.DualKVConfig)}
    assert set(rows) == set(fields)
    defaults = dk.DualKVConfig()
    for name, shown in rows.items():
        value = getattr(defaults, name)
        assert shown.strip().strip("`") in (repr(value), str(value), '"' + str(value) + '"',
                                             "{}" if value == {} else None), (name, shown)
