"""Attention forward+backward benchmark: dense causal SDPA on the replicated batch (flash and
cuDNN backends) against shared_prefix_attention on the packed batch. Not a test.

    python -m dualkv_compile.tools.bench_attention --out docs/results/attention_h100

prints a table and writes <out>.json and <out>.md. Useful FLOPs count only the causal pairs
each layout needs (forward 4*D*Hq per pair, backward 2.5x forward); speed-up is best dense time
over ours; `/ideal` divides it by the pair reduction, the speed-up a kernel of equal per-pair
efficiency would give.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from dualkv_compile import pack, shared_prefix_attention
from dualkv_compile.attention import _flex_attention
from dualkv_compile.block_mask import shared_prefix_block_mask
from dualkv_compile.tools._common import add_shapes_argument, environment

DEFAULT_SHAPES = ["16,2048,512", "32,4096,1024", "32,8192,1024", "16,8192,2048", "64,2048,512"]



def bench(fn, grads, warmup_ms, rep_ms) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grads, return_mode="median")


def dense_variant(backend, q, k, v, gout):
    """fwd+bwd closure for SDPA on one backend; GQA native if the backend takes it, else K/V
    expanded to all heads beforehand (as torchtune does), outside the timed region."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    rep = q.shape[1] // k.shape[1]
    for gqa in (True, False):
        kk, vv = (k, v) if gqa else (
            x.detach().repeat_interleave(rep, 1).requires_grad_() for x in (k, v))

        def run():
            with sdpa_kernel(be):
                out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
            out.backward(gout)

        try:
            run()
            torch.cuda.synchronize()
            return run, [q, kk, vv], "native GQA" if gqa else "K/V expanded"
        except RuntimeError as e:  # backend refuses GQA (or the shape): try the next form
            last = e
    raise RuntimeError(f"SDPA backend {backend} cannot run this shape: {last}")


