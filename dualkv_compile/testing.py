"""Helpers shared by the tests, the GPU checks and the benchmarks: synthetic GRPO batches and
the replicated-batch oracle (plain causal SDPA on each row)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .numerics import accumulation_dtype

__all__ = [
    "make_batch",
    "mixed_batch",
    "packed_forward_backward",
    "row_by_row_logits",
    "row_by_row_response_logprobs",
    "same_dtype_numerics",
    "tiny_model",
    "random_qkv",
    "rel_err",
    "replicated_causal_attention",
    "replicated_forward_backward",
]


def make_batch(
    prompt_lengths: list[int],
    response_lengths: list[list[int]],
    *,
    prompt_len: int | None = None,
    pad_side: str = "left",
    shuffle: bool = False,
    vocab: int = 1000,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Tensor, Tensor, int]:
    """A GRPO batch: group g has a prompt of prompt_lengths[g] valid tokens and one row per entry
    of response_lengths[g]. Returns (tokens [B, L], padding_mask [B, L], prompt_len). Token ids
    lie in [1, vocab); a prompt's first token, g + 1, tells the groups apart."""
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError("one list of response lengths per prompt is needed")
    if vocab <= len(prompt_lengths) + 1:
        raise ValueError(f"vocab={vocab} holds distinct first tokens for at most {vocab - 2} "
                         f"groups, not {len(prompt_lengths)}")
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side={pad_side!r} must be 'left' or 'right'")
    prompt_len = prompt_len or max(prompt_lengths)
    resp_len = max([r for rs in response_lengths for r in rs] + [0])
    rows, masks = [], []
    for g, (p, responses) in enumerate(zip(prompt_lengths, response_lengths)):
        # distinct groups: the first token encodes the group, the rest are random
        prompt = torch.randint(1, vocab, (p,), generator=generator)
        prompt[0] = g + 1
        for r in responses:
            row = torch.zeros(prompt_len + resp_len, dtype=torch.long)
            m = torch.zeros(prompt_len + resp_len, dtype=torch.bool)
            lo = prompt_len - p if pad_side == "left" else 0
            row[lo:lo + p], m[lo:lo + p] = prompt, True
            row[prompt_len:prompt_len + r] = torch.randint(1, vocab, (r,), generator=generator)
            m[prompt_len:prompt_len + r] = True
            rows.append(row), masks.append(m)
    tokens, mask = torch.stack(rows), torch.stack(masks)
    if shuffle:
        perm = torch.randperm(tokens.shape[0], generator=generator)
        tokens, mask = tokens[perm], mask[perm]
    return tokens.to(device), mask.to(device), prompt_len


def replicated_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, padding_mask: Tensor, *, scale: float | None = None
) -> Tensor:
    """The oracle: q [B, Hq, L, D], k/v [B, Hkv, L, D] in the row layout; each row's valid tokens
    run F.scaled_dot_product_attention(is_causal=True) on their own. Padding cells are zero."""
    rep = q.shape[1] // k.shape[1]
    rows = []
    for b in range(q.shape[0]):
        cols = padding_mask[b].nonzero()[:, 0]
        qb = q[b:b + 1, :, cols]
        kb = k[b:b + 1, :, cols].repeat_interleave(rep, dim=1)
        vb = v[b:b + 1, :, cols].repeat_interleave(rep, dim=1)
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        rows.append(torch.zeros_like(q[b:b + 1]).index_copy(2, cols, ob))
    return torch.cat(rows)


