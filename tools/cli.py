"""The `dualkv` command: inspect rewritten graphs, draw masks, plan savings, benchmark.

    dualkv inspect --model qwen2_5 --out graphs/
    dualkv mask --groups 2 --group-size 4 --prompt-len 600 --response-len 300 --out mask.png
    dualkv plan --model qwen3-8b -N 32 -P 8192 -R 1024 --gpu-memory 140
    dualkv bench attention --shapes 32,8192,1024        (CUDA)

User errors (unknown model, impossible numbers, missing files) exit 2 with one line.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading

from ._common import OneLineParser, is_number, positive_int, seed_int, unknown_flag
from .bench import SUITE
from .bench import run as run_bench
from .models import PRESETS, TINY, CliError

__all__ = ["main", "build_parser"]


def _layout(sub):
    sub.add_argument("--groups", type=positive_int, default=2, help="prompts (default 2)")
    sub.add_argument("--group-size", "-N", type=positive_int, default=2,
                     help="responses per prompt (default 2)")
    sub.add_argument("--prompt-len", "-P", type=positive_int, default=8,
                     help="prompt tokens (default 8)")
    sub.add_argument("--response-len", "-R", type=positive_int, default=4,
                     help="response tokens (default 4)")


def build_parser() -> argparse.ArgumentParser:
    from ..attention.registry import KERNELS  # imports torch: inside main's Ctrl-C handling

    models = ", ".join(TINY + tuple(PRESETS))
    # no abbreviated flags: `plan --group 2` was taken for --group-size (N), where inspect's
    # and mask's parsers, which also have --groups, call it ambiguous
    parser = functools.partial(OneLineParser, allow_abbrev=False)
    ap = parser(prog="dualkv", description=__doc__.split("\n\n")[0])
    subs = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                             parser_class=parser)

    ins = subs.add_parser("inspect", help="trace a model through optimize() on CPU and show "
                                          "the graph before and after each pass")
    ins.add_argument("--model", required=True, help=f"{models}, or a config.json path")
    _layout(ins)
    ins.add_argument("--layers", type=positive_int, default=None,
                     help="build the model with this many layers (default: as configured)")
    ins.add_argument("--out", default=None,
                     help="a folder (created) to write each stage's graph and an SVG in")
    ins.add_argument("--attention-backend", default="auto",
                     choices=list(KERNELS),
                     help="the attention the rewrite inserts: flex (auto/flash/triton) or a "
                          "regions op (regions: cuDNN, flash_regions: flash-attn-4); default "
                          "auto")

    msk = subs.add_parser("mask", help="draw the block mask of a layout as a PNG")
    _layout(msk)
    msk.add_argument("--ragged", action="store_true",
                     help="random response lengths up to --response-len")
    msk.add_argument("--seed", type=seed_int, default=0,
                     help="the seed of --ragged's response lengths (default 0)")
    msk.add_argument("--pad-to", type=positive_int, default=128,
                     help="pad the packed length T to a multiple of this, itself a multiple of "
                          "128 (default 128)")
    msk.add_argument("--scale", type=positive_int, default=None,
                     help="pixels per 128-token block (default: up to 16, keeping the image "
                          "within 1024 pixels a side)")
    msk.add_argument("--out", required=True, help="PNG file to write")

    pln = subs.add_parser("plan", help="predicted savings and memory with and without dualkv")
    pln.add_argument("--model", required=True, help=f"{models}, or a config.json path")
    # the same spellings as inspect's and mask's layout flags
    pln.add_argument("-N", "--group-size", dest="N", type=int, required=True,
                     help="responses per prompt")
    pln.add_argument("-P", "--prompt-len", dest="P", type=int, required=True,
                     help="prompt tokens")
    pln.add_argument("-R", "--response-len", dest="R", type=int, required=True,
                     help="response tokens")
    pln.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                     help="GPU memory in GiB: report how many groups fit a micro-batch")
    pln.add_argument("--state-bytes", type=positive_int, default=12,
                     help="training-state bytes per parameter (default 12)")

    bch = subs.add_parser("bench", help="run a benchmark of the suite (needs CUDA)",
                          description="Runs one benchmark; the arguments after its name are "
                                      "passed to it (`dualkv bench attention --help`).")
    bch.add_argument("name", choices=sorted(SUITE))
    rest = bch.add_argument("rest", nargs=argparse.REMAINDER,
                            help="the benchmark's own arguments")
    rest.required = False  # argparse marks REMAINDER required; none is fine (`bench NAME`)
    ap.commands = {"inspect": ins, "mask": msk, "plan": pln}  # (bench passes its flags on)
    return ap


def _unknown_flags(parser, argv: list[str]) -> None:
    """A flag the subcommand does not know is its one-line error, naming `dualkv COMMAND` and
    the closest flag: argparse named `dualkv`, and a misspelt required flag (--modle) was
    reported as the required one missing."""
    command = next((a for a in argv if not a.startswith("-")), None)
    sub = parser.commands.get(command)
    if sub is None:
        return
    flags = [o for action in sub._actions for o in action.option_strings]
    short = [f for f in flags if not f.startswith("--")]
    for arg in argv[argv.index(command) + 1:]:
        if arg == "--":
            return
        name = arg.split("=", 1)[0]
        if name.startswith("--"):
            if name in flags:
                continue  # a flag (whole: the parsers take no abbreviations)
        elif not name.startswith("-") or is_number(name) or any(arg.startswith(f) for f in short):
            continue  # a value (a negative number too), or a short flag (-N2 carries its value)
        sub.error(unknown_flag(sub, name))


def main(argv=None) -> int:
    args = None
    # Python drops a KeyboardInterrupt raised inside a __del__ (as one was while transformers
    # imported): the command then ran to its end and exited 0. The handler notes each Ctrl-C,
    # so a dropped one still ends the command as interrupted.
    pressed = []

    def on_sigint(signum, frame):
        pressed.append(signum)
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
    try:
        parser = build_parser()
        _unknown_flags(parser, sys.argv[1:] if argv is None else list(argv))
        args = parser.parse_args(argv)
        code = _run(args)
        if pressed:  # one that was dropped on the way
            raise KeyboardInterrupt
        return code
    except KeyboardInterrupt:
        print(f"{_prog(args)}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dualkv ... | head`: the reader left; say nothing more
        _drop_stdout()
        return 1
    except OSError as e:  # the output cannot be written (`> /dev/full`, a full disk)
        print(f"{_prog(args)}: error: {e}", file=sys.stderr)
        _drop_stdout()
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _prog(args) -> str:
    return "dualkv" if args is None else f"dualkv {args.command}"


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush finds nothing to fail
    on (no pipe, no full disk)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (captured)
        pass


def _run(args) -> int:
    try:
        if args.command == "inspect":
            from .inspect_cmd import run_inspect

            return run_inspect(args)
        if args.command == "mask":
            if args.pad_to % 128:
                raise CliError(f"--pad-to {args.pad_to}: must be a multiple of 128")
            from .mask_cmd import run_mask

            return run_mask(args)
        if args.command == "plan":
            from .plan_cmd import run_plan

            return run_plan(args)
        run_bench(args.name, args.rest)
        return 0
    except CliError as e:
        print(f"dualkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
