"""What keeps a recipe run from losing work: an output directory (or a folder of trained
weights) that holds an earlier run's is not reused silently (and a replaced run is moved aside,
not deleted), one output directory serves one live run at a time (RunLock), a checkpoint is
written whole or not at all and checked before it is trusted and against the config it is
resumed with (resume_checks.py), and SIGINT / SIGTERM
end the run after the current step (the recipe then writes its checkpoint and exits 128 + the
signal)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from ..durable import sync, sync_entry, write_failed
from .recipe_config import ConfigError
from .resume_checks import read_resume_checkpoint

log = logging.getLogger(__name__)

__all__ = ["RunFailed", "RunLock", "StopOnSignal", "check_output_dir", "check_writable_dir",
           "prepare_output_dir", "replace_earlier_run", "set_aside", "write_checkpoint"]



def check_output_dir(checkpoint: Path, *, resume: bool, overwrite: bool,
                     weight_dirs: tuple[Path, ...] = ()) -> None:
    """A new run (not resuming) may not start where a checkpoint lies, nor write its trained
    weights where an earlier run's epoch_* folders lie (its checkpointer would replace them),
    unless told to."""
    if resume and overwrite:
        raise ConfigError(["resume_from_checkpoint=true and overwrite_output_dir=true ask for "
                           "opposite things (continue the checkpoint, or move it aside and start "
                           "over); set one of them"])
    if resume or overwrite:
        return
    if checkpoint.exists():
        raise ConfigError([f"output_dir={str(checkpoint.parent)!r} holds a checkpoint "
                           f"({checkpoint.name}); continue it with resume_from_checkpoint=true, "
                           "or start over (replacing it) with overwrite_output_dir=true"])
    earlier = [p.name for d in weight_dirs for p in sorted(d.glob("epoch_*"))]
    if earlier:
        dirs = ", ".join(repr(str(d)) for d in weight_dirs)
        raise ConfigError([f"checkpointer.output_dir={dirs} holds an earlier run's trained "
                           f"weights ({', '.join(earlier)}), which this run would replace; use "
                           "another folder, or overwrite_output_dir=true to move them aside"])


def check_writable_dir(key: str, path: Path) -> None:
    """A folder the run will create or write in: a ConfigError before any work if it is a file,
    lies under one, or its nearest existing folder cannot be written."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {existing}"
        raise ConfigError([f"{key}={str(path)!r} {where}; name a folder"])
    try:  # a file made and removed: os.access says yes to root, also on /proc or a read-only mount
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".dualkv_write_probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError([f"{key}={str(path)!r} cannot be written ({existing}: "
                           f"{e.strerror or e})"]) from None


class RunFailed(RuntimeError):
    """A run ended by a problem found while it trained (a non-finite gradient, a checkpoint that
    could not be written): the recipe prints it as one line and exits 1."""


