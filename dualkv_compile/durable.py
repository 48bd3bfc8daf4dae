"""Flush files to the disk before they are renamed into place: a rename is atomic, but without
an fsync of the data first, a power loss just after it can leave the new name on an empty or
partial file, and the previous checkpoint already gone. A write that fails (a full disk) is
removed and explained (`write_failed`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["sync", "sync_entry", "write_failed"]


def sync(path: Path) -> None:
    """fsync `path` (a file, or every file and folder in a folder, and the folder), so that its
    data and entries are on the disk before it is renamed."""
    path = Path(path)
    if not path.is_dir():
        files, folders = [path], []
    else:
        inside = sorted(path.rglob("*"))
        files = [p for p in inside if p.is_file()]
        folders = [p for p in inside if p.is_dir()] + [path]  # (each holds entries above)
    for f in files:
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    for folder in folders:
        _sync_dir(folder)


def sync_entry(path: Path) -> None:
    """fsync the folder holding `path`, so that a rename to `path` is on the disk."""
    _sync_dir(Path(path).parent)


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_failed(target: Path, partial: Path, error: BaseException) -> OSError:
    """After writing `partial` (a file or folder meant to be renamed to `target`) failed:
    remove it, and return an OSError that says why, how much space its disk has left and that
    `target` is as it was (torch.save reports a full disk as "unexpected pos")."""
    if partial.is_dir():
        shutil.rmtree(partial, ignore_errors=True)
    else:
        partial.unlink(missing_ok=True)
    try:
        free = f"{shutil.disk_usage(partial.parent).free / 2**30:.2f} GiB free on its disk"
    except OSError:
        free = "its disk's free space unknown"
    cause = (str(error).splitlines() or [""])[0][:200]
    return OSError(f"{target} could not be written ({type(error).__name__}: {cause}); {free}; "
                   f"the partial {partial.name} was removed and the previous {target.name}, if "
                   "any, is unchanged")
