"""The benchmark suite behind one entry point (also `dualkv bench`):

    python -m dualkv_compile.tools.bench attention [--shapes N,P,R ...] [--out PATH]
    python -m dualkv_compile.tools.bench model     [...]   # response logprobs fwd + bwd
    python -m dualkv_compile.tools.bench step      [...]   # the same plus the AdamW step
    python -m dualkv_compile.tools.bench lm-head   [--rows M ...] # chunked LM-head logprobs
    python -m dualkv_compile.tools.bench mask-forms [...]  # equivalent mask_mods, one block mask
    python -m dualkv_compile.tools.bench linears [--tokens T ...] # projection GEMMs, fused or not
    python -m dualkv_compile.tools.bench rollout [--layers L ...]  # sampling: engine vs generate
    python -m dualkv_compile.tools.bench rollout-calls [...]  # calls whose prompt lengths vary
    python -m dualkv_compile.tools.bench ragged  [--seeds S ...]   # attention on ragged batches
    python -m dualkv_compile.tools.bench ab --other-dir DIR [...]  # this tree vs another commit

The shaped benchmarks take N,P,R shapes (lm-head rows, linears tokens, ragged its caps); each
writes JSON with the GPU, torch, triton, CUDA
(and flash-attn-4) versions, shapes, dtype, warm-up and repeat counts, reports medians, and runs
its baselines in the same process as the optimized variant.
"""

from __future__ import annotations

import importlib
import shlex
import sys

from ._common import ResultsWriteError, set_command

__all__ = ["SUITE", "run"]

# name -> (module, arguments it always gets)
SUITE = {
    "attention": ("dualkv_compile.tools.bench_attention", []),
    "model": ("dualkv_compile.tools.bench_policy_update", ["--no-optimizer"]),
    "step": ("dualkv_compile.tools.bench_policy_update", []),
    "lm-head": ("dualkv_compile.tools.bench_lm_head", []),
    "mask-forms": ("dualkv_compile.tools.bench_mask_forms", []),
    "linears": ("dualkv_compile.tools.bench_linears", []),
    "rollout": ("dualkv_compile.tools.bench_rollout", []),
    "rollout-calls": ("dualkv_compile.tools.bench_rollout_calls", []),
    "ragged": ("dualkv_compile.tools.bench_ragged", []),
    "ab": ("dualkv_compile.tools.bench_ab", []),
}


def run(name: str, argv: list[str], prog: str | None = None) -> None:
    """Run benchmark `name` with `argv`; its usage and errors name it as `prog` (default:
    `dualkv bench NAME`)."""
    if name not in SUITE:  # exit 2, as argparse does for a bad argument
        print(f"{prog or 'dualkv bench'}: error: unknown benchmark {name!r}; choose one of "
              f"{sorted(SUITE)}", file=sys.stderr)
        raise SystemExit(2)
    module, fixed = SUITE[name]
    prog = prog or f"dualkv bench {name}"
    set_command(f"{prog} {shlex.join(argv)}".rstrip())  # recorded in the results (run_record)
    try:
        importlib.import_module(module).main(fixed + list(argv), prog=prog)
    except ResultsWriteError as e:  # --out could not be written: one line, exit 1 as the CLI's
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0 if argv else 2)
        run(argv[0], argv[1:], prog=f"python -m dualkv_compile.tools.bench {argv[0]}")
    except BrokenPipeError:  # `... | head`: the reader left; end quietly, as the dualkv CLI
        from .cli import _drop_stdout

        _drop_stdout()
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
