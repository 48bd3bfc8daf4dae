"""Mask-form benchmark (not a test): the same shared-prefix BlockMask with
mask_mods that mean the same thing, timed fwd+bwd on a flex backend in one process.

- "visible_until" (what the library uses): kv <= q < visible_until[kv]: one table load, indexed
  by the key, for every element of a partial block.
- "segments" (the form the one-table mask replaced): kv <= q and (seg[kv] == seg[q] or
  seg[kv] == pre[q]): three loads.
- "intervals": kv in [own_lo[q], q] or kv in [prefix_lo[q], prefix_hi[q]): three loads indexed
  by the query only.
- with --bounds, two variants that compute wrong values, to bound what masking costs: "no_op"
  (the partial blocks with a mask_mod that keeps everything) and "all_full" (every visited
  block run as a full one, no mask_mod at all).

Only partial blocks evaluate the mask_mod, so the difference shows where they are a larger
share: ragged layouts (`--ragged P_cap,R_cap,seed ...`, bench ragged's cases). Outputs of the
exact forms are compared (they must be equal bit for bit).

    python -m dualkv_compile.tools.bench mask-forms --backend flash --out docs/results/mask_forms_h100
    python -m dualkv_compile.tools.bench mask-forms --ragged 2048,512,1 2048,512,0 \
        --bounds --varlen --out docs/results/mask_forms_ragged_h200

(With --ragged, the aligned shapes run only when --shapes is given.)
"""

from __future__ import annotations


import torch

from dualkv_compile import pack
from dualkv_compile.attention.block_mask import (_classify_blocks, _to_indices, _token_intervals,
                                                 shared_prefix_block_mask)
from dualkv_compile.attention.kernel_options import kernel_options_for
from dualkv_compile.attention.op import _flex
from dualkv_compile.recompiles import bounded_recompiles
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, add_shapes_argument,
                                          environment, interleaved_medians, parse_ragged_case,
                                          positive_int, ragged_only, save_progress, write_results)

DEFAULT_SHAPES = ["32,4096,1024", "64,2048,512", "32,8192,1024"]
EXACT = ("visible_until", "segments", "intervals")


def segment_mask_mod(segment_ids, prefix_segment_ids):
    def shared_prefix_segments(b, h, q_idx, kv_idx):
        seg_kv = segment_ids[kv_idx]
        same = seg_kv == segment_ids[q_idx]
        return (kv_idx <= q_idx) & (same | (seg_kv == prefix_segment_ids[q_idx]))

    return shared_prefix_segments


def interval_mask_mod(prefix_lo, prefix_hi, own_lo):
    def shared_prefix_intervals(b, h, q_idx, kv_idx):
        own = (kv_idx >= own_lo[q_idx]) & (kv_idx <= q_idx)
        return own | ((kv_idx >= prefix_lo[q_idx]) & (kv_idx < prefix_hi[q_idx]))

    return shared_prefix_intervals


def _no_op_mask_mod(b, h, q_idx, kv_idx):
    return kv_idx >= 0


def block_masks(pb, dev, bounds: bool) -> dict:
    """{form: BlockMask}, all with the library's block lists."""
    from torch.nn.attention.flex_attention import BlockMask

    lib = shared_prefix_block_mask(pb, dev)
    lists = (lib.kv_num_blocks, lib.kv_indices, lib.full_kv_num_blocks, lib.full_kv_indices)

    def with_mod(mod, blocks=lists):
        return BlockMask.from_kv_blocks(*blocks, BLOCK_SIZE=lib.BLOCK_SIZE, mask_mod=mod,
                                        seq_lengths=(pb.seq_len, pb.seq_len))

    lo, hi, own = (x.to(torch.int32) for x in _token_intervals(pb, dev))
    seg, pre = (x[0].to(dev) for x in (pb.segment_ids, pb.prefix_segment_ids))
    masks = {"visible_until": lib, "segments": with_mod(segment_mask_mod(seg, pre)),
             "intervals": with_mod(interval_mask_mod(lo, hi, own))}
    if bounds:
        partial, full = _classify_blocks(pb, torch.device(dev))
        masks["no_op"] = with_mod(_no_op_mask_mod)
        masks["all_full"] = with_mod(lib.mask_mod, (*_to_indices(torch.zeros_like(partial)),
                                                    *_to_indices(partial | full)))
    return masks


def _layouts(args, dev):
    """(label, PackedBatch on dev, padding mask or None) per case."""
    for n, p, r in args.shapes:
        tokens = torch.cat([torch.randint(1, 1000, (1, p)).expand(n, p),
                            torch.randint(1, 1000, (n, r))], dim=1).to(dev)
        yield f"{n},{p},{r}", pack(tokens, prompt_len=p, group_size=n), None
    for p_cap, r_cap, seed in args.ragged:  # parsed by _common.parse_ragged_case
        from dualkv_compile.tools.bench_ragged import ragged_case

        tokens, mask, p, n, prompts, _ = ragged_case(seed, p_cap, r_cap, args.max_tokens)
        label = f"ragged {p_cap},{r_cap} seed {seed} ({len(prompts)} x {n})"
        yield label, pack(tokens.to(dev), prompt_len=p, padding_mask=mask.to(dev)), mask


