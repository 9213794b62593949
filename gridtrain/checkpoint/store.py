"""Checkpoints through torch.distributed.checkpoint (DCP) that never lose work.

A checkpoint is the directory `<checkpoint_dir>/step-NNNNNNN`: model and optimizer state keyed by
parameter name (so it can be loaded into another layout), the trainer's state as tensors (step,
data position, loss scaler, RNG), and `manifest.json` (see `manifest.py`): the size and sha256 of
every file. A save goes through three stages, each closed by an all-reduce of a status flag so that
a failure on any rank fails the save on every rank instead of leaving one waiting in a barrier:

1. prepare: rank 0 creates `step-NNNNNNN.tmp`;
2. shards: every rank writes its DCP shards into it (DCP gathers write errors and raises on all);
3. commit: rank 0 hashes and fsyncs every file, writes the manifest atomically, renames the
   directory to `step-NNNNNNN`, fsyncs the parent, then prunes checkpoints older than this one.

A failed stage removes the .tmp directory (best effort) and raises `CheckpointSaveError` on every
rank; no earlier checkpoint is touched. Resume uses `latest_valid_checkpoint`, which skips (and logs)
any checkpoint that does not verify, and `load` refuses one that does not.

Collective contract: `save`, `load`, `latest_valid_checkpoint` (and `latest_checkpoint`) must be
called by every rank when a process group exists. Verification runs on rank 0 only (it reads every
byte); the verdict reaches the other ranks as an int64 tensor (a step number or a status flag),
never a pickled object, through an all-reduce / broadcast of 8 bytes over the world.

For tests only: `GRIDTRAIN_FAULT_SAVE_ERROR=ENOSPC` makes the save fail with that OSError while
writing shards; `ENOSPC:prepare` or `EACCES:manifest` pick another stage, `ENOSPC@1` only rank 1
(writer.inject_fault).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from concurrent import futures
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from gridtrain.checkpoint.writer import Writer, fix_for, inject_fault, os_error
from gridtrain.checkpoint.manifest import fsync_dir, verify, write_manifest
from gridtrain.checkpoint.state import (InvalidCheckpointError, read_problem, read_state, set_optimizer_state,
                                              state_of)

log = logging.getLogger(__name__)
Group = dist.ProcessGroup | None
"""The ranks a save or load agrees over: None is the world (the trainer passes a group of its own
whose timeout allows for rank 0 hashing every shard)."""
# A world of one runs DCP without a process group, which DCP announces on every save and load,
# also from the background thread of an asynchronous save (where a local filter would not reach).
warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process.*")

_STEP_DIR = re.compile(r"^step-(\d{7})$")


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; its .tmp directory is gone and older ones are intact."""


def step_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives: `root/step-NNNNNNN`."""
    return root / f"step-{step:07d}"


def _tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def _candidates(root: Path) -> list[tuple[int, Path]]:
    """Every directory named step-NNNNNNN under `root`, oldest first, complete or not."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Checkpoints under `root` by name (step-NNNNNNN holding DCP's .metadata), oldest first.
    Cheap and unverified: resume through `latest_valid_checkpoint`."""
    return [(s, p) for s, p in _candidates(root) if (p / ".metadata").is_file()]


# -- agreement between ranks ------------------------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree(ok: bool, group: Group = None) -> bool:
    """True when every rank says ok: an all-reduce (MAX) of one int64 over the world, on CPU
    (gloo, or the cpu:gloo half of a cpu:gloo,cuda:nccl group)."""
    if not dist.is_initialized():
        return ok
    failed = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    return int(failed.item()) == 0


def _broadcast_int(value: int, group: Group = None) -> int:
    """Rank 0's `value` on every rank: a broadcast of one int64 tensor (8 bytes) over the world."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return int(t.item())


# -- choosing a checkpoint ---------------------------------------------------------------------

