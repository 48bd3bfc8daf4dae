"""Flush files to the disk before they are renamed into place: a rename is atomic, but without
an fsync of the data first, a power loss just after it can leave the new name on an empty or
partial file, and the previous checkpoint already gone."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["sync", "sync_entry"]


def sync(path: Path) -> None:
    """fsync `path` (a file, or every file in a folder and the folder), so that its data is on
    the disk before it is renamed."""
    path = Path(path)
    files = [p for p in sorted(path.rglob("*")) if p.is_file()] if path.is_dir() else [path]
    for f in files:
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    if path.is_dir():
        _sync_dir(path)


def sync_entry(path: Path) -> None:
    """fsync the folder holding `path`, so that a rename to `path` is on the disk."""
    _sync_dir(Path(path).parent)


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
