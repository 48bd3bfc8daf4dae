"""TensorBoard logging that survives a resume: a run continued from its checkpoint writes into
the folder of the run it continues, and TensorBoard drops what the interrupted run logged
after that checkpoint, so every step shows once and the curves stay one run.

torchtune's TensorBoardLogger starts a new run folder per process: after a hard kill between
a logged step and its checkpoint, the resumed run logs those steps again beside the first
ones. The recipe takes any torchtune metric logger and says so once when it resumes with one
that cannot continue (open_metric_logger).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

__all__ = ["TensorBoardLogger", "close_logger", "log_step", "open_metric_logger"]

_OWNER = "dualkv_run.json"  # in each run folder: the output_dir whose run it is


class TensorBoardLogger:
    """torchtune's metric-logger interface (log, log_dict, log_config, close) over
    torch.utils.tensorboard. Each run gets a folder `log_dir/run_<UTC time>`; `resume(step)`
    continues this output_dir's newest one instead, hiding its steps after `step`
    (SummaryWriter's purge_step, which TensorBoard applies on read)."""

    # the longest wait, in seconds, for the clock to pass the newest event file's stamp (below)
    max_clock_wait_s = 5.0

    def __init__(self, log_dir: str, output_dir: str | None = None):
        self.log_dir = Path(log_dir)
        self._owner = str(Path(output_dir).resolve()) if output_dir else None
        self.run_dir: Path | None = None
        # a SessionLog.START event opens every run's events: TensorBoard's Python reader
        # purges on a START only after a first one (its rust reader drops steps at or past one
        # that comes again, in file order)
        self._purge_step = 0
        self._writer = None
        self.not_resumed: str | None = None  # why resume() found a run it did not continue

    def resume(self, step: int) -> bool:
        """Continue this output_dir's newest run after `step`; False when there is none to
        continue, or its newest event file is stamped more than max_clock_wait_s ahead of the
        clock (`not_resumed` says so); a new run folder is then made on the first log."""
        runs = [d for _, d in self._own_runs()]
        if not runs:
            return False
        # TensorBoard reads a folder's event files in name order, whose first field is the
        # second they were opened in: the new file must sort after the interrupted run's, so
        # the clock must pass that second (under a second after a quick resume). A file stamped
        # further ahead (another host's clock, skewed) would stall the run: a new run instead
        newest = max((int(f.name.split(".")[3]) for f in runs[-1].glob("events.out.tfevents.*")
                      if f.name.split(".")[3].isdigit()), default=0)
        wait = newest + 1 - time.time()
        if wait > self.max_clock_wait_s:
            self.not_resumed = (f"its newest event file in {runs[-1]} is stamped "
                                f"{newest - time.time():.0f} s ahead of this clock, so this "
                                "run's could not sort after it")
            return False
        if wait > 1:
            print(f"metric_logger: waiting {wait:.1f} s for the clock to pass the stamp of the "
                  f"newest event file in {runs[-1]}", flush=True)
        while int(time.time()) <= newest:
            time.sleep(0.05)
        self.run_dir, self._purge_step = runs[-1], step + 1
        return True

    def _own_runs(self) -> list[tuple[int, Path]]:
        """This output_dir's run folders with their `seq`, oldest first: in the order they
        were made (the seq their owner file records), not by name, whose UTC time another
        host's clock may have set ahead (such a folder would stay the newest by name, and every
        later resume would pick it over the runs made after it). Folders from before seq was
        recorded come first, in name order."""
        runs = []
        for d in sorted(self.log_dir.glob("run_*")):
            try:
                owner = json.loads((d / _OWNER).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(owner, dict) and owner.get("output_dir") == self._owner:
                seq = owner.get("seq")
                runs.append((seq if isinstance(seq, int) else -1, d))
        return sorted(runs, key=lambda r: r[0])  # stable: name order within one seq

    def _open(self):
        from torch.utils.tensorboard import SummaryWriter
        if self.run_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{time.time_ns() % 10**9:09d}"
            self.run_dir = self.log_dir / f"run_{stamp}"
            self.run_dir.mkdir(parents=True, exist_ok=True)
            seq = max((q for q, _ in self._own_runs()), default=-1) + 1
            owner = {"output_dir": self._owner, "seq": seq}
            (self.run_dir / _OWNER).write_text(json.dumps(owner) + "\n")
        self._writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=self._purge_step)
        return self._writer

    def log(self, name: str, data: float, step: int) -> None:
        (self._writer or self._open()).add_scalar(name, data, global_step=step, new_style=True)

    def log_dict(self, payload: dict, step: int) -> None:
        for name, data in payload.items():
            self.log(name, data, step)

    def log_config(self, config: DictConfig | dict) -> None:
        """The resolved config as text, beside the curves (each resume adds its own)."""
        text = OmegaConf.to_yaml(OmegaConf.create(config), resolve=True)
        (self._writer or self._open()).add_text("config", f"```\n{text}\n```")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def open_metric_logger(cfg: DictConfig, run_cfg: DictConfig, *, output_dir: Path,
                       resume_step: int | None):
    """The recipe's metric logger from its config section, with `run_cfg` logged. A resumed
    run continues its earlier TensorBoard run where the logger can (TensorBoardLogger) and
    says once where it cannot."""
    from .recipe_config import instantiate_checked
    logger = instantiate_checked("metric_logger", cfg)
    if isinstance(logger, TensorBoardLogger) and logger._owner is None:  # (by any import path)
        logger._owner = str(Path(output_dir).resolve())
    if resume_step is not None and not (isinstance(logger, TensorBoardLogger)
                                        and logger.resume(resume_step)):
        why = ((logger.not_resumed or f"no earlier run of {output_dir} in {logger.log_dir}")
               if isinstance(logger, TensorBoardLogger) else
               f"{type(logger).__name__} cannot continue a run; "
               "dualkv_compile.rl.TensorBoardLogger can")
        print(f"metric_logger: a new run from step {resume_step + 1} ({why}): steps after "
              f"{resume_step} that the interrupted run logged stay in its run too", flush=True)
    logger.log_config(run_cfg)
    return logger


def log_step(logger, metrics: dict, step: int):
    """logger.log_dict(metrics, step); after a write that failed (a full disk), None: the run
    goes on without metrics, said once, instead of ending with a traceback."""
    try:
        logger.log_dict(metrics, step=step)
        return logger
    except OSError as e:
        # TensorBoard writes in a background thread, which raises an earlier step's failure at
        # this call: that step (said in the thread's own traceback) is lost too
        print(f"warning: step {step}: the metric log could not be written ({e}); this step's "
              "metrics and possibly earlier ones (TensorBoard writes in a background thread) "
              "are lost, and no more are logged; training goes on", file=sys.stderr, flush=True)
        close_logger(logger, quiet=True)
        return None


def close_logger(logger, quiet: bool = False) -> None:
    """logger.close(); TensorBoard's writer thread raises a failed write again here, which is
    said (unless `quiet`), not raised: the run's work is done and saved."""
    try:
        logger.close()
    except OSError as e:
        if not quiet:
            print(f"warning: the metric log could not be written at its close ({e})",
                  file=sys.stderr, flush=True)
