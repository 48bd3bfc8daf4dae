"""`dualkv plan`: predicted savings and memory of a GRPO policy update, with and without dualkv.

An estimate, stated so it can be checked: parameters from the model's shape (a mixture of
experts: every expert counted, and k of E experts active per token); training state
`--state-bytes` per parameter (default 12: bf16 weights and gradients, fp32 AdamW moments);
activations kept for the backward, bf16, per token and layer 2 x (4d + 2 Hq D + 2 Hkv D + 3 ff)
bytes (norm inputs, q/k/v, attention output, MLP input, gate/up/act; ff = k x the expert's for
a mixture of experts) without recomputation, or with layer checkpointing 2 x d per token and
layer plus one layer's full set; the LM head as dualkv_compile runs it in both cases: the
hidden states of the predicted positions per group, and one chunk of logits
(DualKVConfig.logprob_chunk_size rows, fp32, three buffers) per micro-batch.
FLOPs: 6 x a token's active layer parameters per token, 12 x D x Hq per causal pair and layer,
6 x V x d per predicted token.
"""

from __future__ import annotations

from dualkv_compile.adapters import HF_FAMILIES
from dualkv_compile.config import DualKVConfig

from .models import CliError, model_dims

__all__ = ["run_plan", "estimate"]

GIB = 2**30


def estimate(d: dict, n: int, p: int, r: int, *, state_bytes: int = 12,
             chunk: int = DualKVConfig.logprob_chunk_size) -> dict:
    """d: model_dims' shape; a mixture of experts also has `experts` (E) and `active` (k), its
    `ff` being one expert's."""
    h, hd = d["hidden"], d["head_dim"]
    q_dim, kv_dim = d["heads"] * hd, d["kv_heads"] * hd
    experts, active = d.get("experts", 1), d.get("active", 1)
    router = h * experts if "experts" in d else 0
    attn_params = (h * q_dim + 2 * h * kv_dim + q_dim * h + 2 * h  # projections, two norms
                   + (2 * hd if d.get("qk_norm") else 0)  # Qwen3's per-head q and k norms
                   + (q_dim + 2 * kv_dim if d.get("qkv_bias") else 0)  # Qwen2's biases
                   + (h if d.get("o_bias") else 0))  # attention_bias=True: o_proj's too
    layer_params = attn_params + experts * 3 * h * d["ff"] + router
    active_params = attn_params + active * 3 * h * d["ff"] + router  # what a token runs
    params = d["layers"] * layer_params + d["vocab"] * h * (1 if d["tied"] else 2) + h
    per_layer_token = 2 * (4 * h + 2 * q_dim + 2 * kv_dim + 3 * active * d["ff"])
    per_token = d["layers"] * per_layer_token
    per_token_ckpt = d["layers"] * 2 * h + per_layer_token
    replicated_tokens, packed_tokens = n * (p + r), p + n * r
    replicated_pairs = n * (p + r) * (p + r + 1) // 2
    packed_pairs = p * (p + 1) // 2 + n * (p * r + r * (r + 1) // 2)
    head_flops = 6 * d["vocab"] * h * n * r
    attn = 12 * hd * d["heads"] * d["layers"]
    head_memory = n * r * h * 2  # the predicted positions' hidden states, per group
    return {
        "params": params,
        "static_bytes": params * state_bytes,
        "logits_bytes": 3 * chunk * d["vocab"] * 4,  # per micro-batch, not per group
        "rho": replicated_tokens / packed_tokens,
        "pair_reduction": replicated_pairs / packed_pairs,
        "flops_plain": 6 * d["layers"] * active_params * replicated_tokens
        + attn * replicated_pairs + head_flops,
        "flops_dualkv": 6 * d["layers"] * active_params * packed_tokens
        + attn * packed_pairs + head_flops,
        "activation_bytes_plain": per_token * replicated_tokens + head_memory,
        "activation_bytes_dualkv": per_token * packed_tokens + head_memory,
        "checkpointed_bytes_plain": per_token_ckpt * replicated_tokens + head_memory,
        "checkpointed_bytes_dualkv": per_token_ckpt * packed_tokens + head_memory,
    }

MAX_GPU_GIB = 10**6  # --gpu-memory at most (GiB): more is a typo, and 1e300 overflowed to inf
MAX_N = 2**20  # -N at most: responses per prompt past it is a typo (1e20 printed 8e16 GiB)

