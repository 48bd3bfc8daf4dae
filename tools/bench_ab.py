"""Same-process A/B of shared_prefix_attention: this tree against another copy of the package
(an older commit), kernel by kernel, on aligned and ragged layouts. Not a test.

Two copies of the package cannot share a name or a custom-op namespace in one process, so the
other copy is written under new ones first (from a git checkout of this repository):

    python -m dualkv_compile.tools.bench ab --prepare b08471e --other-dir /tmp/ab
    python -m dualkv_compile.tools.bench ab --other-dir /tmp/ab --out docs/results/NAME

`--prepare COMMIT` writes COMMIT's package (with passes/ and tools/ where setuptools maps them)
to OTHER_DIR/dualkv_other, renaming `dualkv_compile` and the `dualkv::` ops. Both sides get the
same q/k/v/gradient; each round times every (side, kernel) once, in turn.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile

import torch

from dualkv_compile.attention.registry import KERNELS
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, add_shapes_argument,
                                          commit_of, environment, interleaved_medians,
                                          positive_int, save_progress, seed_int, write_results)

OTHER = "dualkv_other"
COMMIT_FILE = "PREPARED_FROM_COMMIT"
# where setuptools maps these source folders inside the package
MAPPED = {"dualkv_compile": "", "passes": "passes", "tools": "tools"}


def prepare(commit: str, other_dir: str) -> None:
    """Write COMMIT's package to OTHER_DIR/dualkv_other under the new package and op names."""
    here = os.path.dirname(os.path.abspath(__file__))  # the checkout this package runs from
    found = subprocess.run(["git", "-C", here, "rev-parse", "--show-toplevel"],
                           capture_output=True, text=True)
    if found.returncode:
        raise ValueError(f"--prepare needs the package as a git checkout (an editable "
                         f"install); {here} is not in one")
    archive = subprocess.run(["git", "archive", commit, *MAPPED], cwd=found.stdout.strip(),
                             capture_output=True)
    if archive.returncode:
        why = archive.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(f"--prepare {commit}: git archive failed ({why[0] if why else ''})")
    archive = archive.stdout
    resolved = commit_of(found.stdout.strip(), commit) or commit
    if os.path.exists(other_dir) and not os.path.isdir(other_dir):
        raise ValueError(f"--other-dir {other_dir}: exists and is not a directory")
    target = os.path.join(other_dir, OTHER)
    if os.path.isdir(target):  # an earlier prepare's files would mix with this commit's
        shutil.rmtree(target)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not (member.isfile() and member.name.endswith(".py")):
                continue
            top, _, rest = member.name.partition("/")
            path = os.path.join(other_dir, OTHER, MAPPED[top], rest)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            text = tar.extractfile(member).read().decode()
            text = text.replace("dualkv_compile", OTHER)
            text = re.sub(r"\bdualkv::", "dualkv_other::", text)
            text = re.sub(r"torch\.ops\.dualkv\b", "torch.ops.dualkv_other", text)
            with open(path, "w") as f:
                f.write(text)
    with open(os.path.join(target, COMMIT_FILE), "w") as f:  # recorded in the results' meta
        f.write(resolved + "\n")
    print(f"{commit} ({resolved}) written to {target}")


def _prepared_commit(other_dir: str) -> str:
    try:
        with open(os.path.join(other_dir, OTHER, COMMIT_FILE)) as f:
            return f.read().strip()
    except OSError:
        return "unknown (prepared before --prepare recorded its commit)"


def layouts(args):
    """(name, tokens, padding_mask, prompt_len): the aligned shapes, then seeded ragged ones."""
    from dualkv_compile.testing import make_batch
    from dualkv_compile.tools.bench_ragged import ragged_case

    for n, p, r in args.shapes:  # parsed by _common.parse_shape
        tokens, mask, plen = make_batch([p], [[r] * n], vocab=1000)
        yield f"aligned {n},{p},{r}", tokens, mask, plen
    for seed in args.ragged_seeds:
        tokens, mask, plen, n, prompts, _ = ragged_case(seed, 4096, 1024, args.max_tokens)
        yield f"ragged 4K,1K seed {seed} ({len(prompts)}x{n})", tokens, mask, plen


