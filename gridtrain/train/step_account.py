"""Accounting of one training step: this rank's memory by bucket and the step's collectives, as
measured (gridtrain.parallel.accounting has the instruments), every `metrics.account_every` steps.

Each accounted step is a line of <run_dir>/accounting/rank<r>.jsonl and part of the step's
metrics; `gridtrain plan --check` sets them beside the planner's numbers for the same layout.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch

from gridtrain.parallel.accounting import (CollectiveLog, SavedActivations, flatten_comm, grad_bytes,
                                          optimizer_bytes, param_bytes)
from gridtrain.parallel.parallelize import ParallelModel


class StepAccount:
    """One step's measurements, taken around its forward and backward and after its collectives;
    inactive (every method does nothing) on a step that is not accounted."""

    def __init__(self, active: bool, pmodel: ParallelModel, comm_log: CollectiveLog | None) -> None:
        self.active, self.pmodel, self.comm_log = active, pmodel, comm_log
        self.record: dict[str, float] = {}

    @contextlib.contextmanager
    def forward_backward(self) -> Iterator[None]:
        """Around the step's forward and backward: the activations saved for backward, the
        gradients it leaves, the bytes the pipeline and the CP ring send."""
        if not self.active:
            yield
            return
        parts = self.pmodel.parts
        meter = SavedActivations(self.pmodel.parameters(), [b for part in parts for b in part.buffers()], parts)
        if self.comm_log:
            self.comm_log.start()
        counters = {"pp": self.pmodel.traffic, "cp": self.pmodel.ring_traffic}
        sent = {axis: counter.send_bytes for axis, counter in counters.items() if counter}
        with meter:
            yield
        self.record = {"memory/gradients_bytes": float(grad_bytes(self.pmodel.parameters())),
                       "memory/activations_bytes": float(meter.bytes)}
        for axis, before in sent.items():
            self.record[f"comm/{axis}/send_bytes"] = float(counters[axis].send_bytes - before)

    def collectives_done(self) -> None:
        """The forward's, backward's and clipping's collectives end here (a loss average after
        it is reporting, not training)."""
        if self.active and self.comm_log:
            self.record.update(flatten_comm(self.comm_log.since_start()))

    def optimizer_begins(self, reporting: int = 0) -> None:
        """The optimizer's own collectives start here, after the `reporting` collectives issued
        since `collectives_done` (the loss average): ZeRO-1's broadcast of each rank's updated
        parameters (they were missing from the step's record)."""
        if self.active and self.comm_log:
            self.comm_log.skip(reporting)

    def finish(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, float]:
        """The step's record, once the optimizer has stepped (its state exists then)."""
        if not self.active:
            return {}
        if self.comm_log:
            for key, value in flatten_comm(self.comm_log.since_start()).items():
                self.record[key] = self.record.get(key, 0.0) + value
        self.record["memory/weights_bytes"] = float(param_bytes(self.pmodel.parameters()))
        self.record["memory/optimizer_bytes"] = float(optimizer_bytes(optimizers))
        return self.record


class Accountant:
    """Decides which steps are accounted and appends their records to the rank's file."""

    def __init__(self, every: int, run_dir: Path, rank: int, coords: dict[str, int],
                 pmodel: ParallelModel, comm_log: CollectiveLog | None) -> None:
        self.every, self.rank, self.coords, self.pmodel, self.comm_log = every, rank, coords, pmodel, comm_log
        self.path = Path(run_dir) / "accounting" / f"rank{rank}.jsonl"

    def step(self, step: int) -> StepAccount:
        """The account of step `step` (0-based): the first step and every `every`-th."""
        due = self.every > 0 and (step == 0 or (step + 1) % self.every == 0)
        return StepAccount(due, self.pmodel, self.comm_log)

    def write(self, step: int, record: dict[str, float]) -> None:
        if not record:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "rank": self.rank, **self.coords, **record}) + "\n")
