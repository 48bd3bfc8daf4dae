"""Attention forward+backward on ragged GRPO micro-batches, the layouts real rollouts give. Not a
test.

    python -m dualkv_compile.tools.bench ragged --out docs/results/attention_ragged_h100

Cases, seeded: for each (P cap, R cap) of (2K, 512), (4K, 1K), (8K, 2K) and each seed, 2-8
groups of N in {8, 16, 32} rows, prompt lengths drawn in [0.1, 1] x the P cap, response lengths
in [1, R cap]; groups are dropped from the end until the replicated tokens fit `--max-tokens`.
Variants, timed in interleaved rounds in one process:
- fa4_varlen: flash-attn-4's varlen causal kernel on the replicated rows with the padding
  removed (the remove-padding path veRL and TRL users run): the baseline;
- cudnn_dense: cuDNN causal SDPA on the padded [B, L] rows;
- ours_<kernel>: shared_prefix_attention on the packed batch, q/k/v given as a model's
  projections give them: token-major views ([1, T, H, D] memory, transposed); with
  `--input-layouts token head` also ours_<kernel>_head on contiguous head-major [1, H, T, D]
  tensors (faster, docs/performance.md, but not what a model's attention is given).
`--aligned-twins` adds each case's block-aligned twin (the same draws, every length rounded up to
a whole 128-token block, where FLASH takes FA4's causal form), timed against FA4 varlen on its
own rows: how far the ragged layout, and not the baseline, is what costs.
ideal = varlen pairs / packed pairs (PackedBatch.pair_reduction); "x ideal" = (fa4_varlen ms /
ours ms) / ideal, so 1.0 means a packed pair costs what a varlen pair does.

Each row also counts 128 x 128 tiles (`tiles`, on the CPU): those the shared-prefix BlockMask
visits, how many of them are partial (a mask_mod per element), and those a causal varlen
kernel visits over the rows. tiles varlen / tiles ours / ideal is what a kernel of equal
per-tile speed would reach. `--tiles-only` prints that table without a GPU, with the same
bound for other layouts of each case (segments padded to block boundaries, finer query blocks;
tools/ragged_tiles.py).
"""

from __future__ import annotations

import platform
import sys

import torch
import torch.nn.functional as F

from dualkv_compile import pack, shared_prefix_attention
from dualkv_compile.testing import make_batch
from dualkv_compile.attention.registry import KERNELS
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, environment,
                                          interleaved_medians, parse_caps, positive_int,
                                          save_progress, seed_int, write_results)
from dualkv_compile.tools.ragged_tiles import LAYOUTS, layout_bounds

CAPS = [(2048, 512), (4096, 1024), (8192, 2048)]