def rel_err(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _leaves(*xs: Tensor) -> list[Tensor]:
    return [x.detach().clone().requires_grad_(True) for x in xs]


def packed_forward_backward(op, q, k, v, packed, cotangent: Tensor, **kwargs):
    """op(q, k, v, packed) on packed leaves [1, H, T, D]; loss = <out, cotangent> in fp32 or
    wider. Returns (out, dq, dk, dv), `out` cut to the valid tokens."""
    q, k, v = _leaves(q, k, v)
    out = op(q, k, v, packed, **kwargs)
    (out.to(cotangent.dtype) * cotangent).sum().backward()
    return out.detach()[:, :, : packed.num_tokens], q.grad, k.grad, v.grad


def replicated_forward_backward(q, k, v, packed, padding_mask, cotangent: Tensor, scale=None):
    """The same function computed the plain way: unpack the leaves to the [B, L] rows, run the
    oracle, pack the output (each prompt from its group's first row). Gradients of a prompt
    position sum over its group, through unpack."""
    q, k, v = _leaves(q, k, v)
    q_rows, k_rows, v_rows = (packed.unpack(x, dim=2) for x in (q, k, v))
    out_rows = replicated_causal_attention(q_rows, k_rows, v_rows, padding_mask, scale=scale)
    out = packed.pack(out_rows, dim=2)
    (out.to(cotangent.dtype) * cotangent).sum().backward()
    return out.detach()[:, :, : packed.num_tokens], q.grad, k.grad, v.grad


def random_qkv(packed, hq: int, hkv: int, d: int, *, dtype, device, generator=None):
    """q [1, hq, T, D], k/v [1, hkv, T, D] and a cotangent [1, hq, T, D] that is zero on padding."""
    t = packed.seq_len
    q, k, v = (torch.randn(1, h, t, d, generator=generator, dtype=torch.float64)
               for h in (hq, hkv, hkv))
    cot = torch.randn(1, hq, t, d, generator=generator, dtype=torch.float64)
    cot[:, :, packed.num_tokens:] = 0
    wide = accumulation_dtype(dtype)
    return (*(x.to(device=device, dtype=dtype) for x in (q, k, v)), cot.to(device=device, dtype=wide))


# ---- models for exactness tests -------------------------------------------------------------
class _RMSNormSameDtype(torch.nn.Module):
    """RMSNorm computed in the input's dtype (torchtune and transformers upcast to float32)."""

    def __init__(self, weight, eps, offset=0.0):
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (self.weight + self.offset)


class _RopeSameDtype(torch.nn.Module):
    """torchtune's interleaved RoPE on its own cache, without the float32 cast."""

    def __init__(self, cache):
        super().__init__()
        self.cache = cache

    def forward(self, x, *, input_pos=None):
        cache = self.cache[: x.size(1)] if input_pos is None else self.cache[input_pos]
        xs = x.reshape(*x.shape[:-1], -1, 2)
        cache = cache.view(-1, xs.size(1), 1, xs.size(3), 2).to(x.dtype)
        out = torch.stack([xs[..., 0] * cache[..., 0] - xs[..., 1] * cache[..., 1],
                           xs[..., 1] * cache[..., 0] + xs[..., 0] * cache[..., 1]], -1)
        return out.flatten(3)


def same_dtype_numerics(model: torch.nn.Module) -> torch.nn.Module:
    """Swap the norm and RoPE modules that compute in float32 whatever the model's dtype for
    equivalents that keep the dtype, in place. An fp64 comparison of two computations that
    differ only by 1e-16 is otherwise capped near 1e-7 by float32 rounding inside the model;
    with this, fp64 tests measure the packed transformation itself."""
    swaps = []
    for name, mod in model.named_modules(remove_duplicate=False):  # modules may be shared
        cls = type(mod).__name__
        if cls == "RMSNorm" and hasattr(mod, "scale"):  # torchtune
            swaps.append((name, _RMSNormSameDtype(mod.scale, mod.eps)))
        elif cls.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):  # transformers
            swaps.append((name, _RMSNormSameDtype(mod.weight, mod.variance_epsilon)))
        elif cls in ("RotaryPositionalEmbeddings", "Llama3ScaledRoPE") and hasattr(mod, "cache"):
            swaps.append((name, _RopeSameDtype(mod.cache)))
    for name, new in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model


