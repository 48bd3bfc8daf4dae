"""Shared by the benchmarks and the CLI: the N,P,R shape argument, the environment record and
the check of an --out path."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from .models import CliError

__all__ = ["OneLineParser", "add_out_argument", "add_shapes_argument", "check_out_path",
           "environment", "interleaved_medians", "is_number", "non_negative_float", "parse_caps",
           "parse_ragged_case", "parse_shape", "positive_float", "positive_int", "ragged_only",
           "ResultsWriteError", "save_progress", "seed_int", "unknown_flag", "write_results"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2 (`--help` still
    prints the whole usage), and an unknown flag is named with the closest known one, as the
    `dualkv` subcommands name theirs (a benchmark said only "unrecognized arguments")."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            flag = next((a.split("=", 1)[0] for a in extra
                         if a.startswith("-") and not is_number(a)), None)
            if flag is None or self._subparsers is not None:  # a subcommand's flags are its own
                self.error(f"unrecognized arguments: {' '.join(extra)}")
            self.error(unknown_flag(self, flag))
        out, suffixes = getattr(parsed, "out", None), getattr(self, "out_suffixes", ())
        if out and suffixes and not parsed.overwrite:  # an earlier run's results, before any work
            existing = [out + x for x in suffixes if os.path.exists(out + x)]
            if existing:
                self.error(f"--out {out}: {existing[0]} exists (an earlier run's results); "
                           f"pass --overwrite to replace it, or name another OUT")
        return parsed


def unknown_flag(parser: argparse.ArgumentParser, flag: str) -> str:
    """The error for a flag `parser` does not know, naming the closest one it does (difflib
    finds no short flag close: -n for -N is the other case)."""
    flags = [o for action in parser._actions for o in action.option_strings]
    close = difflib.get_close_matches(flag, flags, n=1) or [
        f for f in flags if not f.startswith("--") and f.lower() == flag.lower()]
    return f"unrecognized argument {flag}" + (f"; did you mean {close[0]}?" if close else "")


def is_number(text: str) -> bool:
    """A negative number is a value, not a flag."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def seed_int(text: str) -> int:
    """An argparse type: a seed, an integer in [0, 2**63) (torch.Generator.manual_seed takes
    [-2**63, 2**64); a seed past that was a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 2**63)")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (anything else is the parser's one-line error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a divisor, such as a peak TFLOP/s)."""
    return _finite_float(text, above_zero=True)


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a threshold, such as a minimum gain)."""
    return _finite_float(text, above_zero=False)


def _finite_float(text: str, *, above_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not ((0 < value if above_zero else 0 <= value) and value < math.inf):  # nan fails too
        raise argparse.ArgumentTypeError(f"{value} must be a finite number "
                                         f"{'above 0' if above_zero else '>= 0'}")
    return value


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        n, p, r = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} must be N,P,R (three integers)")
    if min(n, p, r) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: N, P and R must be positive")
    return n, p, r


def parse_caps(text: str) -> tuple[int, int]:
    """An argparse type: "P_cap,R_cap", bench ragged's prompt and response length caps (two
    positive integers)."""
    p_cap, r_cap = _caps_and(text, "caps", "P_cap,R_cap", "two")
    return p_cap, r_cap


def parse_ragged_case(text: str) -> tuple[int, int, int]:
    """An argparse type: "P_cap,R_cap,seed", one of bench ragged's seeded cases (the caps as
    parse_caps reads them and a seed_int seed). Unparsed, a malformed case was a ValueError
    traceback after the model was built."""
    p_cap, r_cap, seed = _caps_and(text, "ragged case", "P_cap,R_cap,seed", "three")
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"ragged case {text!r}: the seed must be in [0, 2**63)")
    return p_cap, r_cap, seed


def _caps_and(text: str, what: str, form: str, count: str) -> tuple[int, ...]:
    """`text` as the integers `form` names, the first two (the caps) positive."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != len(form.split(",")):
        raise argparse.ArgumentTypeError(f"{what} {text!r} must be {form} ({count} integers)")
    if min(values[:2]) < 1:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: P_cap and R_cap must be positive")
    return values


