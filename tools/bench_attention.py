"""Attention forward+backward benchmark: dense causal SDPA on the replicated batch (flash and
cuDNN backends) against shared_prefix_attention on the packed batch. Not a test.

    python -m dualkv_compile.tools.bench_attention --out docs/results/attention_h100

prints a table and writes <out>.json and <out>.md. Useful FLOPs count only the causal pairs
each layout needs (forward 4*D*Hq per pair, backward 2.5x forward); speed-up is best dense time
over ours; `/ideal` divides it by the pair reduction, the speed-up a kernel of equal per-pair
efficiency would give. All variants of a shape are timed in interleaved rounds in one process;
`compile s` is the first call of the packed op at that length (a compile per length bucket,
plus the block mask).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from dualkv_compile import pack, shared_prefix_attention
from dualkv_compile.attention.op import _flex_attention
from dualkv_compile.attention.block_mask import shared_prefix_block_mask
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, add_shapes_argument,
                                          environment, interleaved_medians, positive_int,
                                          save_progress, write_results)

# the five shapes of issue #4, then long context (P=32K) and a layout of > 262,144 packed tokens
DEFAULT_SHAPES = ["16,2048,512", "32,4096,1024", "32,8192,1024", "16,8192,2048", "64,2048,512",
                  "16,32768,2048", "64,4096,4096"]



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


def fa4_dense_variant(n, length, hq, hkv, d):
    """fwd+bwd closure for flash-attn-4's own dense causal kernel on the replicated batch (its
    [B, T, H, D] layout, native GQA, its default options): the kernel family of our FLASH
    backend without a mask_mod or block sparsity, for telling the kernel's per-pair efficiency
    at a length from what the shared-prefix mask costs."""
    from flash_attn.cute import flash_attn_func

    x = [torch.randn(n, length, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
         for h in (hq, hkv, hkv)]
    gout = torch.randn(n, length, hq, d, device="cuda", dtype=torch.bfloat16)

    def run():
        out = flash_attn_func(*x, causal=True)
        (out[0] if isinstance(out, tuple) else out).backward(gout)
    run()
    return run, x


def region_floor(n, p, r, hq, hkv, d):
    """fwd+bwd of the three cuDNN calls the regions backend makes for one group, on tensors of
    their own: the prompt causally, N responses of R causally, N*R response tokens against the
    prompt. No merge, no copies: the floor the regions backend can reach with cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def qkvg(batch, lq, lk):
        x = [torch.randn(batch, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
             for h, t in ((hq, lq), (hkv, lk), (hkv, lk))]
        return x + [torch.randn(batch, hq, lq, d, device="cuda", dtype=torch.bfloat16)]

    calls = [(qkvg(1, p, p), True), (qkvg(n, r, r), True), (qkvg(1, n * r, p), False)]

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for (q, k, v, g), causal in calls:
                F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                               enable_gqa=True).backward(g)
    run()
    return run, [x for (q, k, v, _), _ in calls for x in (q, k, v)]


def ours_backends(requested: list[str], head_dim: int) -> list[str]:
    """The packed-op backends to time: each requested one that can run here."""
    from dualkv_compile.attention.selection import flash_status

    usable = []
    for b in requested:
        if b == "flash":
            ok, reason = flash_status(torch.device("cuda"), head_dim, torch.bfloat16)
            if not ok:
                print(f"skipping ours_flash: {reason}", flush=True)
                continue
        usable.append(b)
    return usable


