"""What keeps a recipe run from losing work: an output directory that holds a checkpoint is not
reused silently, a checkpoint is checked before it is trusted, and SIGINT / SIGTERM end the run
after the current step (the recipe then writes its checkpoint and exits 128 + the signal)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from .recipe_config import ConfigError

__all__ = ["CHECKPOINT_KEYS", "StopOnSignal", "check_output_dir", "load_checkpoint"]

CHECKPOINT_KEYS = ("model", "ref_model", "optimizer", "step", "task", "rngs")


def check_output_dir(checkpoint: Path, *, resume: bool, overwrite: bool) -> None:
    """A new run (not resuming) may not start where a checkpoint lies, unless told to."""
    if checkpoint.exists() and not resume and not overwrite:
        raise ConfigError([f"output_dir={str(checkpoint.parent)!r} holds a checkpoint "
                           f"({checkpoint.name}); continue it with resume_from_checkpoint=true, "
                           "or start over (replacing it) with overwrite_output_dir=true"])


def load_checkpoint(path: Path, *, num_steps: int) -> dict:
    """The recipe's checkpoint at `path`, or a ConfigError that names what is wrong with it
    (missing, unreadable, not this recipe's, already at num_steps). The file is never changed."""
    import torch

    if not path.is_file():
        raise ConfigError([f"resume_from_checkpoint=true but {path} does not exist"])
    try:
        state = torch.load(path, weights_only=False, mmap=True)  # each rank maps, none copies
    except Exception as e:  # noqa: BLE001 - any failure to read means the same to the user
        raise ConfigError([f"{path} is not a readable checkpoint ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}); it was left untouched"]) from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ConfigError([f"{path} is not a checkpoint of this recipe (no {missing}); it was "
                           "left untouched"])
    if state["step"] >= num_steps:
        raise ConfigError([f"num_steps={num_steps}: the checkpoint {path} is at step "
                           f"{state['step']} already, nothing is left to train; raise "
                           "num_steps to continue"])
    return state


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
              "(send it again to stop at once)", flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False
