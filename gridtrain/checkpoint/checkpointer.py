"""The run's checkpoint policy: when to save, how (blocking or in the background), what a failed
save does, resuming, and saving on a stop signal. `checkpoint.py` is the mechanism beneath it.

- When: every `checkpoint.interval` steps, or with "auto" after a save timed at step 5, at Daly's
  interval for the job's MTBF (Daly 2006, "A higher order estimate of the optimum checkpoint
  interval for restart dumps"); and at the last step (checkpoint.final).
- How: `checkpoint.async_save` writes in the background and commits as soon as every rank has
  written, so a crash loses at most the steps since the last commit.
- A failed save never touches the earlier checkpoints; `checkpoint.on_save_error` stops the run
  or logs it and tries again at the next interval (the run then fails at its end if no save has
  succeeded since).
"""

from __future__ import annotations

import datetime
import logging
import signal
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from gridtrain.config import CheckpointConfig
from gridtrain.checkpoint import store as checkpoint
from gridtrain.train.resilience import StopSignals, auto_interval

log = logging.getLogger("gridtrain")


class Stopped(Exception):
    """The run saved and stopped on a signal (SIGTERM, SIGUSR1); `signum` gives the exit status."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


AUTO_AFTER = 5
"""checkpoint.interval = "auto" times its first save after this many steps of the process (of a
run or of its resumption), against the median step since the first: the first step warms up (data, allocator, kernels), 15x a later one on the
default model, and would space the saves 15x too closely."""


class Checkpointer:
    """Saves and resumes one rank's model parts, optimizers and trainer state (`state()`: the
    tensors an exact resume needs besides model and optimizer). Every method is collective."""

    def __init__(self, cfg: CheckpointConfig, root: Path, parts: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer], state: Callable[[], dict[str, torch.Tensor]],
                 distributed: bool, rank: int) -> None:
        self.cfg, self.root, self.parts, self.optimizers, self.state = cfg, root, parts, optimizers, state
        self.rank = rank
        self.interval = None if cfg.interval == "auto" else cfg.interval
        """Steps between saves; None until "auto" has timed its first save."""
        self.step_times: list[float] = []
        """Seconds of each step before "auto" chooses."""
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        # Its own group: its timeout allows for rank 0 hashing every shard.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        self.saver = checkpoint.AsyncSaver(root, cfg.keep, self.group, timeout) if cfg.async_save else None
        self.signals = StopSignals(cfg.signal_grace_s)
        self.unsaved: Exception | None = None
        """The last save's error while on_save_error is 'continue' and no save has succeeded since."""

    def save(self, step: int) -> Path | None:
        """Save the checkpoint of `step` and return its path (in the background: start writing it,
        after committing the previous one, and return None); a failed save returns None when
        on_save_error is 'continue'."""
        if self.saver:
            target = checkpoint.step_dir(self.root, step)
            started = self._checked(lambda: self.saver.save(step, self.parts, self.optimizers, self.state()) or target)
            if started and self.rank == 0:
                log.info("checkpoint of step %d is being written in the background", step)
            return None
        return self._committed(lambda: checkpoint.save(self.root, step, self.parts, self.optimizers, self.state(),
                                                       self.cfg.keep, self.group))

    def _checked(self, save: Callable[[], Path | None]) -> Path | None:
        """Run one save (or commit); on CheckpointSaveError apply on_save_error: re-raise, or log
        it and return None."""
        try:
            path = save()
        except checkpoint.CheckpointSaveError as err:
            if self.cfg.on_save_error == "stop":
                raise
            log.error("%s; training goes on (checkpoint.on_save_error = 'continue')", err)
            self.unsaved = err
            return None
        if path:
            self.unsaved = None
        return path

    def _committed(self, commit: Callable[[], Path | None]) -> Path | None:
        path = self._checked(commit)
        if path and self.rank == 0:
            log.info("saved checkpoint %s", path)
        return path

    def finish(self) -> None:
        """Commit a checkpoint still being written in the background."""
        if self.saver:
            self._committed(self.saver.wait)

    def after_step(self, step: int, last_step: int, step_s: float) -> None:
        """The policy after each step: commit a background save every rank has written (a crash
        then loses at most the steps since it), then save if one is due."""
        if self.saver and self.saver.pending:
            self._committed(self.saver.poll)
        if self.interval is None:
            self.step_times.append(step_s)
            # Steps of this process (a resumed run warms up again); the median leaves out the first.
            if len(self.step_times) >= AUTO_AFTER or step == last_step:
                self.choose_interval(step, statistics.median(self.step_times[1:] or self.step_times))
        elif (self.interval > 0 and step % self.interval == 0) or (
                step == last_step and (self.interval > 0 or self.cfg.final)):
            self.save(step)

    def choose_interval(self, step: int, step_s: float) -> None:
        """checkpoint.interval = "auto": time a real save now and space the next ones by Daly's
        interval for checkpoint.mtbf_hours (the same on every rank: rank 0's times decide)."""
        start = time.perf_counter()
        self.save(step)
        self.finish()  # an asynchronous save costs the step it blocks, not just its copy
        times = torch.tensor([time.perf_counter() - start, step_s], dtype=torch.float64)
        if dist.is_initialized():
            dist.broadcast(times, src=0)
        self.interval, reason = auto_interval(times[0].item(), times[1].item(), self.cfg.mtbf_hours)
        if self.rank == 0:
            log.info("%s", reason)

    def check_last_saved(self, step: int) -> None:
        """At the end of the run: fail if the last save failed too (on_save_error 'continue')."""
        self.finish()
        if self.unsaved is not None:
            raise checkpoint.CheckpointSaveError(
                f"the run trained to step {step} but its last checkpoint could not be saved "
                f"({self.unsaved}); the newest saved one is in {self.root}, if any: free the space "
                "and run again with --resume")

    def stop(self, step: int) -> None:
        """A rank received SIGTERM or SIGUSR1: every rank saves this step's checkpoint and stops."""
        signum = self.signals.signum or signal.SIGTERM
        self.save(step)
        self.finish()
        raise Stopped(signum, f"stopped by {signal.Signals(signum).name} after step {step}; "
                      f"checkpoint {checkpoint.step_dir(self.root, step)} saved: continue with "
                      "the same command and --resume")

    def interrupted(self, step: int) -> str:
        """Ctrl-C: commit a checkpoint already written in the background (it used to be lost),
        then say where the run stands and how to continue it."""
        note = ""
        if self.saver and self.saver.pending:
            try:
                self.finish()
            except (checkpoint.CheckpointSaveError, KeyboardInterrupt) as err:
                note = f" (the checkpoint being written was abandoned: {err or 'interrupted again'})"
        saved = checkpoint.list_checkpoints(self.root)  # no collective: other ranks may be gone
        where = f"the newest checkpoint is {saved[-1][1]}" if saved else "no checkpoint was saved"
        return f"interrupted after step {step}{note}; {where}: continue with the same command and --resume"

    def resume(self) -> tuple[Path, dict[str, torch.Tensor]] | None:
        """Load the newest intact checkpoint into the parts and optimizers and return its path and
        trainer state (None when there is no checkpoint: the run starts from step 0; refused when
        there are checkpoints and none is intact)."""
        path, skipped = checkpoint.latest_valid_checkpoint(self.root, self.group)
        if path is None and skipped:  # a run that saved, none of it usable: starting over would bury it
            raise checkpoint.InvalidCheckpointError(
                f"none of the {len(skipped)} checkpoints in {self.root} is intact ({skipped[0][0].name}: "
                f"{skipped[0][1]}): move them aside to train from step 0")
        if path is None:
            if self.rank == 0:
                log.info("resume: no checkpoint in %s yet, starting from step 0", self.root)
            return None
        return path, checkpoint.load(path, self.parts, self.optimizers, self.state(), self.group)
