"""Consecutive rollout calls whose prompt lengths vary, as a ragged batch's do: each call timed
whole (prefill, decode, and any new cache, compile or CUDA graph capture), bf16, one process.
Not a test.

    python -m dualkv_compile.tools.bench rollout-calls --layers 8 --shape 16,4096,1024 \\
        --groups 2 --prompt-lens 4000 3300 3900 3400 4050 3250

Variants, run one after the other in the same process on the same model:
- engine: one RolloutEngine for all calls (a call whose prompts fit the held prompt capacity
  with at most 2x padding reuses its workspace; two call shapes are held);
- one_workspace: the same with max_workspaces=1, which is what the engine did before it held
  two call shapes (each change of shape, e.g. `--groups 4 3`, made a new cache and capture);
- rebuild: the engine with its workspaces dropped whenever a call's prompt bucket differs
  from the previous call's, which is what the engine did before it kept the capacity
  (every change of bucket made a new cache and recaptured the graphs; compiles stay cached).
Call i has groups[i % len(groups)] prompts. Each variant first runs one call per distinct
(bucket, groups) (compiles, excluded), then `--rounds` passes over the prompt lengths, timed.
"""

from __future__ import annotations

import statistics
import time

import torch

from dualkv_compile.models import qwen3_8b
from dualkv_compile.models.qwen3_sizes import QWEN3_VOCAB
from dualkv_compile.rollout import RolloutEngine, prompt_bucket
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, environment,
                                          parse_shape, positive_int, save_progress, write_results)

VARIANTS = ("engine", "one_workspace", "rebuild")


def _prompts(groups: int, width: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[groups, width] left-padded prompts: the first `length` tokens long, the others shorter
    by up to a tenth (a longest prompt per call sets its bucket)."""
    x = torch.randint(2, QWEN3_VOCAB, (groups, width), device="cuda", generator=gen)
    for g in range(groups):
        x[g, : width - (length - g * length // (10 * groups))] = 0
    return x


def _run(model, variant: str, calls: list, n: int, r: int, warm: list) -> dict:
    engine = RolloutEngine(model, max_workspaces=1 if variant == "one_workspace" else 2)
    gen = torch.Generator("cuda").manual_seed(0)
    previous = None
    times = []
    for i, prompts in enumerate(warm + calls):
        bucket = prompt_bucket(int((prompts != 0).sum(1).max()))
        if variant == "rebuild" and bucket != previous:
            engine.release()  # the engine before it kept no prompt capacity across buckets
        previous = bucket
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, group_size=n, max_generated_tokens=r, pad_id=0, rng=gen)
        torch.cuda.synchronize()
        if i >= len(warm):
            times.append(time.perf_counter() - t0)
    return {"variant": variant, "call_s": times, "median_call_s": statistics.median(times),
            "total_s": sum(times), "workspaces": engine.stats["workspaces"],
            "captures": engine.stats["captures"],
            "compiled_functions": engine.stats["compiled_functions"],
            "kv_gib": engine.kv_bytes() / 2 ** 30,
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}


def _table(rows, meta) -> str:
    lines = [f"Rollout calls, {meta['layers']} Qwen3-8B-shaped layers, bf16, {meta['groups']} "
             f"groups x N={meta['N']}, R={meta['R']}, prompt lengths {meta['prompt_lens']} "
             f"(buckets {meta['buckets']}), {meta['rounds']} rounds\n",
             "| variant | median call s | total s | workspaces | captures | KV GiB | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {x['variant']} | {x['median_call_s']:.3f} | {x['total_s']:.2f} | "
              f"{x['workspaces']} | {x['captures']} | {x['kv_gib']:.2f} | {x['peak_gib']:.1f} |"
              for x in rows]
    return "\n".join(lines) + "\n"


def main(argv=None, prog=None):
    """`prog` names the benchmark in its usage and errors (default: the script's name)."""
    ap = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=parse_shape, default=parse_shape("16,4096,1024"),
                    metavar="N,P,R", help="N responses of R tokens; P the prompts' padded width")
    ap.add_argument("--layers", type=positive_int, default=8)
    ap.add_argument("--groups", type=positive_int, nargs="+", default=[2],
                    help="prompts per call, cycled over the calls (e.g. 4 3: shapes alternate)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", metavar="L",
                    default=[4000, 3300, 3900, 3400, 4050, 3250],
                    help="each call's longest prompt, in call order (at most P)")
    ap.add_argument("--rounds", type=positive_int, default=2)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    n, p, r = args.shape
    if any(not 1 <= x <= p for x in args.prompt_lens):
        ap.error(f"--prompt-lens {args.prompt_lens} must lie in [1, P={p}]")
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = qwen3_8b(num_layers=args.layers, max_seq_len=p + r)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    gen = torch.Generator("cuda").manual_seed(0)
    groups = [args.groups[i % len(args.groups)] for i in range(len(args.prompt_lens))]
    calls = [_prompts(g, p, x, gen) for g, x in zip(groups, args.prompt_lens)] * args.rounds
    buckets = sorted({prompt_bucket(x) for x in args.prompt_lens})
    firsts = {(prompt_bucket(x), g): x for g, x in reversed(list(zip(groups, args.prompt_lens)))}
    warm = [_prompts(g, p, x, gen) for (_, g), x in sorted(firsts.items())]
    meta = environment() | {"layers": args.layers, "dtype": "bfloat16", "N": n, "P": p, "R": r,
                            "groups": args.groups, "prompt_lens": args.prompt_lens,
                            "buckets": buckets, "rounds": args.rounds,
                            "model": "qwen3-8b shaped, random weights"}
    rows = []
    for variant in VARIANTS:
        torch.cuda.reset_peak_memory_stats()
        rows.append(_run(model, variant, calls, n, r, warm))
        save_progress(args.out, meta, rows, _table(rows, meta))
        torch.cuda.empty_cache()
    write_results(args.out, meta, rows, _table(rows, meta))


if __name__ == "__main__":
    main()
