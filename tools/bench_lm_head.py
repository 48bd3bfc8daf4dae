"""LM-head benchmark: response logprobs through `chunked_logprobs`, forward + backward, bf16,
the fused CUDA kernels against the same functions run eagerly (unfused; the weight-gradient
sum is the same in both), and a per-token loss fused into the LM head (`chunked_token_loss`:
the gradients computed in the forward, no recomputed logits), at several chunk sizes,
interleaved in one process. Not a test.

    python -m dualkv_compile.tools.bench lm-head --rows 32768 --out docs/results/lm_head_h100

Useful FLOPs: 6 x rows x d x V (the forward matmul and the two gradient matmuls); the backward's
recomputation of the logits is not counted, so "useful TFLOP/s" is comparable with the model
benchmark's MFU.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from dualkv_compile.lm_head import logprobs as lp
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, environment,
                                          interleaved_medians, positive_int, save_progress,
                                          write_results)


def _eager_kernels(device):
    return lp._chunk_stats, lp._chunk_grad


def main(argv=None, prog=None):
    """`prog` names the benchmark in its usage and errors (default: the script's name)."""
    ap = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[32768],
                    help="response positions (N x R)")
    ap.add_argument("--dim", type=positive_int, default=4096)
    ap.add_argument("--vocab", type=positive_int, default=151936)
    ap.add_argument("--chunks", type=positive_int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=positive_int, default=5)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    meta = {**environment(), "dim": args.dim, "vocab": args.vocab, "dtype": "bfloat16",
            "rounds": args.rounds}
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(args.vocab, args.dim, device="cuda", generator=g) * 0.02).bfloat16()
    w.requires_grad_()
    rows_out = []
    for rows in args.rows:
        h = torch.randn(rows, args.dim, device="cuda", generator=g).bfloat16().requires_grad_()
        targets = torch.randint(0, args.vocab, (rows,), device="cuda", generator=g)
        cot = torch.randn(rows, device="cuda", generator=g)

        def step(chunk, kind):
            def fn():
                if kind == "loss fused":
                    loss, _ = lp.chunked_token_loss(h, w, targets, lambda x, i: x * cot[i],
                                                    chunk_size=chunk)
                    loss.backward()
                    return
                with mock.patch.object(lp, "_kernels", _eager_kernels) if kind == "eager" else \
                        contextlib.nullcontext():
                    out = lp.chunked_logprobs(h, w, targets, chunk_size=chunk)
                    (out * cot).sum().backward()
            return fn

        variants = {f"{kind} chunk {c}": (step(c, kind), [h, w])
                    for c in args.chunks for kind in ("eager", "fused", "loss fused")}
        peaks = {}
        for name, (fn, _) in variants.items():  # warm up (compiles), and the peak memory
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            h.grad = w.grad = None
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = interleaved_medians(variants, rounds=args.rounds, warmup_ms=100, rep_ms=2000)
        flop = 6 * rows * args.dim * args.vocab
        row = {"rows": rows, "ms": ms, "extra_peak_gib": peaks,
               "useful_tflops": {k: flop / (v / 1e3) / 1e12 for k, v in ms.items()}}
        rows_out.append(row)
        save_progress(args.out, meta, rows_out, markdown(meta, rows_out))
    write_results(args.out, meta, rows_out, markdown(meta, rows_out))


def markdown(meta, rows):
    head = (f"LM-head response logprobs, forward + backward, bf16, d={meta['dim']}, "
            f"V={meta['vocab']}, one {meta['gpu']}, torch {meta['torch']}, triton "
            f"{meta['triton']}; median of {meta['rounds']} interleaved rounds. Extra peak: "
            f"memory above the inputs during the call.\n\n")
    lines = ["| rows | variant | ms | useful TFLOP/s | extra peak GiB |", "|---|---|---|---|---|"]
    for r in rows:
        for name, ms in r["ms"].items():
            lines.append(f"| {r['rows']} | {name} | {ms:.1f} | {r['useful_tflops'][name]:.0f} | "
                         f"{r['extra_peak_gib'][name]:.2f} |")
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
