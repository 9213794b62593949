"""Gradient norm and clipping across every way a layout splits the parameters.

A gradient is a plain tensor (replicated: DDP, or TP-replicated norms) or a DTensor (sharded by
FSDP and/or TP). The squared norms of DTensor groups are reduced over their own meshes by DTensor
(an all-reduce of one scalar per mesh); plain gradients are complete on every rank and counted
once. With pipeline parallelism each stage holds different parameters, so the squared norm is
summed over the 'pp' axis (one all-reduce of a scalar).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def settle_partial_grads(params: list[torch.nn.Parameter]) -> None:
    """Reduce once the gradients DTensor leaves as partial sums (the norms' weights under sequence
    parallelism: each rank's sum over its part of the sequence), in place. Left partial, every
    later op that reads one (the norm, then each of AdamW's) all-reduced it again: three more
    times per step."""
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            p.grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl
                                                          for pl in grad.placements])


def total_grad_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of all gradients of the model, as one process would compute it."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for p in params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            by_mesh.setdefault((p.grad.device_mesh, p.grad.placements), []).append(p.grad)
        else:
            plain.append(p.grad)
    squares = torch.zeros((), dtype=torch.float32, device=params[0].device if params else "cpu")
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        squares = squares + norm.full_tensor().float() ** 2
    if plain:
        squares = squares + torch.nn.utils.get_total_norm(plain, foreach=True).float() ** 2
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm` (inf: report only): each by
    min(max_norm / (norm + 1e-6), 1), as torch.nn.utils.clip_grads_with_norm_ does. The factor is
    one number on every rank, so a DTensor's local shard is scaled in place, which is the same
    element by element as scaling the DTensor (the same bits) and skips DTensor's sharding
    propagation of a foreach op over every gradient, paid anew by every new layout: a launch of
    ten of the parity subset's 4-rank cases took 54.5 s instead of 61.3 s."""
    norm = total_grad_norm(params, pp_group)
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params
                     if p.grad is not None]
            by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for grad in local:
                by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
            for (device, _), grads in by_kind.items():
                torch._foreach_mul_(grads, coef.to(device))
    return norm
