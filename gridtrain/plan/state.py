"""The model state a rank holds, in bytes per parameter by precision convention and ZeRO stage.

Model state, bytes per parameter (ZeRO paper, Rajbhandari et al. 2020, sec. 3.1): mixed-precision
Adam keeps 16-bit weights (2) and gradients (2), and K = 12 bytes of optimizer state: fp32 master
weights (4) and the two fp32 moments m, v (8), 2 + 2 + 12 = 16. A shortcut often quoted counts
2 + 2 + 4 + 4 = 12 (no master copy) and so gets 4.86 TB for 405B where the ZeRO convention gives
6.48 TB; gridtrain follows the paper (`StateBytes.no_master()` gives the 12-byte count).

ZeRO stages shard over N data-parallel ranks: stage 1 the optimizer state, 2 also gradients,
3 also weights: 16 -> 4 + 12/N -> 2 + 14/N -> 16/N bytes/param. HSDP shards over dp_shard only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model-state bucket: a precision convention."""

    weights: float = 2
    """The stored weights (the compute copy in the ZeRO paper's convention)."""
    gradients: float = 2
    """Gradients, also the dtype they are reduced in (4 with fp32 gradient accumulation)."""
    master: float = 4
    """fp32 master weights, counted in the optimizer bucket (ZeRO's K)."""
    moments: float = 8
    """Adam's m and v in fp32."""
    gathered: float | None = None
    """Bytes per element of the copy FSDP all-gathers and the matmuls read (None: `weights`)."""
    step_count: float = 0
    """Bytes of Adam's step count per parameter tensor (torch keeps one fp32 scalar each)."""
    exact: bool = False
    """Count tensor by tensor as gridtrain's runtime holds them (census.py): FSDP's rounded-up
    chunks, ZeRO-1's whole-tensor partition; otherwise every bucket divides evenly."""

    @property
    def optimizer(self) -> float:
        return self.master + self.moments

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def compute(self) -> float:
        return self.weights if self.gathered is None else self.gathered

    @property
    def adamw_traffic(self) -> float:
        """HBM bytes AdamW moves per parameter: read the gradient, read and write the moments,
        read and write the master copy and write the weights (or, without a separate master copy,
        read and write the weights)."""
        weights = 2 * self.master + self.weights if self.master else 2 * self.weights
        return self.gradients + weights + 2 * self.moments

    @classmethod
    def mixed(cls, fp32_master: bool = True, fp32_grads: bool = False) -> StateBytes:
        """Mixed-precision Adam: 2 + 2 + 12 = 16 (ZeRO paper); fp32 gradient accumulation adds 2."""
        return cls(2, 4 if fp32_grads else 2, 4 if fp32_master else 0, 8)

    @classmethod
    def megatron(cls) -> StateBytes:
        """Megatron-LM's bf16 training: 16-bit weights, fp32 gradient buffers (bf16 forces fp32
        gradient accumulation), fp32 master weights and moments: 2 + 4 + 12 = 18."""
        return cls.mixed(fp32_grads=True)

    @classmethod
    def fp32(cls) -> StateBytes:
        """Pure fp32 Adam: 4 + 4 + 8 = 16. The master copy is the weights themselves."""
        return cls(4, 4, 0, 8)

    @classmethod
    def gridtrain(cls, precision: str = "bf16") -> StateBytes:
        """What gridtrain's runtime holds in every precision: fp32 parameters (the master copy),
        fp32 gradients and Adam moments, 4 + 4 + 8 = 16 bytes, plus a 4-byte step count per
        tensor, counted tensor by tensor. bf16 and fp16 only change the compute copy: what
        autocast casts and FSDP gathers (2 bytes)."""
        return cls(4, 4, 0, 8, gathered=2 if precision in ("bf16", "fp16") else 4, step_count=4, exact=True)

    @classmethod
    def no_master(cls) -> StateBytes:
        """2 + 2 + 4 + 4 = 12: no fp32 master copy (not the ZeRO convention)."""
        return cls(2, 2, 0, 8)


CONVENTIONS = {"gridtrain": StateBytes.gridtrain, "zero": lambda precision="bf16": StateBytes.mixed(),
               "megatron": lambda precision="bf16": StateBytes.megatron(),
               "no-master": lambda precision="bf16": StateBytes.no_master()}
"""Precision conventions `gridtrain plan --convention` offers: gridtrain's runtime (the default),
the ZeRO paper's (Rajbhandari et al. 2020), Megatron-LM's, and the 12-byte count of lecture notes
(no fp32 master copy), with which their worked memory figures are reproduced."""


@dataclass(frozen=True)
class ModelState:
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(num_params: float, zero_stage: int, shard: int,
                      state: StateBytes = StateBytes()) -> ModelState:
    """Bytes per rank for `num_params` parameters under a ZeRO stage over `shard` ranks.

    Worked example, 7B over 64 GPUs: stage 0 112 GB, 1 29.3 GB, 2 15.5 GB, 3 1.75 GB."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage}")
    n = shard if zero_stage else 1
    # gridtrain's ZeRO-2 is FSDP2 without resharding after forward: its weights are sharded at rest
    # too (the gathered copies count as buffers, gathered_bytes_per_param).
    sharded_from = 2 if state.exact else 3
    return ModelState(
        weights=num_params * state.weights / (n if zero_stage >= sharded_from else 1),
        gradients=num_params * state.gradients / (n if zero_stage >= 2 else 1),
        optimizer=num_params * state.optimizer / (n if zero_stage >= 1 else 1),
    )


@functools.lru_cache(maxsize=1024)
def state_bytes_per_param(zero_stage: int, shard: int, state: StateBytes = StateBytes()) -> float:
    """Model-state bytes per parameter on one rank: model_state_bytes(1, ...).total (16 at stage 0
    with mixed-precision Adam, 4 + 12/N at stage 1, 2 + 14/N at 2, 16/N at 3)."""
    return model_state_bytes(1, zero_stage, shard, state).total
