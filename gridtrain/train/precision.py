"""Precision modes: fp32; bf16 autocast over fp32 master weights; fp16 autocast with dynamic
loss scaling.

fp16's loss scaling follows the protocol of the seeds (and of `torch.amp.GradScaler`, which does
the work): multiply the loss by S before backward; if any gradient is inf/NaN after unscaling,
skip the optimizer step and halve S; after `growth_interval` clean steps in a row, double S.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
import torch.distributed as dist

from gridtrain.config import TrainConfig

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast context and (for fp16) the loss scaler, behind one interface for the trainer."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.mode = cfg.precision
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(
            device.type, init_scale=cfg.loss_scale_init, growth_factor=2.0, backoff_factor=0.5,
            growth_interval=cfg.loss_scale_growth_interval, enabled=self.mode == "fp16")

    def autocast(self) -> ContextManager:
        if self.mode not in AUTOCAST_DTYPES:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=AUTOCAST_DTYPES[self.mode])

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None) -> None:
        """Divide the gradients by S in place (before clipping); a no-op outside fp16.

        With sharded or split gradients each rank sees only its part, so the overflow flag is
        all-reduced (max) over `group`: every rank then skips, or steps, together.
        """
        if not self.scaler.is_enabled():
            return
        self.scaler.unscale_(optimizer)
        if group is not None:
            state = self.scaler._per_optimizer_states[id(optimizer)]
            for found_inf in state["found_inf_per_device"].values():
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step unless fp16 found an overflow; updates S. Returns whether it stepped."""
        if not self.scaler.is_enabled():
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # GradScaler skips the step exactly when it backs the scale off.
        return self.scaler.get_scale() >= before

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only, so checkpoints never need to unpickle Python objects."""
        state = self.scaler.state_dict() if self.scaler.is_enabled() else {}
        return {"loss_scale": torch.tensor(float(state.get("scale", 1.0)), dtype=torch.float64),
                "growth_tracker": torch.tensor(int(state.get("_growth_tracker", 0)))}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not self.scaler.is_enabled():
            return
        full = self.scaler.state_dict()
        full.update(scale=float(state["loss_scale"]), _growth_tracker=int(state["growth_tracker"]))
        self.scaler.load_state_dict(full)