def main(argv=None, prog=None):
    """`prog` names the benchmark in its usage and errors (default: the script's name)."""
    ap = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_shapes_argument(ap, DEFAULT_SHAPES)
    ap.add_argument("--ragged", type=parse_ragged_case, nargs="+", default=[],
                    metavar="P_cap,R_cap,seed", help="bench ragged's seeded cases")
    ap.add_argument("--max-tokens", type=positive_int, default=262144)
    ap.add_argument("--backend", choices=["flash", "triton"], default="flash")
    ap.add_argument("--bounds", action="store_true", help="also time no_op and all_full")
    ap.add_argument("--varlen", action="store_true",
                    help="also time FA4's varlen kernel on the ragged rows (x ideal)")
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--rep-ms", type=positive_int, default=3000)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    ragged_only(ap, args)
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")

    hq, hkv, d, dev, dt = 32, 8, 128, "cuda", torch.bfloat16
    # FLASH (the default backend) and --varlen's kernel are flash-attn-4's: without it, or on
    # a GPU it does not run on, kernel_options_for raised a ValueError (or the varlen import
    # an ImportError) mid-run
    needs_fa4 = [flag for flag, used in (("--backend flash", args.backend == "flash"),
                                         ("--varlen", args.varlen and args.ragged)) if used]
    if needs_fa4:
        from dualkv_compile.attention.selection import flash_status

        ok, reason = flash_status(torch.device(dev), d, dt)
        if not ok:
            verb = "needs" if len(needs_fa4) == 1 else "need"
            ap.error(f"{' and '.join(needs_fa4)} {verb} flash-attn-4 on this GPU: {reason}"
                     + ("; --backend triton runs without it" if args.backend == "flash" else ""))
    meta = {**environment(), "backend": args.backend, "hq": hq, "hkv": hkv, "d": d,
            "dtype": "bfloat16", "rounds": args.rounds, "rep_ms": args.rep_ms}
    options = kernel_options_for(torch.device(dev), None, head_dim=d, gqa=hq // hkv, dtype=dt,
                                 attention_backend=args.backend)
    rows, cases = [], len(args.shapes) + len(args.ragged)
    for label, pb, padding in _layouts(args, dev):
        t = pb.seq_len
        q, k, v = (torch.randn(1, h, t, d, device=dev, dtype=dt, requires_grad=True)
                   for h in (hq, hkv, hkv))
        gout = torch.randn(1, hq, t, d, device=dev, dtype=dt)

        def variant(mask):
            def run():
                out = _flex(False)(q, k, v, block_mask=mask, enable_gqa=True,
                                   kernel_options=options)
                out.backward(gout)
                return out
            return run, [q, k, v]

        variants = {name: variant(m) for name, m in block_masks(pb, dev, args.bounds).items()}
        outs = {}
        # each mask_mod closure is its own compile (a limit, not a silent fallback)
        with bounded_recompiles(2 * len(variants) * cases, "the mask-form benchmark"):
            for name, (fn, _) in variants.items():  # compile, and check the forms agree
                outs[name] = fn().detach()
                q.grad = k.grad = v.grad = None
            if args.varlen and padding is not None:
                from dualkv_compile.tools.bench_ragged import _varlen

                variants["fa4_varlen"] = _varlen(padding, hq, hkv, d)
            ms = interleaved_medians(variants, rounds=args.rounds, warmup_ms=100,
                                     rep_ms=args.rep_ms)
        row = {"case": label, "T": t, "ideal": pb.pair_reduction, "ms": ms,
               "speed_up_over_segments": {k: ms["segments"] / v for k, v in ms.items()},
               "outputs_equal": all(torch.equal(outs["segments"], outs[k]) for k in EXACT)}
        if "fa4_varlen" in ms:
            row["x_ideal"] = {k: ms["fa4_varlen"] / v / pb.pair_reduction for k, v in ms.items()
                              if k != "fa4_varlen"}
        rows.append(row)
        save_progress(args.out, meta, rows, _table(rows, args, meta))
        torch.cuda.empty_cache()
    write_results(args.out, meta, rows, _table(rows, args, meta))


def _table(rows, args, meta) -> str:
    forms = [k for k in rows[0]["ms"] if k != "fa4_varlen"] if rows else []
    lines = [f"Mask forms, fwd+bwd, {args.backend}, bf16, Hq=32, Hkv=8, D=128, one {meta['gpu']}, "
             f"torch {meta['torch']}; median of {args.rounds} interleaved rounds; ms "
             f"(x ideal against FA4 varlen, where timed). no_op and all_full compute wrong "
             f"values: bounds.\n",
             "| case | T | " + " | ".join(forms) + " | exact forms equal |",
             "|---|---|" + "---|" * len(forms) + "---|"]
    for w in rows:
        cells = [f"{w['ms'][f]:.2f}" + (f" ({w['x_ideal'][f]:.2f})" if "x_ideal" in w else "")
                 for f in forms]
        lines.append(f"| {w['case']} | {w['T']} | " + " | ".join(cells)
                     + f" | {w['outputs_equal']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
