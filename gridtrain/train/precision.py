"""Precision modes: fp32; bf16 autocast over fp32 master weights; fp16 autocast with dynamic
loss scaling.

fp16's loss scaling is dynamic loss scaling (Micikevicius et al. 2018) as `torch.amp.GradScaler`,
which does the work, implements it: multiply the loss by S before backward; if any gradient is
inf/NaN after unscaling, skip the optimizer step and halve S; after `growth_interval` clean steps
in a row, double S.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import ContextManager

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _MultiDeviceReplicator
from torch.distributed.tensor import DTensor

from gridtrain.config import TrainConfig
from gridtrain.parallel.parallelize import COMPUTE_DTYPES


class ShardAwareGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler that also unscales DTensor gradients (FSDP, TP), through their local
    shards; the overflow flag is then all-reduced by `Precision.unscale_`."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grads[grad.device][grad.dtype].append(grad)
            for device, per_dtype in grads.items():
                for grad_list in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        grad_list, per_device_found_inf.get(device), per_device_inv_scale.get(device))
        return per_device_found_inf._per_device_tensors


class Precision:
    """Autocast context and (for fp16) the loss scaler, behind one interface for the trainer."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.mode = cfg.precision
        self.device_type = device.type
        self.step_scale = 1.0
        self.scaler = ShardAwareGradScaler(
            device.type, init_scale=cfg.loss_scale_init, growth_factor=2.0, backoff_factor=0.5,
            growth_interval=cfg.loss_scale_growth_interval, enabled=self.mode == "fp16")

    def autocast(self) -> ContextManager:
        if self.mode not in COMPUTE_DTYPES:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=COMPUTE_DTYPES[self.mode])

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def metrics(self) -> dict[str, float]:
        """fp16's loss scale, for the step's metrics (nothing in fp32 and bf16)."""
        return {"precision/loss_scale": self.loss_scale} if self.mode == "fp16" else {}

    def begin_step(self) -> None:
        """Make sure the scale exists on every rank, also on pipeline ranks that compute no loss,
        and read the step's scale (`step_scale`) once."""
        if self.scaler.is_enabled() and self.scaler._scale is None:
            self.scaler._lazy_init_scale_growth_tracker(torch.device(self.device_type))
        self.step_scale = self.loss_scale
        """S for this step's losses, read before the step (a dry run's step cannot read a value)."""

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

    def step(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Step every optimizer (one per pipeline stage this rank holds) unless fp16 found an
        overflow, then update S once. Returns whether they stepped. (Updating S per optimizer
        would unscale the later ones' gradients a second time and grow S once per stage.)"""
        if not self.scaler.is_enabled():
            for optimizer in optimizers:
                optimizer.step()
            return True
        before = self.scaler.get_scale()
        for optimizer in optimizers:
            self.scaler.step(optimizer)
        self.scaler.update()
        # GradScaler skips the step exactly when it backs the scale off.
        return self.scaler.get_scale() >= before

    def skip(self) -> None:
        """The guard refused this step: no update; fp16's scaler still updates its scale (and
        forgets this step's unscaled state)."""
        if self.scaler.is_enabled():
            self.scaler.update()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only, so checkpoints never need to unpickle Python objects. Without a scaler
        (fp32, bf16) the saved scale is 0: no scale to carry over."""
        state = self.scaler.state_dict() if self.scaler.is_enabled() else {}
        return {"loss_scale": torch.tensor(float(state.get("scale", 0.0)), dtype=torch.float64),
                "growth_tracker": torch.tensor(int(state.get("_growth_tracker", 0)))}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Carry fp16's loss scale over a resume; a checkpoint saved without a scaler (fp32,
        bf16; scale 0) leaves fp16's initial scale (train.loss_scale_init)."""
        if not self.scaler.is_enabled() or float(state["loss_scale"]) <= 0:
            return
        full = self.scaler.state_dict()
        full.update(scale=float(state["loss_scale"]), _growth_tracker=int(state["growth_tracker"]))
        self.scaler.load_state_dict(full)