def check_finite_weights(model_state: dict, step: int, path: Path) -> None:
    """RunFailed, before anything is written, when a weight of `model_state` is not finite: a
    finite gradient can still step a weight to inf, and neither the checkpoint at `path` nor a
    trained-weights folder may then be written."""
    import torch

    bad = next((k for k, t in model_state.items()
                if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise RunFailed(f"step {step}: the weights hold non-finite values ({bad}); not saved, "
                        f"so {path}, if any, is the last good checkpoint")


def write_checkpoint(path: Path, state: dict) -> None:
    """The recipe's checkpoint (CHECKPOINT_KEYS and its config) at `path`: written aside,
    flushed to the disk, then renamed, so that a crash, a power loss or a full disk mid-write
    leaves the previous checkpoint whole (and a resumed run's memory-mapped read of it valid).
    Model weights that are not finite are not written (RunFailed): a finite gradient can still
    step a weight to inf, and the file would replace the last good checkpoint."""
    import torch

    step = state["step"]
    check_finite_weights(state["model"], step, path)
    tmp = path.with_suffix(".tmp")
    try:
        torch.save(state, tmp)
        sync(tmp)
    except (OSError, RuntimeError) as e:  # a full disk: torch.save says "unexpected pos"
        raise RunFailed(f"step {step}: {write_failed(path, tmp, e)}") from e
    tmp.replace(path)
    sync_entry(path)


class RunLock:
    """Held by one process (the recipe's rank 0) for a whole run: a second run started on the
    same output_dir is refused while the first lives, since its checkpoints would replace the
    other's. An exclusive flock on output_dir/run.lock, which the OS releases when the process
    ends, however it ends (so a crashed run leaves no stale lock). The file stays, naming the
    last run that held it."""

    NAME = "run.lock"

    def __init__(self, output_dir: Path, key: str = "output_dir"):
        """key: the config key that names the folder, for the errors."""
        import fcntl

        self._dir, self._created = output_dir, not output_dir.exists()
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(output_dir / self.NAME, "a+")
        except OSError as e:
            raise ConfigError([f"{key}={str(output_dir)!r} cannot be created or written "
                               f"({e.strerror or e}: {e.filename or output_dir})"]) from None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                # a file system without locks (Lustre mounted without flock: ENOSYS; NFSv3
                # without lockd: ENOLCK): nothing holds the folder, the run goes on unguarded
                log.warning("%s=%r: its file system does not support file locks (%s), so a "
                            "second run started on it would not be refused; make sure no "
                            "other run uses it", key, str(output_dir), e.strerror or e)
                self._write_holder(key)
                return
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise ConfigError([f"{key}={str(output_dir)!r} is in use by another run "
                               f"({holder}); wait for it to end or use another {key}"]) \
                from None
        self._write_holder(key)

    def _write_holder(self, key: str) -> None:
        """Say in the lock file which process holds the folder (another run's error names it)."""
        output_dir = self._dir
        try:
            self._file.seek(0)
            self._file.truncate()
            self._file.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
                             f"{datetime.now():%Y-%m-%d %H:%M:%S}\n")
            self._file.flush()
        except OSError as e:  # a full disk: the run could write nothing there either
            self.release(failed_setup=True)
            raise ConfigError([f"{key}={str(output_dir)!r} cannot be written "
                               f"({e.strerror or e})"]) from None

    def release(self, *, failed_setup: bool = False) -> None:
        """Drop the lock; after a failed setup, also the output_dir this lock created if it
        holds nothing but the lock file (a refused run leaves no empty folder behind)."""
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None
            if failed_setup and self._created:
                try:
                    (self._dir / self.NAME).unlink()
                    self._dir.rmdir()  # fails, and is left, if anything else is in it
                except OSError:
                    pass


def set_aside(paths: list[Path]) -> list[Path]:
    """overwrite_output_dir=true over an earlier run: move its checkpoint and trained-weight
    folders (those of `paths` that exist) into a replaced_<time>/ folder beside each (a rename
    within its own folder, so never a copy across file systems), so that neither a resume nor a
    reader of the newest folder takes the earlier run's for this one's. Nothing is deleted.
    Returns the folders made."""
    stamp = f"replaced_{datetime.now():%Y%m%d_%H%M%S_%f}"
    made = []
    for p in (p for p in paths if p.exists()):
        aside = p.parent / stamp
        try:
            aside.mkdir(exist_ok=True)
            p.rename(aside / p.name)
        except OSError as e:
            raise ConfigError([f"overwrite_output_dir=true: cannot move {p} aside into {aside} "
                               f"({e.strerror or e}); move or remove it yourself"]) from None
        if aside not in made:
            made.append(aside)
    return made


def prepare_output_dir(checkpoint: Path, *, resume: bool, overwrite: bool, num_steps: int,
                       world_size: int, config: dict, weight_dirs: list[Path],
                       log_dir: str | None = None) -> tuple[dict | None, dict]:
    """Before any work (and after rank 0 took the RunLock): check_output_dir; with resume,
    read_resume_checkpoint (returned: the state and the config changes). With overwrite nothing
    moves yet: replace_earlier_run does that once the whole setup has passed (a run refused
    later in its setup leaves the earlier run where it was)."""
    check_output_dir(checkpoint, resume=resume, overwrite=overwrite,
                     weight_dirs=tuple(weight_dirs))
    if log_dir:
        check_writable_dir("metric_logger.log_dir", Path(log_dir))
    if resume:
        return read_resume_checkpoint(checkpoint, num_steps=num_steps, world_size=world_size,
                                      config=config)
    return None, {}


def replace_earlier_run(checkpoint: Path, *, weight_dirs: list[Path],
                        log_dir: str | None = None) -> None:
    """overwrite_output_dir=true, on rank 0 at the end of a setup that passed: move the earlier
    run's checkpoint, the epoch_* folders of `weight_dirs` and the metric logger's `log_dir`
    where it lies in output_dir aside (set_aside; a new run's TensorBoard would otherwise show
    the old run's steps beside its own) and say where."""
    run_dir, logs = checkpoint.parent.resolve(), []
    if log_dir and Path(log_dir).resolve() == run_dir:  # its runs' folders, not output_dir
        logs = sorted(p for p in Path(log_dir).glob("run_*") if p.is_dir())
    elif log_dir and Path(log_dir).resolve().is_relative_to(run_dir):
        logs = [Path(log_dir)]
    earlier = [p for p in [checkpoint, *(p for d in weight_dirs for p in sorted(d.glob("epoch_*"))),
                           *logs] if p.exists()]
    made = set_aside(earlier)
    if made:
        print(f"overwrite_output_dir=true: the earlier run's {', '.join(p.name for p in earlier)} "
              f"were moved to {', '.join(map(str, made))}", flush=True)


class StopOnSignal:
    """Within: the first SIGINT or SIGTERM is recorded in `.signum` (the run finishes its step,
    saves and exits); the same signal again, at least `again_after` seconds later, stops at
    once (a launcher or scheduler that signals every process as well as forwarding its own
    copy delivers two at nearly the same time). Outside the main thread: a no-op.

    Launchers bound the wait: torchrun (`tune run --nproc_per_node`) kills its workers 30 s
    after forwarding a signal, so a step plus a checkpoint must fit in that time there."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, again_after: float = 2.0):
        self.signum: int | None = None
        self.again_after = again_after
        self._first_at = 0.0
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            if signum == self.signum and time.monotonic() - self._first_at >= self.again_after:
                signal.signal(signum, signal.SIG_DFL)  # asked again: stop now
                raise KeyboardInterrupt
            return
        self.signum, self._first_at = signum, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
              f"(send it again, {self.again_after:g} s or more from now, to stop at once)",
              flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False