def run_plan(args, out=print) -> int:
    for flag, value in (("-N", args.N), ("-P", args.P), ("-R", args.R)):
        if value < 1:
            raise CliError(f"{flag} {value}: must be at least 1")
    if args.N > MAX_N:
        raise CliError(f"-N {args.N}: must be at most {MAX_N:,} responses per prompt")
    gib = args.gpu_memory  # float("nan") and float("inf") parse, but are no amount of memory
    if gib is not None and not 0 < gib <= MAX_GPU_GIB:
        raise CliError(f"--gpu-memory {args.gpu_memory}: must be a number of GiB in "
                       f"(0, {MAX_GPU_GIB:,}]")
    d = model_dims(args.model)
    limit = d.get("max_positions")
    if limit is not None and args.P + args.R > limit:
        raise CliError(f"-P {args.P} + -R {args.R} = {args.P + args.R} positions, more than "
                       f"{args.model}'s maximum of {limit}")
    e = estimate(d, args.N, args.P, args.R, state_bytes=args.state_bytes)
    kind = d.get("model_type")
    if kind is not None and kind not in HF_FAMILIES:  # the estimate still holds for its shape
        out(f"note: optimize() refuses model_type {kind!r} (it takes {list(HF_FAMILIES)}); "
            "the figures below are for a decoder of this shape")
    mlp = (f"{d['experts']} experts of ff={d['ff']}, {d['active']} a token" if "experts" in d
           else f"ff={d['ff']}")
    out(f"model {args.model}: {_count(e['params'])} parameters ({d['layers']} layers, "
        f"d={d['hidden']}, {d['heads']}/{d['kv_heads']} heads of {d['head_dim']}, "
        f"{mlp}, vocab {d['vocab']}); one group: N={args.N}, P={args.P}, R={args.R}")
    out(f"token reduction rho:          {e['rho']:.2f}x  "
        f"({args.N * (args.P + args.R)} -> {args.P + args.N * args.R} tokens)")
    out(f"attention FLOP reduction:     {e['pair_reduction']:.2f}x (causal pairs)")
    out(f"fwd+bwd FLOPs per group:      {_count(e['flops_plain'], 'FLOP')} -> "
        f"{_count(e['flops_dualkv'], 'FLOP')} ({e['flops_plain'] / e['flops_dualkv']:.2f}x)")
    out(f"activations per group:        {_bytes(e['activation_bytes_plain'])} -> "
        f"{_bytes(e['activation_bytes_dualkv'])} (bf16, no recomputation)")
    out(f"  with layer checkpointing:   {_bytes(e['checkpointed_bytes_plain'])} -> "
        f"{_bytes(e['checkpointed_bytes_dualkv'])}")
    out(f"  plus, per micro-batch:      {_bytes(e['logits_bytes'])} of LM-head logits "
        f"(one chunk)")
    out(f"weights, grads, optimizer:    {_bytes(e['static_bytes'])} "
        f"({args.state_bytes} bytes/parameter)")
    if args.gpu_memory is not None:
        free = args.gpu_memory * GIB - e["static_bytes"] - e["logits_bytes"]
        if free <= 0:
            out(f"groups per micro-batch in {args.gpu_memory:g} GiB: none; the training state "
                f"and one chunk of logits alone need "
                f"{(e['static_bytes'] + e['logits_bytes']) / GIB:.1f} GiB (shard it, e.g. FSDP)")
            return 0
        for kind, key in (("no recomputation", "activation_bytes"),
                          ("layer checkpointing", "checkpointed_bytes")):
            fit = {k: int(free // e[f"{key}_{k}"]) for k in ("plain", "dualkv")}
            out(f"groups per micro-batch in {args.gpu_memory:g} GiB, {kind}: "
                f"plain {fit['plain']}, dualkv {fit['dualkv']}")
    return 0


def _count(x: float, unit: str = "") -> str:
    """8.19B parameters, 14818.1 TFLOP, 12.2 MFLOP: the largest prefix under which x >= 1."""
    if unit:
        prefixes, sep, digits = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)), " ", 1
    else:
        prefixes, sep, digits = (("B", 1e9), ("M", 1e6), ("K", 1e3)), "", 2
    for prefix, scale in prefixes:
        if x >= scale:
            return f"{x / scale:.{digits}f}{sep}{prefix}{unit}"
    return f"{x:.0f}{sep}{unit}"


def _bytes(x: float) -> str:
    for prefix, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.2f} {prefix}"
    return f"{x:.0f} B"