def tiny_model(family: str, *, vocab: int = 101, seed: int = 0, dim: int = 32,
               max_seq_len: int = 512) -> torch.nn.Module:
    """A small random decoder of one family: 'qwen2_5' and 'llama3_2' (torchtune builders),
    'hf_qwen3' and 'hf_llama' (transformers, attn_implementation='sdpa'), 'hf_qwen3_moe'
    (transformers' Qwen3-MoE: 4 experts, 2 active, per-token dispatch). 2 layers, 4 query heads,
    2 key/value heads, head dim dim // 4."""
    torch.manual_seed(seed)
    if family == "qwen2_5":
        from torchtune.models.qwen2._component_builders import qwen2

        return qwen2(vocab_size=vocab, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=dim,
                     intermediate_dim=2 * dim, max_seq_len=max_seq_len, tie_word_embeddings=True)
    if family == "llama3_2":
        from torchtune.models.llama3_2._component_builders import llama3_2

        return llama3_2(vocab_size=vocab, num_layers=2, num_heads=4, num_kv_heads=2,
                        embed_dim=dim, intermediate_dim=2 * dim, max_seq_len=max_seq_len)
    if family in ("hf_qwen3", "hf_llama", "hf_qwen3_moe"):
        import transformers as tf

        common = dict(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_seq_len)
        if family == "hf_qwen3":
            cfg = tf.Qwen3Config(head_dim=dim // 4, **common)
            model = tf.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa")
        elif family == "hf_qwen3_moe":
            cfg = tf.Qwen3MoeConfig(head_dim=dim // 4, moe_intermediate_size=dim // 2,
                                    num_experts=4, num_experts_per_tok=2, **common)
            cfg._experts_implementation = "batched_mm"  # the dispatch optimize() proves local
            model = tf.Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="sdpa")
        else:
            cfg = tf.LlamaConfig(**common)
            model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
        return model.eval()
    raise ValueError(f"unknown family {family!r}; one of qwen2_5, llama3_2, hf_qwen3, hf_llama, "
                     "hf_qwen3_moe")


def mixed_batch(seed: int = 0, vocab: int = 101) -> tuple[Tensor, Tensor, int]:
    """The tests' standard GRPO batch: three groups (prompts of 9, 5 and 1 valid tokens,
    left-padded), ragged and empty responses, rows shuffled so groups interleave; token ids
    below `vocab`."""
    g = torch.Generator().manual_seed(seed)
    tokens, mask, p = make_batch([9, 5, 1], [[6, 0, 11], [3, 3], [7]], shuffle=True,
                                 vocab=vocab - 2, generator=g)
    return tokens % vocab, mask, p


def row_by_row_logits(model, tokens: Tensor, padding_mask: Tensor) -> list[Tensor]:
    """The plainest reference: the unmodified model on each row's valid tokens alone."""
    out = []
    for b in range(tokens.shape[0]):
        row = tokens[b, padding_mask[b]][None]
        pos = torch.arange(row.shape[1], device=row.device)[None]
        if hasattr(model, "get_output_embeddings"):
            logits = model(input_ids=row, position_ids=pos, use_cache=False).logits
        else:  # torchtune returns .float() logits: keep the LM head's own output dtype
            seen = []  # the final norm's output, through the model's own forward
            hook = model.norm.register_forward_hook(lambda m, i, o: seen.append(o))
            try:
                model(row, input_pos=pos)
            finally:
                hook.remove()
            logits = model.output(seen[0])
        out.append(logits[0])
    return out


def row_by_row_response_logprobs(model, tokens, padding_mask, prompt_len, temperature=1.0):
    """[B, L - prompt_len] response logprobs from row_by_row_logits (0 at padding)."""
    rows = row_by_row_logits(model, tokens, padding_mask)
    b, l = tokens.shape
    out = []
    for i, logits in enumerate(rows):
        row = tokens[i, padding_mask[i]]
        p = int(padding_mask[i, :prompt_len].sum())
        n = int(padding_mask[i, prompt_len:].sum())
        wide = accumulation_dtype(logits.dtype)
        logp = (logits.to(wide) / temperature).log_softmax(-1)
        picked = logp[p - 1:p - 1 + n].gather(1, row[p:p + n, None])[:, 0]
        out.append(torch.cat([picked, picked.new_zeros(l - prompt_len - n)]))
    return torch.stack(out)
