"""A job's start on every rank: the run directory's lock, the decision to start, continue or resume
the run in it (made by rank 0 once per torchrun attempt, agreed by every rank), and the restarts
torchrun has spent on each node."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from gridtrain.config import Config, ConfigError
from gridtrain.rundir import NEW, RESUME, job_id, run_dir_decision
from gridtrain.runlock import RunDirInUse, RunLock
from gridtrain.train.distributed import any_rank, from_rank0
from gridtrain.train.resilience import restart_count

log = logging.getLogger("gridtrain")


def hold_run_dir(dirs: list[Path], rank: int) -> list[RunLock]:
    """Rank 0 takes the lock of the run directory (and of a checkpoint directory outside it) for
    the job's lifetime (runlock.RunLock); every rank raises RunDirInUse if it cannot (an
    all-reduce of one flag), before anything is written."""
    locks: list[RunLock] = []
    error = None
    if rank == 0:
        try:
            locks = [RunLock.acquire(d) for d in dirs]
        except RunDirInUse as err:
            error = err
            for lock in locks:
                lock.release()
    if any_rank(error is not None):
        raise error or RunDirInUse(f"run_dir {dirs[0]} is in use by another gridtrain job (rank 0 names it)")
    return locks


def agree_on_run_dir(cfg: Config, rank: int) -> tuple[str, bool]:
    """Rank 0's run-directory decision (rundir.run_dir_decision: new run, this job's own run, or a
    resume; or the refusal, raised on every rank), and whether torchrun restarted any rank: one
    decision per attempt, the same on every node whatever its own restart count. Outside torchrun
    the command line has decided before the process started (rundir.check_run_dir), and a Trainer
    built in a program (a test, the parity harness) resumes when told to."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return (RESUME if cfg.checkpoint.resume else NEW), False
    spent = restarts_by_node()  # torchrun counts only the failed node's restarts
    restarted = any(spent.values())
    if restarted and rank == 0:
        log.warning("torchrun restarts spent so far, by node: %s (of --max-restarts %s each)",
                    ", ".join(f"node {node}: {count}" for node, count in sorted(spent.items())),
                    os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"))
    outcome: tuple[str, list[str]] = ("", [])
    if rank == 0:
        try:
            outcome = (run_dir_decision(cfg, job_id(), restarted), [])
        except ConfigError as err:
            outcome = ("refused", err.problems)
    decision, problems = from_rank0(outcome)
    if problems:
        raise ConfigError(problems)
    return decision, restarted


def restarts_by_node() -> dict[int, int]:
    """Each node's torchrun restart count (its GROUP_RANK: node 0 holds ranks 0..local-1): an
    all-gather of two int64 per rank."""
    mine = torch.tensor([int(os.environ.get("GROUP_RANK", 0)), restart_count()], dtype=torch.int64)
    if not dist.is_initialized():
        return {int(mine[0]): int(mine[1])}
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return {int(t[0]): int(t[1]) for t in everyone}
