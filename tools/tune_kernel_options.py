"""Tune the Triton flex kernel options of the shared-prefix attention for this GPU. Not a test.

    python -m dualkv_compile.tools.tune_kernel_options --out docs/results/tune_sm90

For each head dim and GQA ratio (bf16, 32 query heads), on one packed layout: time the forward
alone for each forward candidate (block sizes, warps, stages, TMA), then forward + backward with
the best forward for each backward candidate. A candidate is kept only if it beats Inductor's
defaults by more than --min-gain; the result is printed as the entry of
dualkv_compile.attention.kernel_options.TRITON_OPTIONS_BY_ARCH for this architecture, and written with
every timing to OUT.json. Candidates that fail to compile (shared memory) are recorded as such.
"""

from __future__ import annotations

import json
import pprint

import torch
from tqdm import tqdm

from dualkv_compile import pack, shared_prefix_attention
from dualkv_compile.attention.kernel_options import validate_kernel_options
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, environment,
                                          interleaved_medians, non_negative_float, parse_shape,
                                          positive_int)

FWD_CANDIDATES = [
    {},  # Inductor's defaults
    {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3},
    {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3,
     "USE_TMA": True},
]
BWD_CANDIDATES = [
    {},
    {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
     "bwd_num_warps": 8, "bwd_num_stages": 2},
    {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
     "bwd_num_warps": 4, "bwd_num_stages": 3},
    {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
     "bwd_num_warps": 8, "bwd_num_stages": 3},
]


def time_candidates(candidates, tensors, pb, backward, args):
    q, k, v, g = tensors
    runs, failed = {}, {}
    for i, opts in enumerate(candidates):
        validate_kernel_options(opts)

        def run(opts=opts):
            out = shared_prefix_attention(q, k, v, pb, kernel_options=opts,
                                          attention_backend="triton")
            if backward:
                out.backward(g)

        try:
            run()
            torch.cuda.synchronize()
            runs[i] = (run, [q, k, v])
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot run is a result
            failed[i] = str(e).splitlines()[0][:200]
    ms = interleaved_medians({i: r for i, r in runs.items()}, rounds=args.rounds,
                             warmup_ms=50, rep_ms=args.rep_ms)
    return [{"options": candidates[i], "ms": ms.get(i), "error": failed.get(i)}
            for i in range(len(candidates))]


def tune_one(head_dim, gqa, args):
    torch._dynamo.reset()  # each candidate is a compile; keep within the recompile bound
    n, p, r = args.shape
    tokens = torch.cat([torch.randint(1, 1000, (1, p)).expand(n, p),
                        torch.randint(1, 1000, (n, r))], dim=1).cuda()
    pb = pack(tokens, prompt_len=p, group_size=n)
    hq, hkv = args.heads, args.heads // gqa
    tensors = [torch.randn(1, h, pb.seq_len, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for h in (hq, hkv, hkv)]
    tensors.append(torch.randn(1, hq, pb.seq_len, head_dim, device="cuda", dtype=torch.bfloat16))
    with torch.no_grad():
        fwd = time_candidates(FWD_CANDIDATES, tensors, pb, False, args)
    ok = [c for c in fwd if c["ms"]]
    best_fwd = min(ok, key=lambda c: c["ms"])["options"] if ok else {}
    bwd = time_candidates([{**best_fwd, **c} for c in BWD_CANDIDATES], tensors, pb, True, args)
    ok = [c for c in bwd if c["ms"]]
    default_ms = bwd[0]["ms"]  # best forward, default backward
    baseline = time_candidates([{}], tensors, pb, True, args)[0]["ms"]  # all defaults
    best = min(ok, key=lambda c: c["ms"]) if ok else {"options": {}, "ms": baseline}
    gain = baseline / best["ms"] - 1 if baseline and best["ms"] else 0.0
    chosen = best["options"] if gain > args.min_gain else {}
    return {"head_dim": head_dim, "gqa": gqa, "T": pb.seq_len, "fwd": fwd, "bwd": bwd,
            "default_ms": baseline, "best_fwd_default_bwd_ms": default_ms,
            "best_ms": best["ms"], "gain": gain, "chosen": chosen}


def main(argv=None):
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--gqa", type=positive_int, nargs="+", default=[1, 4, 8],
                    help="query heads per KV head; each must divide --heads")
    ap.add_argument("--heads", type=positive_int, default=32)
    ap.add_argument("--shape", type=parse_shape, default=(16, 2048, 512), metavar="N,P,R")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--rep-ms", type=positive_int, default=300)
    ap.add_argument("--min-gain", type=non_negative_float, default=0.02,
                    help="keep a tuned entry only if it is this much faster than the defaults")
    add_out_argument(ap, suffixes=(".json",))
    args = ap.parse_args(argv)
    bad = [g for g in args.gqa if args.heads % g]
    if bad:  # else every candidate fails at the kernel and "no tuned entry" is recorded
        ap.error(f"--gqa {bad[0]} does not divide --heads {args.heads}")
    if not torch.cuda.is_available():
        ap.error("tuning needs a CUDA GPU")
    from dualkv_compile.attention.kernel_options import TRITON_OPTIONS_BY_ARCH

    arch = tuple(torch.cuda.get_device_capability())
    TRITON_OPTIONS_BY_ARCH[arch] = {}  # candidates, "defaults" included, must not sit on old entries
    results, table = [], {}
    combos = [(d, g) for d in args.head_dims for g in args.gqa]
    for d, gqa in tqdm(combos, desc="tune", unit="shape", dynamic_ncols=True):
        res = tune_one(d, gqa, args)
        results.append(res)
        tqdm.write(json.dumps({k: res[k] for k in ("head_dim", "gqa", "default_ms", "best_ms",
                                                    "gain", "chosen")}))
        if res["chosen"]:
            table[(d, gqa)] = res["chosen"]
        if args.out:  # after every shape, so that a time limit keeps what was measured
            write(args, results, table)
    print(f"TRITON_OPTIONS_BY_ARCH[{arch}] =")
    pprint.pprint(table)


def write(args, results, table):
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": {**environment(), "shape": args.shape, "heads": args.heads,
                            "min_gain": args.min_gain},
                   "results": results,
                   "table": {f"{d},{g}": o for (d, g), o in table.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
