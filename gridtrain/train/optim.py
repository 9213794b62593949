"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedules."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gridtrain.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig, mesh: Any = None, zero_stage: int = 0,
                    dp: int = 1) -> torch.optim.Optimizer:
    """AdamW; weight decay applies to 2-D weights except embeddings (norm gains are 1-D).

    With ZeRO stage 1 over several data-parallel ranks, the optimizer state is sharded
    (ZeroRedundancyOptimizer). The learning rate set here is the peak; the schedule scales it
    each step (`set_lr`).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "tok_embeddings" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    defaults = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if mesh is not None and dp > 1 and zero_stage == 1:
        from gridtrain.parallel.data_parallel import build_zero1_optimizer

        return build_zero1_optimizer(groups, mesh, **defaults)
    # torch picks foreach everywhere by default; on CUDA the fused kernel updates every parameter in
    # a few launches and reads no step count back to the host (torchtitan's default there too).
    fused = all(p.device.type == "cuda" for g in groups for p in g["params"]) and bool(decay + no_decay)
    return torch.optim.AdamW(groups, **defaults, fused=fused or None)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Linear warm-up over `warmup_steps` (step 0 gets lr/warmup, so no step is wasted at zero),
    then: 'cosine' from the peak to min_lr_ratio x peak at the last step; 'linear' the same,
    straight; 'wsd' constant until the last `decay_fraction` of the steps, then linear to the
    minimum (warmup-stable-decay, Hu et al. 2024); 'constant' stays at the peak.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    decay_steps = max(1, cfg.steps - cfg.warmup_steps - 1)
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * (cfg.steps - cfg.warmup_steps)) - 1)
        start = cfg.steps - 1 - decay_steps
        progress = min(1.0, max(0.0, (step - start) / decay_steps))
        return peak - (peak - floor) * progress
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