def latest_valid_checkpoint(root: Path, group: Group = None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `root` that verifies, and the newer ones skipped with why.

    Collective: rank 0 verifies (newest first, stopping at the first intact one), logs a WARNING
    per skipped checkpoint and broadcasts the chosen step, so every rank picks the same one. The
    other ranks list the skipped ones with the reason "failed verification on rank 0"."""
    candidates = _candidates(root)
    skipped: list[tuple[Path, str]] = []
    chosen = -1
    if _rank() == 0:
        for step, path in reversed(candidates):
            reason = verify(path)
            if reason is None:
                chosen = step
                break
            log.warning("checkpoint %s skipped: %s", path.name, reason)
            skipped.append((path, reason))
    chosen = _broadcast_int(chosen, group)
    if _rank() != 0:
        skipped = [(p, "failed verification on rank 0 (its log names the problem)")
                   for s, p in candidates if s > chosen]
    return (step_dir(root, chosen) if chosen >= 0 else None), skipped


def latest_checkpoint(root: Path) -> Path | None:
    """`latest_valid_checkpoint(root)[0]`: the newest checkpoint that verifies (collective)."""
    return latest_valid_checkpoint(root)[0]


# -- failures --------------------------------------------------------------------------------

def _save_error(final: Path, step: int, stage: str, error: BaseException | None) -> CheckpointSaveError:
    failed, rank = os_error(error)
    if failed is not None:
        on = f" on rank {rank}" if rank is not None else ""
        cause = f"{failed}{on}"
    elif error is not None:
        cause = f"{type(error).__name__}: {error}"
    else:
        cause = "a failure on another rank (rank 0's log names it)"
    fix = (fix_for(failed.errno if failed else None, final.parent) if failed or error is None
           else "see the chained exception (not a filesystem error)")
    return CheckpointSaveError(
        f"checkpoint of step {step} not saved to {_tmp_dir(final)} ({stage} failed: {cause}); the "
        f".tmp directory was removed and earlier checkpoints in {final.parent} are untouched. "
        f"Fix: {fix}")


def _stage(final: Path, step: int, stage: str, work: Callable[[], object], all_ranks: bool,
           group: Group = None) -> None:
    """Run one save stage (on every rank, or rank 0 only), then agree on its outcome: on a failure
    anywhere, rank 0 removes the .tmp directory and every rank raises CheckpointSaveError."""
    error: BaseException | None = None
    if all_ranks or _rank() == 0:
        try:
            work()
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            error = e
    if _agree(error is None, group):
        return
    if _rank() == 0:
        shutil.rmtree(_tmp_dir(final), ignore_errors=True)
    _agree(True, group)  # a barrier: no rank returns while the .tmp directory still exists
    raise _save_error(final, step, stage, error) from error


# -- saving ------------------------------------------------------------------------------------

def _prepare(final: Path) -> None:
    tmp = _tmp_dir(final)
    inject_fault("prepare", tmp)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (same step, an earlier run) is moved aside
    first and deleted only once the new one is in place."""
    aside = final.with_name(final.name + ".replaced")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError:
        if aside.exists():
            os.replace(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)


_LEFTOVER = re.compile(r"^step-(\d{7})\.(tmp|replaced)$")


def _remove_leftovers(root: Path, committed_step: int) -> list[Path]:
    """Delete what crashed saves of earlier steps left (`step-NNNNNNN.tmp`, `.replaced`): no
    save will ever finish them, and after many crashes they would fill the disk."""
    deleted = []
    for path in root.iterdir():
        match = _LEFTOVER.match(path.name)
        if match and int(match.group(1)) < committed_step and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    return deleted


def prune(root: Path, committed_step: int, keep: int) -> list[Path]:
    """Delete checkpoints older than `committed_step` beyond the newest `keep` intact ones (the
    committed one counts; a checkpoint failing the cheap size check does not), and the leftovers
    of earlier crashed saves. Newer checkpoints are never touched; `keep` < 1 keeps everything.
    Returns the deleted paths; never raises."""
    if keep < 1:
        return []
    kept, deleted = 1, _remove_leftovers(root, committed_step)
    for step, path in reversed(_candidates(root)):
        if step >= committed_step:
            continue
        if kept < keep:
            kept += verify(path, deep=False) is None
            continue
        try:
            shutil.rmtree(path)
            deleted.append(path)
        except OSError as e:
            log.warning("could not delete old checkpoint %s: %s", path, e)
    return deleted


def _commit(root: Path, final: Path, step: int, keep: int, group: Group = None) -> None:
    """Stage 3 (rank 0): manifest, rename, prune; then every rank learns the outcome."""
    def commit() -> None:
        tmp = _tmp_dir(final)
        inject_fault("manifest", tmp)
        write_manifest(tmp, step, dist.get_world_size() if dist.is_initialized() else 1)
        _replace_dir(tmp, final)
        fsync_dir(root)
        prune(root, step, keep)

    _stage(final, step, "commit (manifest and rename)", commit, all_ranks=False, group=group)


def save(root: Path, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
         trainer_state: dict[str, torch.Tensor], keep: int, group: Group = None) -> Path:
    """Write the checkpoint of `step` (collective over `group`, the world by default; see the
    module docstring for the stages) and keep the newest `keep` intact ones. Returns
    `root/step-NNNNNNN`, committed with its manifest. Raises CheckpointSaveError on every rank
    if any rank fails; older checkpoints stay intact."""
    return save_state(root, step, state_of(parts, optimizers, trainer_state), keep, group)


def save_state(root: Path, step: int, state: dict[str, object], keep: int, group: Group = None,
               planner: SavePlanner | None = None, own_file_from: int | None = None) -> Path:
    """`save` of a state dict as `state_of` makes it. `planner` may produce the tensors as DCP
    writes them (SavePlanner.resolve_data), and `own_file_from` gives each tensor of at least
    that many bytes a file of its own (writer.Writer): together they write a state
    that is never whole in memory."""
    final = step_dir(root, step)
    _stage(final, step, "prepare", lambda: _prepare(final), all_ranks=False, group=group)
    writer = Writer(_tmp_dir(final), own_file_from)
    _stage(final, step, "writing shards",
           lambda: dcp.save(state, storage_writer=writer, planner=planner, process_group=group),
           all_ranks=True, group=group)
    _commit(root, final, step, keep, group)
    return final


class AsyncSaver:
    """Checkpoints written by DCP in a background thread while training goes on.

    `save` copies the state to CPU memory (DCP's staging), starts the write and returns; the commit
    (manifest, rename, prune) of a pending save happens at the first `poll` after every rank has
    written it, at the next `save` or at `wait()`, which raise its CheckpointSaveError if the
    write failed. Call `wait()` before the run ends.
    Collective: every rank constructs it (it creates a gloo group for the background collectives,
    so they never interleave with training's) and calls `save` and `wait` at the same steps."""

    def __init__(self, root: Path, keep: int, group: Group = None, timeout: timedelta = timedelta(minutes=30)) -> None:
        self.root, self.keep = root, keep
        # The ranks agree over `group` in this thread while DCP's writer thread runs its own
        # collectives: those get a group of their own, or the two would interleave.
        self.group = group
        self.background = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self.pending: tuple[int, futures.Future] | None = None

    def save(self, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
             trainer_state: dict[str, torch.Tensor]) -> None:
        """Commit the pending save (blocking until it is written), then start this one. If the
        pending save failed, its CheckpointSaveError is raised and this one is not started."""
        self.wait()
        final = step_dir(self.root, step)
        _stage(final, step, "prepare", lambda: _prepare(final), all_ranks=False, group=self.group)
        state = state_of(parts, optimizers, trainer_state)
        started: list[futures.Future] = []

        def start() -> None:
            response = dcp.async_save(state, storage_writer=Writer(_tmp_dir(final)), process_group=self.background)
            started.append(getattr(response, "upload_completion", response))

        _stage(final, step, "staging", start, all_ranks=True, group=self.group)
        self.pending = (step, started[0])

    def poll(self) -> Path | None:
        """Commit the pending save if every rank has finished writing it (one all-reduce of a
        flag over the group, so all ranks commit together); None while one is still writing."""
        if self.pending is None or not _agree(self.pending[1].done(), self.group):
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Block until the pending save is written, commit it and return its path (None if none)."""
        if self.pending is None:
            return None
        step, future = self.pending
        self.pending = None
        final = step_dir(self.root, step)
        _stage(final, step, "writing shards", future.result, all_ranks=True, group=self.group)
        _commit(self.root, final, step, self.keep, self.group)
        return final


# -- loading ---------------------------------------------------------------------------------

def load(path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
         trainer_state: dict[str, torch.Tensor], group: Group = None) -> dict[str, torch.Tensor]:
    """Load a checkpoint into the model parts and optimizers in place; returns the trainer's
    state. `trainer_state` gives the keys and shapes expected (its values are overwritten).

    Collective: rank 0 verifies `path` against its manifest first (every byte), every rank
    checks the metadata it will read (untrusted.SafeReader: DCP's classes only, no pickled
    item, no file outside the manifest) and its shapes against this rank's state, and all
    raise InvalidCheckpointError if any rank finds a problem. Tensors then load through
    torch.load(weights_only=True): nothing in a checkpoint is ever unpickled."""
    state = state_of(parts, optimizers, trainer_state)
    reason, reader = (verify(path) if _rank() == 0 else None), None
    if reason is None:
        reason, reader = read_problem(path, state)
    if not _agree(reason is None, group):
        detail = reason or "another rank found a problem (its log names it)"
        raise InvalidCheckpointError(
            f"refusing to load checkpoint {path}: {detail}. Resume picks the newest intact "
            "checkpoint by itself (checkpoint.latest_valid_checkpoint); move this one aside to "
            "inspect it")
    read_state(reader, state, group)
    for part, opt in zip(parts, optimizers):
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state(part, opt, state["optim"])
    return state["trainer"]  # type: ignore[return-value]