def check_out_path(out: str, *, folder: bool) -> Path:
    """--out, checked before any work is done: a file (folder=False) must not be a directory
    and its directory must exist; a folder (folder=True) may exist as a directory or will be
    created under its nearest existing ancestor. That directory must be writable. CliError
    otherwise (a write can still fail: callers turn OSError into CliError too)."""
    path = Path(out)
    if folder:
        if path.exists() and not path.is_dir():
            raise CliError(f"--out {out}: exists and is not a directory")
        base = path
        while not base.exists():  # the folder is made with its missing parents
            base = base.parent
    else:
        if path.is_dir():
            raise CliError(f"--out {out}: is a directory; name a file")
        base = path.parent
    if not base.exists():
        raise CliError(f"no such directory: {base}")
    if not base.is_dir():
        raise CliError(f"--out {out}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise CliError(f"--out {out}: the directory {base} is not writable")
    return path


def add_out_argument(ap: argparse.ArgumentParser, suffixes=(".json", ".md")) -> None:
    """--out OUT: a benchmark writes OUT + each suffix; the paths are checked when the
    arguments are parsed, before any work (a bad one is the parser's one-line error, exit 2)."""
    def stem(text: str) -> str:
        if Path(text).is_dir():  # OUT.json would land beside it, not in it
            raise argparse.ArgumentTypeError(f"--out {text}: is a directory; name a file stem "
                                             f"(OUT{suffixes[0]} is written)")
        for suffix in suffixes:
            try:
                check_out_path(text + suffix, folder=False)
            except CliError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        return text

    ap.add_argument("--out", default=None, type=stem, metavar="OUT",
                    help=f"write {' and '.join('OUT' + x for x in suffixes)} (the directory "
                         "must exist), after every row, so that an interrupted run keeps what "
                         "it measured")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier run's OUT files (refused otherwise)")
    ap.out_suffixes = suffixes  # read by OneLineParser.parse_args


def add_shapes_argument(ap: argparse.ArgumentParser, defaults: list[str]) -> None:
    ap.add_argument("--shapes", type=parse_shape, nargs="+", metavar="N,P,R",
                    default=[parse_shape(s) for s in defaults],
                    help=f"groups of N responses of R tokens on a P-token prompt "
                         f"(default: {' '.join(defaults)})")


def ragged_only(ap: argparse.ArgumentParser, args) -> None:
    """--ragged without --shapes: its layouts alone. "Without" is the parser's default object
    itself, so `--shapes=...` and an abbreviated --shape count as given (a search of argv for
    the literal "--shapes" dropped them)."""
    if args.ragged and args.shapes is ap.get_default("shapes"):
        args.shapes = []


def environment() -> dict:
    """GPU, versions and capability, for the JSON of every benchmark (needs CUDA)."""
    from importlib import metadata

    import torch
    import triton

    from dualkv_compile.attention.selection import flash_status

    try:
        flash_attn = metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        flash_attn = None
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
            "capability": list(torch.cuda.get_device_capability()), "flash_attn": flash_attn,
            "flash_status": flash_status(torch.device("cuda"))[1]}


