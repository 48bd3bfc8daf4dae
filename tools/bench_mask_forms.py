"""Mask-form benchmark (an experiment, not a test): the same shared-prefix BlockMask with two
mask_mods that mean the same thing, timed fwd+bwd on a flex backend in one process.

- "segments" (what the library uses): kv <= q and (seg[kv] == seg[q] or seg[kv] == pre[q]):
  one table load indexed by the key for every element of a partial block.
- "intervals": kv in [own_lo[q], q] or kv in [prefix_lo[q], prefix_hi[q]): loads indexed by the
  query only (the same for a whole row), then comparisons.

Only partial blocks evaluate the mask_mod, so the difference shows where they are a larger
share. Outputs of the two forms are compared (they must be equal bit for bit).

    python -m dualkv_compile.tools.bench mask-forms --backend flash --out docs/results/mask_forms_h100
"""

from __future__ import annotations

import argparse
import json

import torch

from dualkv_compile import pack
from dualkv_compile.attention.op import _flex
from dualkv_compile.attention.block_mask import _token_intervals, shared_prefix_block_mask
from dualkv_compile.attention.kernel_options import kernel_options_for
from dualkv_compile.recompiles import bounded_recompiles
from dualkv_compile.tools._common import (add_shapes_argument, environment,
                                          interleaved_medians, write_results)

DEFAULT_SHAPES = ["32,4096,1024", "64,2048,512", "32,8192,1024"]


def interval_mask_mod(prefix_lo, prefix_hi, own_lo):
    def shared_prefix_intervals(b, h, q_idx, kv_idx):
        own = (kv_idx >= own_lo[q_idx]) & (kv_idx <= q_idx)
        return own | ((kv_idx >= prefix_lo[q_idx]) & (kv_idx < prefix_hi[q_idx]))

    return shared_prefix_intervals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shapes_argument(ap, DEFAULT_SHAPES)
    ap.add_argument("--backend", choices=["flash", "triton"], default="flash")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    from torch.nn.attention.flex_attention import BlockMask

    hq, hkv, d, dev, dt = 32, 8, 128, "cuda", torch.bfloat16
    meta = {**environment(), "backend": args.backend, "hq": hq, "hkv": hkv, "d": d,
            "dtype": "bfloat16", "rounds": args.rounds}
    options = kernel_options_for(torch.device(dev), None, head_dim=d, gqa=hq // hkv, dtype=dt,
                                 attention_backend=args.backend)
    rows = []
    for n, p, r in args.shapes:
        tokens = torch.cat([torch.randint(1, 1000, (1, p)).expand(n, p),
                            torch.randint(1, 1000, (n, r))], dim=1).to(dev)
        pb = pack(tokens, prompt_len=p, group_size=n)
        seg_mask = shared_prefix_block_mask(pb, dev)
        lo, hi, own = (x.to(torch.int32) for x in _token_intervals(pb, dev))
        kv_num, kv_idx, full_num, full_idx = (seg_mask.kv_num_blocks, seg_mask.kv_indices,
                                              seg_mask.full_kv_num_blocks, seg_mask.full_kv_indices)
        int_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                            BLOCK_SIZE=seg_mask.BLOCK_SIZE,
                                            mask_mod=interval_mask_mod(lo, hi, own),
                                            seq_lengths=(pb.seq_len, pb.seq_len))
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

        variants = {"segments": variant(seg_mask), "intervals": variant(int_mask)}
        outs = {}
        # each mask_mod closure is its own compile: 2 per shape (a limit, not a silent fallback)
        with bounded_recompiles(4 * len(args.shapes), "the mask-form benchmark"):
            for name, (fn, _) in variants.items():  # compile, and check the forms agree
                outs[name] = fn().detach()
                q.grad = k.grad = v.grad = None
            ms = interleaved_medians(variants, rounds=args.rounds, warmup_ms=100, rep_ms=3000)
        row = {"N": n, "P": p, "R": r, "T": t, "ms": ms,
               "intervals_over_segments": ms["segments"] / ms["intervals"],
               "outputs_equal": bool(torch.equal(outs["segments"], outs["intervals"]))}
        print(json.dumps(row), flush=True)
        rows.append(row)
    lines = [f"Mask forms, fwd+bwd, {args.backend}, bf16, Hq={hq}, Hkv={hkv}, D={d}, one "
             f"{meta['gpu']}, torch {meta['torch']}; median of {args.rounds} interleaved rounds.\n",
             "| N | P | R | segments ms | intervals ms | speed-up | outputs equal |",
             "|---|---|---|---|---|---|---|"]
    for w in rows:
        lines.append(f"| {w['N']} | {w['P']} | {w['R']} | {w['ms']['segments']:.2f} | "
                     f"{w['ms']['intervals']:.2f} | {w['intervals_over_segments']:.3f}x | "
                     f"{w['outputs_equal']} |")
    write_results(args.out, meta, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
