"""Shared by the benchmarks: the N,P,R shape argument and the environment record."""

from __future__ import annotations

import argparse
import platform

import torch

__all__ = ["add_shapes_argument", "environment"]


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        n, p, r = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} must be N,P,R (three integers)")
    if min(n, p, r) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: N, P and R must be positive")
    return n, p, r


def add_shapes_argument(ap: argparse.ArgumentParser, defaults: list[str]) -> None:
    ap.add_argument("--shapes", type=_parse_shape, nargs="+", metavar="N,P,R",
                    default=[_parse_shape(s) for s in defaults],
                    help=f"groups of N responses of R tokens on a P-token prompt "
                         f"(default: {' '.join(defaults)})")


def environment() -> dict:
    """GPU, versions and capability, for the JSON of every benchmark (needs CUDA)."""
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(),
            "capability": list(torch.cuda.get_device_capability())}