def variant(lib, tokens, mask, plen, kernel, x, gout):
    pb = lib.pack(tokens.cuda(), prompt_len=plen, padding_mask=mask.cuda())

    def run():
        lib.shared_prefix_attention(*x, pb, attention_backend=kernel).backward(gout)
    run()  # compiles
    return run, x


def main(argv=None, prog=None):
    """`prog` names the benchmark in its usage and errors (default: the script's name)."""
    ap = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare", metavar="COMMIT", help="write COMMIT's package and exit")
    ap.add_argument("--other-dir", required=True)
    ap.add_argument("--kernels", nargs="+", default=["flash", "triton", "regions",
                                                     "flash_regions"], choices=list(KERNELS))
    add_shapes_argument(ap, ["16,4096,1024", "32,8192,1024"])
    ap.add_argument("--ragged-seeds", type=seed_int, nargs="+", default=[0, 1])
    ap.add_argument("--max-tokens", type=positive_int, default=262144)
    ap.add_argument("--heads", type=positive_int, default=32)
    ap.add_argument("--kv-heads", type=positive_int, default=8)
    ap.add_argument("--head-dim", type=positive_int, default=128)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--rep-ms", type=positive_int, default=1000)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.prepare:
        try:
            return prepare(args.prepare, args.other_dir)
        except (ValueError, OSError) as e:
            ap.error(str(e))
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    if not os.path.isdir(os.path.join(args.other_dir, OTHER)):  # else a ModuleNotFoundError
        ap.error(f"--other-dir {args.other_dir}: holds no {OTHER} package; write one with "
                 f"--prepare COMMIT --other-dir {args.other_dir}")
    sys.path.insert(0, args.other_dir)
    sides = {"this": importlib.import_module("dualkv_compile"),
             "other": importlib.import_module(OTHER)}
    this = commit_of(os.path.dirname(sides["this"].__file__), working_tree=True)
    meta = environment() | {"heads": args.heads, "kv_heads": args.kv_heads,
                            "head_dim": args.head_dim, "rounds": args.rounds, "rep_ms": args.rep_ms,
                            "this": this or "unknown (this package is not a git checkout)",
                            "other": _prepared_commit(args.other_dir)}
    rows = []
    for name, tokens, mask, plen in layouts(args):
        t = sides["this"].pack(tokens, prompt_len=plen, padding_mask=mask).seq_len
        x = [torch.randn(1, h, t, args.head_dim, device="cuda", dtype=torch.bfloat16,
                         requires_grad=True) for h in (args.heads, args.kv_heads, args.kv_heads)]
        gout = torch.randn(1, args.heads, t, args.head_dim, device="cuda", dtype=torch.bfloat16)
        variants, row = {}, {"layout": name, "T": t}
        for kernel in args.kernels:
            for side, lib in sides.items():
                try:
                    variants[f"{side} {kernel}"] = variant(lib, tokens, mask, plen, kernel, x, gout)
                except (RuntimeError, ValueError, ImportError) as e:
                    row[f"{side} {kernel}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        row |= interleaved_medians(variants, rounds=args.rounds, warmup_ms=50, rep_ms=args.rep_ms)
        rows.append(row)
        save_progress(args.out, meta, rows, _table(rows, args.kernels, meta))
        torch.cuda.empty_cache()
    write_results(args.out, meta, rows, _table(rows, args.kernels, meta))


def _table(rows: list, kernels: list, meta: dict) -> str:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"  # noqa: E731
    lines = ["Same-process A/B, shared_prefix_attention fwd+bwd, bf16 (ms; this / other; "
             f"this: {meta['this']}, other: {meta['other']})\n",
             "| layout | T | " + " | ".join(kernels) + " |", "|---|---|" + "---|" * len(kernels)]
    for r in rows:
        cells = []
        for k in kernels:
            a, b = r.get(f"this {k}"), r.get(f"other {k}")
            ratio = f" ({a / b:.3f})" if isinstance(a, float) and isinstance(b, float) else ""
            cells.append(f"{fmt(a)} / {fmt(b)}{ratio}")
        lines.append(f"| {r['layout']} | {r['T']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
