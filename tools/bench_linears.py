"""Projection GEMMs of one decoder layer at T packed tokens, bf16: each linear on its own
against sibling linears that read the same input fused into one GEMM (q/k/v, gate/up), for the
three GEMMs autograd runs per linear (forward x W^T, input gradient dY W, weight gradient
dY^T x), interleaved in one process. Not a test.

    python -m dualkv_compile.tools.bench linears --tokens 40960 --out docs/results/linears_h100

Separate input gradients of siblings are summed (one add per extra sibling, timed with them);
fused ones come out of one GEMM over the concatenated output dimension.
"""

from __future__ import annotations


import torch

from dualkv_compile.tools._common import (OneLineParser, add_out_argument, environment,
                                          interleaved_medians, positive_int, save_progress,
                                          write_results)

# Qwen3-8B: hidden 4096, 32 x 128 query heads, 8 x 128 key-value heads, MLP 12288
GROUPS = {"qkv": (4096, [4096, 1024, 1024]), "gate_up": (4096, [12288, 12288]),
          "o": (4096, [4096]), "down": (12288, [4096])}


def _variants(x, dy_parts, weights):
    """{kind: fn} for the separate and the fused GEMMs of one sibling group."""
    w_cat = torch.cat(weights)
    dy_cat = torch.cat(dy_parts, dim=1)

    def separate_dx():
        out = dy_parts[0] @ weights[0]
        for d, w in zip(dy_parts[1:], weights[1:]):
            out = out + d @ w
        return out

    return {
        "forward": ([lambda: [x @ w.t() for w in weights], lambda: x @ w_cat.t()]),
        "input grad": ([separate_dx, lambda: dy_cat @ w_cat]),
        "weight grad": ([lambda: [d.t() @ x for d in dy_parts], lambda: dy_cat.t() @ x]),
    }


def main(argv=None, prog=None):
    """`prog` names the benchmark in its usage and errors (default: the script's name)."""
    ap = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=positive_int, nargs="+", default=[40960])
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--rep-ms", type=positive_int, default=1000)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    meta = {**environment(), "dtype": "bfloat16", "rounds": args.rounds, "rep_ms": args.rep_ms,
            "groups": GROUPS}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for t in args.tokens:
        for name, (d_in, outs) in GROUPS.items():
            x = torch.randn(t, d_in, device="cuda", generator=g).bfloat16()
            weights = [(torch.randn(o, d_in, device="cuda", generator=g) * 0.02).bfloat16()
                       for o in outs]
            dy = [torch.randn(t, o, device="cuda", generator=g).bfloat16() for o in outs]
            flop = 2 * t * d_in * sum(outs)
            for kind, (sep, fused) in _variants(x, dy, weights).items():
                variants = {"separate": (sep, None)}
                if len(outs) > 1:
                    variants["fused"] = (fused, None)
                ms = interleaved_medians(variants, rounds=args.rounds, warmup_ms=100,
                                         rep_ms=args.rep_ms)
                row = {"T": t, "group": name, "gemm": kind, "outs": outs, "tflop": flop / 1e12,
                       **{f"{k}_ms": v for k, v in ms.items()},
                       **{f"{k}_tflops": flop / v / 1e9 for k, v in ms.items()}}
                rows.append(row)
                save_progress(args.out, meta, rows, markdown(meta, rows))
            del x, weights, dy
    write_results(args.out, meta, rows, markdown(meta, rows))


def markdown(meta, rows):
    head = (f"Decoder-layer projection GEMMs, bf16, one {meta['gpu']}, torch {meta['torch']}, "
            f"CUDA {meta['cuda']}; median over {meta['rounds']} interleaved rounds of do_bench "
            f"medians. Fused: sibling linears of one input as one GEMM over the concatenated "
            f"outputs.\n\n")
    cols = ["T", "group", "outputs", "GEMM", "separate ms", "separate TFLOP/s", "fused ms",
            "fused TFLOP/s", "fused speed-up"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        fused = "fused_ms" in r
        lines.append("| " + " | ".join([
            str(r["T"]), r["group"], "+".join(map(str, r["outs"])), r["gemm"],
            f"{r['separate_ms']:.3f}", f"{r['separate_tflops']:.0f}",
            f"{r['fused_ms']:.3f}" if fused else "-",
            f"{r['fused_tflops']:.0f}" if fused else "-",
            f"{r['separate_ms'] / r['fused_ms']:.2f}x" if fused else "-"]) + " |")
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