def ragged_case(seed: int, p_cap: int, r_cap: int, max_tokens: int, aligned: bool = False):
    """(tokens [B, L], padding_mask, prompt_len, group_size, prompt lengths, response lengths)
    of one seeded ragged micro-batch; left-padded prompts, right-padded responses. `aligned`:
    its block-aligned twin, the same draws with every length rounded up to a whole block."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    groups, n = draw(2, 8), (8, 16, 32)[draw(0, 2)]
    prompts = [draw(max(1, p_cap // 10), p_cap) for _ in range(groups)]
    responses = [[draw(1, r_cap) for _ in range(n)] for _ in range(groups)]
    replicated = lambda: sum(p * n + sum(rs) for p, rs in zip(prompts, responses))  # noqa: E731
    while groups > 1 and replicated() > max_tokens:
        groups -= 1
        prompts, responses = prompts[:groups], responses[:groups]
    if replicated() > max_tokens:  # a case has at least one group
        print(f"note: seed {seed}, caps {p_cap},{r_cap}: its one group replicates to "
              f"{replicated()} tokens, over --max-tokens {max_tokens}; kept", file=sys.stderr)
    if aligned:
        from dualkv_compile.attention.block_mask import BLOCK_SIZE

        up = lambda x: -(-x // BLOCK_SIZE) * BLOCK_SIZE  # noqa: E731
        prompts, responses = [up(x) for x in prompts], [[up(x) for x in rs] for rs in responses]
        if replicated() > max_tokens:  # the twin keeps the ragged case's groups
            print(f"note: seed {seed}, caps {p_cap},{r_cap}: its aligned twin replicates to "
                  f"{replicated()} tokens, over --max-tokens {max_tokens} (the same groups "
                  f"as the ragged case, each length rounded up); kept", file=sys.stderr)
    tokens, mask, p = make_batch(prompts, responses, vocab=1000, generator=g)
    return tokens, mask, p, n, prompts, responses


def tile_counts(pb, mask) -> dict:
    """128 x 128 tiles: visited by the packed layout's BlockMask (and how many partial), and by
    a causal varlen kernel over each row's valid tokens."""
    from dualkv_compile.attention.block_mask import BLOCK_SIZE, block_classes

    classes = block_classes(pb)
    blocks = [-(-int(n) // BLOCK_SIZE) for n in mask.sum(1).tolist()]
    return {"ours": int((classes > 0).sum()), "partial": int((classes == 1).sum()),
            "varlen": sum(b * (b + 1) // 2 for b in blocks)}


def _varlen(mask, hq, hkv, d):
    """fwd+bwd of FA4's varlen causal kernel over each row's valid tokens, concatenated."""
    from flash_attn.cute import flash_attn_varlen_func

    lengths = mask.sum(1).to(torch.int32)
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)).cuda()
    total, longest = int(lengths.sum()), int(lengths.max())
    x = [torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
         for h in (hq, hkv, hkv)]
    gout = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)

    def run():
        out = flash_attn_varlen_func(*x, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                     max_seqlen_k=longest, causal=True)
        (out[0] if isinstance(out, tuple) else out).backward(gout)
    run()
    return run, x


def _dense(mask, hq, hkv, d):
    """fwd+bwd of cuDNN causal SDPA on the padded rows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, length = mask.shape
    x = [torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
         for h in (hq, hkv, hkv)]
    gout = torch.randn(b, hq, length, d, device="cuda", dtype=torch.bfloat16)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True).backward(gout)
    run()
    return run, x


def _ours(pb, kernel, hq, hkv, d, layout="token"):
    """fwd+bwd of shared_prefix_attention; `layout` "token": q/k/v and the output gradient are
    transposed views of [1, T, H, D] tensors, as a model's projections give them; "head":
    contiguous [1, H, T, D] tensors."""
    token = layout == "token"
    shape = lambda h: (1, pb.seq_len, h, d) if token else (1, h, pb.seq_len, d)  # noqa: E731
    view = lambda t: t.transpose(1, 2) if token else t  # noqa: E731
    x = [torch.randn(shape(h), device="cuda", dtype=torch.bfloat16, requires_grad=True)
         for h in (hq, hkv, hkv)]
    gout = view(torch.randn(shape(hq), device="cuda", dtype=torch.bfloat16))

    def run():
        shared_prefix_attention(*map(view, x), pb, attention_backend=kernel).backward(gout)
    run()  # compiles once per packed-length bucket
    return run, x


def run_case(seed, p_cap, r_cap, args, aligned=False) -> dict:
    tokens, mask, p, n, prompts, responses = ragged_case(seed, p_cap, r_cap, args.max_tokens,
                                                         aligned)
    on_cpu = pack(tokens, prompt_len=p, padding_mask=mask)
    tiles = tile_counts(on_cpu, mask)
    if args.tiles_only:
        return {"layout": "block-aligned twin" if aligned else "ragged", "seed": seed, "P_cap": p_cap, "R_cap": r_cap, "groups": len(prompts), "N": n,
                "ideal": on_cpu.pair_reduction, "tiles": tiles,
                "layout_bounds": layout_bounds(prompts, responses)}
    pb = pack(tokens.cuda(), prompt_len=p, padding_mask=mask.cuda())
    row = {"layout": "block-aligned twin" if aligned else "ragged", "tiles": tiles, "seed": seed, "P_cap": p_cap, "R_cap": r_cap, "groups": len(prompts), "N": n,
           "prompt_lengths": prompts, "mean_response": sum(map(sum, responses)) / (len(prompts) * n),
           "rows": tokens.shape[0], "padded_tokens": mask.numel(),
           "replicated_tokens": pb.replicated_tokens, "packed_tokens": pb.num_tokens,
           "T": pb.seq_len, "ideal": pb.pair_reduction}
    dims = (args.heads, args.kv_heads, args.head_dim)
    variants = {}
    for name, build in [("fa4_varlen", lambda: _varlen(mask, *dims)),
                        ("cudnn_dense", lambda: _dense(mask, *dims))] + [
            (name, lambda k=k, lay=lay: _ours(pb, k, *dims, lay))
            for name, k, lay in _ours_variants(args)]:
        try:
            variants[name] = build()
        except (torch.OutOfMemoryError, RuntimeError, ImportError) as e:
            row[name] = {"ms": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    for name, ms in interleaved_medians(variants, rounds=args.rounds, warmup_ms=50,
                                        rep_ms=args.rep_ms).items():
        row[name] = {"ms": ms}
    base = row.get("fa4_varlen", {}).get("ms")
    for name, _, _ in _ours_variants(args):
        ours = row.get(name, {}).get("ms")
        if base and ours:
            row[name]["x_ideal"] = base / ours / pb.pair_reduction
    return row


def _ours_variants(args):
    """[(result key, kernel, input layout)] of ours."""
    return [(f"ours_{k}" + ("" if lay == "token" else f"_{lay}"), k, lay)
            for k in args.kernels for lay in args.input_layouts]


def _table(rows, args) -> str:
    variants = _ours_variants(args)
    head = ("| P cap | R cap | seed | layout | groups x N | ideal | FA4 varlen ms | cuDNN dense ms | "
            + " | ".join(f"{k}{'' if lay == 'token' else ' (head-major)'} ms (x ideal)"
                         for _, k, lay in variants) + " |")
    lines = ["Ragged shared-prefix attention, fwd+bwd, bf16\n", head,
             "|" + "---|" * (8 + len(variants))]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        ours = [f"{fmt(r.get(name, {}).get('ms'))} ({fmt(r.get(name, {}).get('x_ideal'))})"
                for name, _, _ in variants]
        lines.append(f"| {r['P_cap']} | {r['R_cap']} | {r['seed']} | {r['layout']} | "
                     f"{r['groups']} x {r['N']} | "
                     f"{r['ideal']:.2f} | {fmt(r.get('fa4_varlen', {}).get('ms'))} | "
                     f"{fmt(r.get('cudnn_dense', {}).get('ms'))} | " + " | ".join(ours) + " |")
    return "\n".join(lines) + "\n"


def _tiles_table(rows) -> str:
    lines = ["128 x 128 tiles per case: the packed BlockMask's against a causal varlen kernel's; "
             "then, for other layouts, the bound (varlen tile area / ours / ideal) and the partial "
             "share of the visited area (tools/ragged_tiles.py)\n",
             "| P cap | R cap | seed | layout | groups x N | ideal | tiles ours (partial) | "
             "tiles varlen | varlen / ours / ideal | " + " | ".join(LAYOUTS) + " |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(LAYOUTS)]
    for r in rows:
        t = r["tiles"]
        lines.append(f"| {r['P_cap']} | {r['R_cap']} | {r['seed']} | {r['layout']} | "
                     f"{r['groups']} x {r['N']} | {r['ideal']:.2f} | {t['ours']} ({t['partial'] / t['ours']:.0%}) | "
                     f"{t['varlen']} | {t['varlen'] / t['ours'] / r['ideal']:.2f} | "
                     + " | ".join(f"{b['bound']:.2f} ({b['partial']:.0%})"
                                  for b in r["layout_bounds"].values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None, prog=None):
    """`prog` names the benchmark in its usage and errors (default: the script's name)."""
    ap = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=seed_int, nargs="+", default=[0, 1, 2],
                    help="the layouts' seeds, one case per seed and cap pair (default 0 1 2)")
    ap.add_argument("--caps", type=parse_caps, nargs="+", default=list(CAPS),
                    metavar="P_cap,R_cap", help="prompt and response length caps (default: "
                    + " ".join(f"{p},{r}" for p, r in CAPS) + ")")
    ap.add_argument("--kernels", nargs="+", default=["auto"], choices=list(KERNELS),
                    help="attention kernels of ours (DualKVConfig.attention_backend values)")
    ap.add_argument("--input-layouts", nargs="+", choices=["token", "head"], default=["token"],
                    help="q/k/v memory layouts to time ours with (token: a model's)")
    ap.add_argument("--max-tokens", type=positive_int, default=262144,
                    help="replicated tokens per micro-batch at most (default 262144)")
    ap.add_argument("--heads", type=positive_int, default=32)
    ap.add_argument("--kv-heads", type=positive_int, default=8)
    ap.add_argument("--head-dim", type=positive_int, default=128)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--rep-ms", type=positive_int, default=600)
    ap.add_argument("--aligned-twins", action="store_true",
                    help="also time each case's block-aligned twin (every length rounded up to "
                         "a whole 128-token block, the layouts where FLASH takes FA4's causal "
                         "form) against FA4 varlen on its own rows")
    ap.add_argument("--tiles-only", action="store_true",
                    help="count the tiles of each case (CPU) and time nothing")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    layouts = [False, True] if args.aligned_twins else [False]
    if args.tiles_only:
        meta = {"tiles_only": True, "torch": torch.__version__,
                "python": platform.python_version(), "max_tokens": args.max_tokens}
        table = _tiles_table
    elif not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU (--tiles-only counts tiles on the CPU)")
    else:
        meta = environment() | {"dtype": "bfloat16", "heads": args.heads,
                                "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                "rounds": args.rounds, "rep_ms": args.rep_ms,
                                "max_tokens": args.max_tokens,
                                "input_layouts": args.input_layouts}
        table = lambda rows: _table(rows, args)  # noqa: E731
    rows = []
    for p_cap, r_cap in args.caps:
        for seed in args.seeds:
            for aligned in layouts:
                rows.append(run_case(seed, p_cap, r_cap, args, aligned))
                save_progress(args.out, meta, rows, table(rows))
                if not args.tiles_only:
                    torch.cuda.empty_cache()
    write_results(args.out, meta, rows, table(rows))


if __name__ == "__main__":
    main()
