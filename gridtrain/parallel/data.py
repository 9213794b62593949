"""Data parallelism: DDP, ZeRO-1, ZeRO-2, ZeRO-3/FSDP and HSDP, over the data-parallel mesh axes.

| zero_stage | held per rank | collectives per step (payload = gradient bytes G or parameter bytes P) |
|---|---|---|
| 0 (DDP) | everything | all-reduce of G over 'dp_replicate', bucketed and overlapped with backward |
| 1 | optimizer state / N | all-reduce of G, then the updated parameter shards are broadcast |
| 2 | gradients and optimizer state / N | reduce-scatter of G per micro-batch, all-gather of P before forward |
| 3 (FSDP) | also parameters / N | all-gather of P per block in forward and again in backward, reduce-scatter of G |

Stages 0 and 1 keep full copies on every data-parallel rank (dp_shard is 1, dp_replicate the
degree); 2 and 3 shard over 'dp_shard' and, when dp_replicate > 1, all-reduce the shards across
'dp_replicate' too (HSDP). With tensor parallelism, stage 0 is FSDP2 over a (dp_replicate, 1)
mesh, which replicates like DDP, since torch's DDP does not take DTensor parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from gridtrain.parallel.dims import Mesh


def dp_mesh(mesh: Mesh, dp_replicate: int) -> DeviceMesh:
    """The mesh FSDP shards over: 1-D 'dp_shard', or 2-D (replicate, shard) for HSDP."""
    return mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """fully_shard each transformer block, then the rest (embedding, norm, head) at the root.

    Each block's parameters are one all-gather and one reduce-scatter; FSDP2 prefetches the next
    block's all-gather while the current one computes (implicit forward and backward prefetch).
    """
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Composable DDP over the 1-D data-parallel mesh: gradients all-reduced in 25 MB buckets as
    backward produces them. Module and parameter names stay as they were."""
    # Buffers (the RoPE tables) are computed identically on every rank: no need to sync them
    # before every forward.
    replicate(model, device_mesh=mesh, bucket_cap_mb=25, forward_sync_buffers=False)


def apply_data_parallel(model: nn.Module, mesh: Mesh, zero_stage: int, dp_replicate: int,
                        tp: int) -> None:
    if zero_stage in (0, 1) and tp == 1:
        apply_ddp(model, mesh["dp_replicate"])
    elif zero_stage == 0:
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"], reshard_after_forward=False)
    else:
        apply_fsdp(model, dp_mesh(mesh, dp_replicate), reshard_after_forward=zero_stage == 3)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn the gradient reduction of the next backward on or off (off while accumulating, so
    DDP all-reduces each gradient byte once per optimizer step). FSDP stages 2 and 3 keep syncing:
    their reduce-scatter per micro-batch is what keeps the gradients sharded."""
    if isinstance(model, FSDPModule):
        return
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def build_zero1_optimizer(param_groups: list[dict], mesh: Mesh, **defaults: object) -> ZeroRedundancyOptimizer:
    """AdamW whose state is sharded over the data-parallel ranks: each rank updates the
    parameters it owns and broadcasts them (ZeRO stage 1)."""
    return ZeroRedundancyOptimizer(param_groups, optimizer_class=torch.optim.AdamW,
                                   process_group=mesh["dp_replicate"].get_group(), **defaults)
