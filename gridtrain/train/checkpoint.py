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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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


def _state(model: nn.Module, optimizer: torch.optim.Optimizer,
           trainer_state: dict[str, torch.Tensor]) -> dict[str, object]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "trainer": trainer_state}


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         trainer_state: dict[str, torch.Tensor], keep: int) -> Path:
    """Write the checkpoint of `step` atomically and keep only the newest `keep`."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with warnings.catch_warnings():
        # A world of one runs DCP without a process group, which it announces each time.
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(_state(model, optimizer, trainer_state), checkpoint_id=tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         trainer_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load a checkpoint into the model and optimizer in place; returns the trainer's state.

    `trainer_state` gives the keys and shapes expected (its values are overwritten).
    """
    state = _state(model, optimizer, trainer_state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["trainer"]  # type: ignore[return-value]