def interleaved_medians(variants: dict, *, rounds: int, warmup_ms: int, rep_ms: int) -> dict:
    """{name: (fn, grads)} -> {name: median ms}. Each round times every variant once, in turn,
    so clock and thermal drift fall on all of them alike; the result is the median over rounds
    of do_bench's medians (rep_ms is split over the rounds). `grads` are zeroed between calls."""
    from triton.testing import do_bench

    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (fn, grads) in variants.items():
            times[name].append(do_bench(fn, warmup=warmup_ms, rep=max(1, rep_ms // rounds),
                                        grad_to_none=grads, return_mode="median"))
    return {name: statistics.median(ts) for name, ts in times.items()}


class ResultsWriteError(OSError):
    """OUT.json and OUT.md could not both be written; the message names the file and what was
    left on disk. bench.run reports it as the benchmark's one-line error."""


def save_progress(out: str | None, meta: dict, rows: list, table: str, *,
                  echo: bool = True) -> None:
    """After each row: print it as one JSON line (echo), and with --out write the rows so far
    (meta "incomplete": true), so that an interruption, a time limit or an error in a later
    row keeps what was measured. write_results replaces them when the run is done."""
    if echo:
        print(json.dumps(rows[-1], default=str), flush=True)
    if out:
        _write_pair(out, meta | {"incomplete": True}, rows,
                    table + f"\n(incomplete: the first {len(rows)} rows; the run has not finished)\n")


def write_results(out: str | None, meta: dict, rows: list, table: str) -> None:
    """Print the table; write OUT.json ({"meta", "rows"}) and OUT.md (the table) when --out
    was given."""
    print(table)
    if out:
        _write_pair(out, meta, rows, table)


def commit_of(path: str, rev: str = "HEAD", *, working_tree: bool = False) -> str | None:
    """The full hash of `rev` in the git checkout holding `path` (None outside one); for the
    working tree, with "+changes" when it has uncommitted changes."""
    def git(*argv):
        try:
            done = subprocess.run(["git", "-C", path, *argv], capture_output=True, text=True)
        except OSError:  # no git executable (a GPU machine's image)
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    if commit and working_tree and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return commit


_command = [None]  # the benchmark's command line, as bench.run was given it


def own_checkout(tools_dir: str) -> bool:
    """Whether `tools_dir` is the tools/ folder at the top of a git checkout (this project's):
    a wheel installed in another project's .venv lies inside that project's git tree."""
    try:
        done = subprocess.run(["git", "-C", tools_dir, "rev-parse", "--show-toplevel"],
                              capture_output=True, text=True)
    except OSError:  # no git executable
        return False
    top = done.stdout.strip()
    return done.returncode == 0 and bool(top) and os.path.samefile(top,
                                                                   os.path.dirname(tools_dir))


def set_command(text: str) -> None:
    _command[0] = text


def run_record() -> dict:
    """The command line and the commit of the code that ran, for every result: the package's
    git checkout, else $DUALKV_COMMIT (an installed copy on a GPU machine has no .git)."""
    here = os.path.dirname(os.path.abspath(__file__))
    commit = ((commit_of(here, working_tree=True) if own_checkout(here) else None)
              or os.environ.get("DUALKV_COMMIT")
              or "unknown (not a git checkout and DUALKV_COMMIT unset)")
    return {"command": _command[0] or shlex.join(sys.argv), "commit": commit}


def _write_pair(out: str, meta: dict, rows: list, table: str) -> None:
    """OUT.json and OUT.md (with the command and commit, run_record), written to temporary
    files beside their final names first and renamed into place only when both were written,
    so a failed write (a full disk) leaves the earlier pair as it was, not a new JSON beside an
    old table; ResultsWriteError otherwise."""
    record = run_record()
    texts = {out + ".json": json.dumps({"meta": record | meta, "rows": rows}, indent=1),
             out + ".md": table + f"\n`{record['command']}` at {record['commit']}\n"}
    temporary = {path: f"{path}.tmp{os.getpid()}" for path in texts}
    try:
        for path, text in texts.items():
            try:
                with open(temporary[path], "w") as f:
                    f.write(text)
            except OSError as e:
                raise ResultsWriteError(f"cannot write {path} ({e.strerror or e}); neither "
                                        f"{out}.json nor {out}.md was replaced") from e
        replaced = []
        for path in texts:
            try:
                os.replace(temporary[path], path)
            except OSError as e:
                done = f"{replaced[0]} was replaced, {path} was not" if replaced else \
                    f"neither {out}.json nor {out}.md was replaced"
                raise ResultsWriteError(f"cannot write {path} ({e.strerror or e}); {done}") \
                    from e
            replaced.append(path)
    finally:
        for tmp in temporary.values():  # what was not renamed into place
            try:
                os.remove(tmp)
            except OSError:  # renamed into place; or the error above says what went wrong
                pass