def run_shape(n, p, r, hq, hkv, d, warmup_ms, rep_ms, layouts=False):
    dev, dt = "cuda", torch.bfloat16
    length = p + r
    tokens = torch.cat([torch.randint(1, 1000, (1, p)).expand(n, p),
                        torch.randint(1, 1000, (n, r))], dim=1).to(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pb = pack(tokens, prompt_len=p, group_size=n)
    t1 = time.perf_counter()
    shared_prefix_block_mask(pb, dev)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    replicated_pairs, packed_pairs = pb.attention_pairs
    row = {"N": n, "P": p, "R": r, "T": pb.seq_len, "rho": pb.rho,
           "pair_reduction": pb.pair_reduction, "pack_ms": (t1 - t0) * 1e3,
           "block_mask_ms": (t2 - t1) * 1e3}
    flop_per_pair = 4 * d * hq * 3.5

    q = torch.randn(n, hq, length, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(n, hkv, length, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(n, hkv, length, d, device=dev, dtype=dt, requires_grad=True)
    gout = torch.randn(n, hq, length, d, device=dev, dtype=dt)
    fn = grads = None
    for backend in ("flash", "cudnn"):
        try:
            fn, grads, mode = dense_variant(backend, q, k, v, gout)
            ms = bench(fn, grads, warmup_ms, rep_ms)
            row[f"dense_{backend}"] = {"ms": ms, "gqa": mode,
                                       "tflops": replicated_pairs * flop_per_pair / ms / 1e9}
        except torch.OutOfMemoryError:
            row[f"dense_{backend}"] = {"ms": None, "error": "OOM"}
        except RuntimeError as e:
            row[f"dense_{backend}"] = {"ms": None, "error": str(e).splitlines()[0][:200]}
        torch.cuda.empty_cache()
    del q, k, v, gout, grads, fn
    torch.cuda.empty_cache()

    qp = torch.randn(1, hq, pb.seq_len, d, device=dev, dtype=dt, requires_grad=True)
    kp = torch.randn(1, hkv, pb.seq_len, d, device=dev, dtype=dt, requires_grad=True)
    vp = torch.randn(1, hkv, pb.seq_len, d, device=dev, dtype=dt, requires_grad=True)
    gp = torch.randn(1, hq, pb.seq_len, d, device=dev, dtype=dt)

    def ours():
        shared_prefix_attention(qp, kp, vp, pb).backward(gp)

    def ours_dynamic():  # the same op compiled with a symbolic T, for comparison
        _flex_attention(qp, kp, vp, pb, None, None, dynamic=True).backward(gp)

    # the layout a model hands over: [1, T, H, D] projections viewed as [1, H, T, D]
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (qp, kp, vp))
    gt = gp.transpose(1, 2).contiguous()

    def ours_transposed():
        shared_prefix_attention(qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2),
                                pb).backward(gt.transpose(1, 2))

    variants = [("ours", ours), ("ours_dynamic", ours_dynamic)]
    if layouts:
        variants.append(("ours_transposed", ours_transposed))
    for name, fn_ in variants:
        t3 = time.perf_counter()
        fn_()  # compiles: once per T for the static op, once or twice in all for the dynamic
        torch.cuda.synchronize()
        ms = bench(fn_, [qp, kp, vp, qt, kt, vt], warmup_ms, rep_ms)
        row[name] = {"ms": ms, "tflops": packed_pairs * flop_per_pair / ms / 1e9,
                     "first_call_s": time.perf_counter() - t3}
    ms = row["ours"]["ms"]
    dense_ms = [row[f"dense_{b}"]["ms"] for b in ("flash", "cudnn") if row[f"dense_{b}"]["ms"]]
    if dense_ms:
        row["speedup_vs_best_dense"] = min(dense_ms) / ms
        row["speedup_over_ideal"] = row["speedup_vs_best_dense"] / pb.pair_reduction
    for b in ("flash", "cudnn"):
        if row[f"dense_{b}"]["ms"]:
            row[f"speedup_vs_{b}"] = row[f"dense_{b}"]["ms"] / ms
    del qp, kp, vp, gp, qt, kt, vt, gt
    torch.cuda.empty_cache()
    return row


def fmt(x, spec):
    return "OOM/err" if x is None else format(x, spec)


def markdown(meta, rows) -> str:
    head = (f"Attention fwd+bwd, {meta['dtype']}, Hq={meta['hq']}, Hkv={meta['hkv']}, "
            f"D={meta['d']}, one {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
            f"CUDA {meta['cuda']}; median of do_bench (warm-up {meta['warmup_ms']} ms, "
            f"rep {meta['rep_ms']} ms).\n\n")
    cols = ["N", "P", "R", "T", "flash ms", "cuDNN ms", "ours ms", "ours dyn. ms", "flash TFLOP/s",
            "cuDNN TFLOP/s", "ours TFLOP/s", "ideal", "speed-up", "speed-up/ideal",
            "mask build ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        f, c, o = r["dense_flash"], r["dense_cudnn"], r["ours"]
        lines.append("| " + " | ".join([
            str(r["N"]), str(r["P"]), str(r["R"]), str(r["T"]),
            fmt(f["ms"], ".2f"), fmt(c["ms"], ".2f"), fmt(o["ms"], ".2f"),
            fmt(r["ours_dynamic"]["ms"], ".2f"),
            fmt(f.get("tflops"), ".0f"), fmt(c.get("tflops"), ".0f"), fmt(o["tflops"], ".0f"),
            f"{r['pair_reduction']:.2f}x", fmt(r.get("speedup_vs_best_dense"), ".2f"),
            fmt(r.get("speedup_over_ideal"), ".2f"), f"{r['block_mask_ms']:.1f}",
        ]) + " |")
    return head + "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shapes_argument(ap, DEFAULT_SHAPES)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup-ms", type=int, default=200)
    ap.add_argument("--rep-ms", type=int, default=1000)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--layouts", action="store_true",
                    help="also time ours on [1, T, H, D] tensors viewed as [1, H, T, D]")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    if args.heads % args.kv_heads:
        ap.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    meta = {**environment(), "dtype": "bfloat16", "hq": args.heads, "hkv": args.kv_heads,
            "d": args.head_dim, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms}
    rows = []
    for n, p, r in args.shapes:
        row = run_shape(n, p, r, args.heads, args.kv_heads, args.head_dim,
                        args.warmup_ms, args.rep_ms, layouts=args.layouts)
        print(json.dumps(row), flush=True)
        rows.append(row)
    table = markdown(meta, rows)
    print(table)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
