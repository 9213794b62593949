"""Checkpoints through torch.distributed.checkpoint (DCP), from the first run on.

A checkpoint is the directory `<checkpoint_dir>/step-NNNNNNN`: model and optimizer state keyed by
parameter name (so it can be loaded into another layout), and the trainer's state as tensors
(step, data position, loss scaler, RNG), so loading never unpickles Python objects. It is written
into `step-NNNNNNN.tmp` and renamed when complete: a crash mid-save leaves no half checkpoint
that a resume could pick.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{7})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:07d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / ".metadata").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
           trainer_state: dict[str, torch.Tensor]) -> dict[str, object]:
    """One state dict for all of this rank's model parts: keys are global parameter names (and
    flattened optimizer keys), so any layout can write and any other can read it."""
    model_sd: dict[str, object] = {}
    optim_sd: dict[str, object] = {}
    for part, opt in zip(parts, optimizers):
        msd, osd = get_state_dict(part, opt, options=_FLAT)
        model_sd.update(msd)
        optim_sd.update(osd)
    return {"model": model_sd, "optim": optim_sd, "trainer": trainer_state}


def _sync() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(root: Path, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
         trainer_state: dict[str, torch.Tensor], keep: int) -> Path:
    """Write the checkpoint of `step` atomically (rank 0 renames once every rank has written)
    and keep only the newest `keep`."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    leader = not dist.is_initialized() or dist.get_rank() == 0
    if leader:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _sync()
    with warnings.catch_warnings():
        # A world of one runs DCP without a process group, which it announces each time.
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(_state(parts, optimizers, trainer_state), checkpoint_id=tmp)
    _sync()
    if leader:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _sync()
    return final


def load(path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
         trainer_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load a checkpoint into the model parts and optimizers in place; returns the trainer's
    state. `trainer_state` gives the keys and shapes expected (its values are overwritten)."""
    state = _state(parts, optimizers, trainer_state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, checkpoint_id=path)
    for part, opt in zip(parts, optimizers):
        set_state_dict(part, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True, strict=False))
    return state["trainer"]  # type: ignore[return-value]
