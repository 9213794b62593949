"""Stragglers named: the spread of per-rank step times, and the rank persistently slower than the rest.

Every rank's wall time per step is the same (each step ends in collectives that wait for the last
rank), so what tells a slow rank apart is the time it spends working, not waiting. On CPU that is
the process's CPU time over the step: a rank blocked in a gloo collective sleeps on a condition
variable and spends none, while a rank whose cores run slower (thermal throttling, a failing
DIMM, a CPU-hungry neighbour process on its cores counts only if it slows this one's
instructions) spends more for the same work. Every `every` steps the ranks all-gather their mean
CPU seconds per step over the window (one float each, over the world), and every rank logs or
returns the same verdict:

- the spread: the fastest and slowest rank and (slowest - fastest) / median;
- a straggler: a rank that was the slowest, by more than `ratio` x the median, in `windows`
  windows in a row (one slow window is noise: a save, a collection of garbage).

On GPUs the CPU time of the launching thread says nothing about the kernels; there the same
report would read CUDA events (not built: gridtrain measures on CPU first).
"""

from __future__ import annotations

import logging
import statistics

import torch
import torch.distributed as dist

log = logging.getLogger("gridtrain")


class StragglerWatch:
    """Collects this rank's CPU seconds per step and, every `every` steps, compares the ranks."""

    def __init__(self, every: int, rank: int, world_size: int, ratio: float = 1.2, windows: int = 2) -> None:
        self.every, self.rank, self.world_size = every, rank, world_size
        self.ratio, self.windows = ratio, windows
        self.seconds, self.steps = 0.0, 0
        self.suspect, self.in_a_row = -1, 0

    def observe(self, step: int, cpu_seconds: float) -> dict[str, float]:
        """Count one step's CPU seconds; on every `every`-th step, compare the ranks (a collective:
        every rank calls it on the same steps) and return the window's metrics."""
        if self.every <= 0 or self.world_size < 2:
            return {}
        self.seconds += cpu_seconds
        self.steps += 1
        if step % self.every:
            return {}
        mine = torch.tensor([self.seconds / self.steps], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        self.seconds, self.steps = 0.0, 0
        return self.judge(step, [t.item() for t in everyone])

    def judge(self, step: int, per_rank: list[float]) -> dict[str, float]:
        """The window's verdict from each rank's mean CPU seconds per step (logged by rank 0)."""
        median = statistics.median(per_rank)
        slow = max(range(len(per_rank)), key=per_rank.__getitem__)
        fast = min(range(len(per_rank)), key=per_rank.__getitem__)
        spread = (per_rank[slow] - per_rank[fast]) / median if median > 0 else 0.0
        behind = median > 0 and per_rank[slow] > self.ratio * median
        self.in_a_row = self.in_a_row + 1 if behind and slow == self.suspect else int(behind)
        self.suspect = slow if behind else -1
        if self.rank == 0:
            log.info("step %d: per-rank compute over the last %d steps (CPU s/step): median %.4f, fastest rank %d "
                     "%.4f, slowest rank %d %.4f (%.2fx the median); spread %.0f%%", step, self.every, median, fast,
                     per_rank[fast], slow, per_rank[slow], per_rank[slow] / median if median > 0 else 0.0,
                     100 * spread)
            if self.in_a_row >= self.windows:
                log.warning("straggler: rank %d was the slowest in the last %d windows of %d steps, %.2fx the "
                            "median rank's compute per step: every collective waits for it; look at its host "
                            "(throttled or shared cores, memory errors)", slow, self.in_a_row, self.every,
                            per_rank[slow] / median)
        return {"straggler/spread_pct": 100 * spread, "straggler/slowest_rank": float(slow),
                "straggler/slowest_over_median": per_rank[slow] / median if median > 0 else 0.0,
                "straggler/flagged_rank": float(slow if self.in_a_row >= self.windows else -1)}