def flex_flash_row(pb, qp, kp, vp, gp, variants, pairs) -> dict:
    """Add `ours_flash_flex`: flex FLASH (FA4 with the mask_mod, plain tile order) on the
    packed tensors, which `ours_flash` replaces by FA4's causal form on block-aligned layouts
    (flash_causal.py); returns its row entry with its largest differences from ours_flash."""
    from dualkv_compile.attention.flash_causal import block_aligned

    def flex():
        return _flex_attention(qp, kp, vp, pb, None, None, attention_backend="flash")

    def grads_of(fn):
        qp.grad = kp.grad = vp.grad = None
        out = fn()
        out.backward(gp)
        return [out.detach()] + [x.grad.clone() for x in (qp, kp, vp)]

    entry = {"block_aligned": block_aligned(pb)}
    t0 = time.perf_counter()
    got = grads_of(flex)  # compiles
    entry["first_call_s"] = time.perf_counter() - t0
    if "ours_flash" in variants and entry["block_aligned"]:  # the same attention: must agree
        ref = grads_of(lambda: shared_prefix_attention(qp, kp, vp, pb, attention_backend="flash"))
        entry["max_abs_diff_vs_ours_flash"] = {
            name: (a.float() - b.float()).abs().max().item()
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
    qp.grad = kp.grad = vp.grad = None
    variants["ours_flash_flex"] = (lambda: flex().backward(gp), [qp, kp, vp])
    pairs["ours_flash_flex"] = pb.attention_pairs[1]
    return entry


def run_shape(n, p, r, hq, hkv, d, args):
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
    row = {"N": n, "P": p, "R": r, "T": pb.seq_len, "tokens": pb.num_tokens, "rho": pb.rho,
           "pair_reduction": pb.pair_reduction, "pack_ms": (t1 - t0) * 1e3,
           "block_mask_ms": (t2 - t1) * 1e3}
    flop_per_pair = 4 * d * hq * 3.5
    variants, pairs = {}, {}

    def alloc(batch, t):
        x = [torch.randn(batch, h, t, d, device=dev, dtype=dt, requires_grad=True)
             for h in (hq, hkv, hkv)]
        return x + [torch.randn(batch, hq, t, d, device=dev, dtype=dt)]

    try:
        q, k, v, gout = alloc(n, length)
        for backend in ("flash", "cudnn"):
            try:
                fn, grads, mode = dense_variant(backend, q, k, v, gout)
                variants[f"dense_{backend}"], pairs[f"dense_{backend}"] = (fn, grads), replicated_pairs
                row[f"dense_{backend}"] = {"gqa": mode}
            except torch.OutOfMemoryError:
                row[f"dense_{backend}"] = {"ms": None, "error": "OOM"}
            except RuntimeError as e:
                row[f"dense_{backend}"] = {"ms": None, "error": str(e).splitlines()[0][:200]}
    except torch.OutOfMemoryError:
        for backend in ("flash", "cudnn"):
            row[f"dense_{backend}"] = {"ms": None, "error": "OOM"}

    try:
        qp, kp, vp, gp = alloc(1, pb.seq_len)
    except torch.OutOfMemoryError:  # the dense baseline's tensors are alive as well
        row["ours_error"] = "OOM allocating the packed tensors next to the dense ones"
        for backend in ("flash", "cudnn"):  # (timed below, with ours)
            if "error" not in row.get(f"dense_{backend}", {}):
                row[f"dense_{backend}"] = {"ms": None, "error": NOT_TIMED}
        return row

    def make_ours(backend, dynamic=False):
        def run():
            if dynamic:  # the same op compiled with a symbolic T, for comparison
                out = _flex_attention(qp, kp, vp, pb, None, None, dynamic=True,
                                      attention_backend=backend)
            else:
                out = shared_prefix_attention(qp, kp, vp, pb, attention_backend=backend)
            out.backward(gp)
        return run

    ours = [(f"ours_{b}", make_ours(b)) for b in ours_backends(args.backends, d)]
    if args.dynamic:
        ours.append(("ours_triton_dynamic", make_ours("triton", dynamic=True)))
    for name, fn in ours:
        t3 = time.perf_counter()
        fn()  # compiles: once per T and backend for the static op
        torch.cuda.synchronize()
        row[name] = {"first_call_s": time.perf_counter() - t3}
        variants[name], pairs[name] = (fn, [qp, kp, vp]), packed_pairs

    if args.flex_flash:
        row["ours_flash_flex"] = flex_flash_row(pb, qp, kp, vp, gp, variants, pairs)

    if args.fa4_dense:
        try:
            variants["fa4_dense"] = fa4_dense_variant(n, length, hq, hkv, d)
            pairs["fa4_dense"] = replicated_pairs
            row["fa4_dense"] = {}
        except torch.OutOfMemoryError:
            row["fa4_dense"] = {"ms": None, "error": "OOM"}

    if "regions" in args.backends:
        try:
            variants["cudnn_region_floor"] = region_floor(n, p, r, hq, hkv, d)
            pairs["cudnn_region_floor"] = packed_pairs
            row["cudnn_region_floor"] = {}
        except torch.OutOfMemoryError:
            row["cudnn_region_floor"] = {"ms": None, "error": "OOM"}

    try:
        medians = interleaved_medians(variants, rounds=args.rounds, warmup_ms=args.warmup_ms,
                                      rep_ms=args.rep_ms)
    except torch.OutOfMemoryError:
        row["timing_error"] = "OOM during the interleaved timing"
        return row
    for name, ms in medians.items():
        row[name].update(ms=ms, tflops=pairs[name] * flop_per_pair / ms / 1e9)
    if args.split:  # those whose kernels name their direction
        for name in ("dense_cudnn", "ours_flash", "ours_flash_flex", "fa4_dense"):
            if name in variants:
                row[name].update(forward_backward_split(variants[name][0]))
    dense_ms = [row[f"dense_{b}"].get("ms") for b in ("flash", "cudnn")]
    dense_ms = [x for x in dense_ms if x]
    if row.get("fa4_dense", {}).get("ms") and row["dense_cudnn"].get("ms"):
        row["fa4_dense"]["speedup_vs_cudnn"] = row["dense_cudnn"]["ms"] / row["fa4_dense"]["ms"]
    for name in [o for o, _ in ours] + ["ours_flash_flex", "cudnn_region_floor"]:
        if dense_ms and row.get(name, {}).get("ms"):
            row[name]["speedup_vs_best_dense"] = min(dense_ms) / row[name]["ms"]
            row[name]["speedup_over_ideal"] = row[name]["speedup_vs_best_dense"] / pb.pair_reduction
    return row


_FORWARD_KERNELS = ("fprop", "Forward")  # cuDNN's and FA4's forward kernels


def forward_backward_split(fn, calls: int = 3) -> dict:
    """GPU time of fn (forward + backward) split by kernel name, from the profiler, averaged
    over `calls` calls: forward = the attention forward kernels; backward = all the rest
    (backward kernels, their pre/post-processing, gradient accumulation)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    fwd = total = 0.0
    for e in prof.key_averages():
        t = e.self_device_time_total / 1e3 / calls  # us -> ms per call
        total += t
        if any(k in e.key for k in _FORWARD_KERNELS):
            fwd += t
    return {"fwd_ms": fwd, "bwd_ms": total - fwd}


def split_markdown(rows) -> str:
    """Forward and backward apart, each against cuDNN dense, divided by the ideal."""
    ours = list(dict.fromkeys(k for r in rows for k, v in r.items()
                              if (k.startswith("ours_") or k == "fa4_dense")
                              and isinstance(v, dict) and "fwd_ms" in v))
    cols = ["N", "P", "R", "cuDNN fwd ms", "cuDNN bwd ms"]
    for o in ours:
        cols += [f"{o} fwd ms", f"{o} fwd x/ideal", f"{o} bwd ms", f"{o} bwd x/ideal"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        dense = r["dense_cudnn"]
        cells = [str(r["N"]), str(r["P"]), str(r["R"]), fmt(dense.get("fwd_ms"), ".2f"),
                 fmt(dense.get("bwd_ms"), ".2f")]
        for o in ours:
            x = r.get(o, {})
            for part in ("fwd", "bwd"):
                ms, ref = x.get(f"{part}_ms"), dense.get(f"{part}_ms")
                ideal = 1.0 if o == "fa4_dense" else r["pair_reduction"]  # dense: same pairs
                cells += [fmt(ms, ".2f"), fmt(ref / ms / ideal if ms and ref else None, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return ("\nForward and backward apart (profiler GPU time of one call, mean of 3; forward "
            "= the attention forward kernels, backward = the rest; fa4_dense's x/ideal is its "
            "speed-up over cuDNN on the same replicated batch):\n\n" + "\n".join(lines) + "\n")


NOT_TIMED = "not timed: the packed tensors did not fit beside it"


def fmt(x, spec):
    return "OOM/err" if x is None else format(x, spec)


def dense_cell(x: dict) -> str:
    return "not timed" if x.get("error") == NOT_TIMED else fmt(x.get("ms"), ".2f")


def markdown(meta, rows) -> str:
    head = (f"Attention fwd+bwd, {meta['dtype']}, Hq={meta['hq']}, Hkv={meta['hkv']}, "
            f"D={meta['d']}, one {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
            f"CUDA {meta['cuda']}{', flash-attn-4 ' + meta['flash_attn'] if meta.get('flash_attn') else ''}; "
            f"median over {meta['rounds']} interleaved rounds of do_bench medians (warm-up "
            f"{meta['warmup_ms']} ms, {meta['rep_ms']} ms in all). Speed-up: best dense (on the "
            f"replicated batch) over ours (on the packed batch); /ideal divides by the pair "
            f"reduction.\n\n")
    # columns from every row: a row whose packed tensors ran out of memory has only its
    # "ours_error" (a string), and may come first
    ours = list(dict.fromkeys(k for r in rows for k, v in r.items()
                              if k.startswith("ours_") and isinstance(v, dict)))
    cols = ["N", "P", "R", "packed tokens", "flash ms", "cuDNN ms"]
    for o in ours:
        cols += [f"{o} ms", f"{o} x", f"{o} x/ideal", f"{o} compile s"]
    floor = any("cudnn_region_floor" in r for r in rows)
    if floor:
        cols += ["cuDNN region floor ms", "floor x/ideal"]
    fa4 = any("fa4_dense" in r for r in rows)
    if fa4:
        cols += ["FA4 dense ms", "FA4 dense x cuDNN"]
    cols += ["ideal", "mask build ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r["N"]), str(r["P"]), str(r["R"]), str(r["tokens"]),
                 dense_cell(r["dense_flash"]), dense_cell(r["dense_cudnn"])]
        for o in ours:
            x = r.get(o, {})
            cells += [fmt(x.get("ms"), ".2f"), fmt(x.get("speedup_vs_best_dense"), ".2f"),
                      fmt(x.get("speedup_over_ideal"), ".2f"), fmt(x.get("first_call_s"), ".1f")]
        if floor:
            x = r.get("cudnn_region_floor", {})
            cells += [fmt(x.get("ms"), ".2f"), fmt(x.get("speedup_over_ideal"), ".2f")]
        if fa4:
            x = r.get("fa4_dense", {})
            cells += [fmt(x.get("ms"), ".2f"), fmt(x.get("speedup_vs_cudnn"), ".2f")]
        cells += [f"{r['pair_reduction']:.2f}x", f"{r['block_mask_ms']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    split = any("fwd_ms" in r.get("dense_cudnn", {}) for r in rows)
    return head + "\n".join(lines) + "\n" + (split_markdown(rows) if split else "")


def main(argv=None, prog=None):
    """`prog` names the benchmark in its usage and errors (default: the script's name)."""
    ap = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_shapes_argument(ap, DEFAULT_SHAPES)
    ap.add_argument("--heads", type=positive_int, default=32, help="query heads (default 32)")
    ap.add_argument("--kv-heads", type=positive_int, default=8,
                    help="key/value heads, dividing --heads (default 8)")
    ap.add_argument("--head-dim", type=positive_int, default=128, help="default 128")
    ap.add_argument("--warmup-ms", type=positive_int, default=100,
                    help="do_bench's warm-up per variant, ms (default 100)")
    ap.add_argument("--rep-ms", type=positive_int, default=1000,
                    help="do_bench's timing per variant, ms, split over the rounds (default 1000)")
    ap.add_argument("--rounds", type=positive_int, default=5,
                    help="interleaved timing rounds (default 5)")
    ap.add_argument("--backends", nargs="+", choices=["triton", "flash", "regions"],
                    default=["triton", "flash", "regions"],
                    help="packed-op backends to time (flash where flash-attn-4 runs; regions: "
                         "cuDNN over the two KV regions)")
    ap.add_argument("--dynamic", action="store_true",
                    help="also time the Triton op compiled with a symbolic T")
    ap.add_argument("--split", action="store_true",
                    help="also profile cuDNN dense and ours_flash and report their forward and "
                         "backward GPU time apart")
    ap.add_argument("--fa4-dense", action="store_true",
                    help="also time flash-attn-4's dense causal kernel on the replicated batch "
                         "(a diagnostic next to cuDNN, not a baseline of the speed-ups)")
    ap.add_argument("--flex-flash", action="store_true",
                    help="also time flex FLASH (the mask_mod form) where ours_flash runs FA4's "
                         "causal form (block-aligned layouts, dualkv_compile/attention/flash_causal.py)")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    if args.heads % args.kv_heads:
        ap.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    meta = {**environment(), "dtype": "bfloat16", "hq": args.heads, "hkv": args.kv_heads,
            "d": args.head_dim, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "rounds": args.rounds}
    rows = []
    for n, p, r in args.shapes:
        row = run_shape(n, p, r, args.heads, args.kv_heads, args.head_dim, args)
        torch.cuda.empty_cache()
        rows.append(row)
        save_progress(args.out, meta, rows, markdown(meta, rows))
    write_results(args.out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
