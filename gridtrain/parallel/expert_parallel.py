"""Expert parallelism: each rank of the expert-parallel group holds E / ep of a layer's routed
experts, and tokens travel to their experts' ranks and back by all-to-all (GShard, Lepikhin et
al. 2021; as torchtitan and Megatron-core dispatch dropless MoE).

The ep ranks are borrowed from the data- and context-parallel ranks (they hold different tokens),
as in torchtitan and Megatron-core: ep divides dp x cp, and an ep group is ep consecutive ranks of
the flattened 'dp_cp' mesh (`gridtrain.layout.experts` draws the split). The experts are a DTensor
Shard(0) of the whole [E, ...] weight over the group, so a checkpoint holds each expert once, under
its own index, and resumes under any layout. An expert's gradient is whole on its ep rank: the
all-to-all's backward brings every rank of the group's share of it home. What happens to the
dp x cp / ep ranks left, which hold the same experts and route other tokens:
- none left (ep = dp x cp): FSDP handles every other weight and leaves the experts alone;
- ZeRO 2 and 3: each layer's experts are an FSDP unit of their own over the ranks left of
  dp_shard x cp ('edp_shard'), split on dimension 1 (ffn of w1 and w3, dim of w2), gathered before
  the layer's forward and backward and their gradients reduce-scattered, while replicated (HSDP) over
  the rest ('edp_replicate', dp_replicate's ranks among them), as the dense weights are;
- ZeRO 0: every copy whole, the gradients all-reduced over 'edp_replicate' (FSDP2 over
  (edp_replicate, 1), as the dense weights beside EP).
Tensor-parallel ranks of one data coordinate hold the same experts and route the same tokens
(tensor_parallel.moe_plan), each over its own group.

One MoE layer's forward on one rank (x: its tokens' assignments, sorted by global expert):
1. the counts per expert are exchanged (an all-to-all of E integers), so each rank knows how many
   rows it receives from each rank for each of its experts;
2. the rows travel to their experts' ranks (all-to-all, rank-major on arrival);
3. they are regrouped expert-major, run through the local experts, and put back rank-major;
4. they travel back (the reverse all-to-all) in the order they left.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from gridtrain.model.moe import GroupedExperts, experts_forward, moe_layers


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows whose backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def expert_major(received: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows arriving rank-major ((source rank, local expert) blocks of
    `received[s, e]` rows each) into expert-major order (expert by expert, source ranks in order
    within one), which the grouped matmul needs."""
    lengths = received.flatten()
    starts = (torch.cumsum(lengths, 0) - lengths).view_as(received)
    by_expert, sizes = starts.T.flatten(), received.T.flatten()
    first = torch.repeat_interleave(by_expert, sizes)
    offset = torch.arange(int(sizes.sum()), device=received.device)
    return first + offset - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)


class ExpertParallelExperts(nn.Module):
    """The routed experts of one MoE layer, sharded by expert over `mesh`: takes and returns the
    rows of this rank's assignments sorted by global expert, as `GroupedExperts` does."""

    def __init__(self, experts: GroupedExperts, mesh: DeviceMesh) -> None:
        super().__init__()
        self.grouped, self.mesh = experts.grouped, mesh
        self.group, self.ep = mesh.get_group(), mesh.size()
        for name in ("w1", "w2", "w3"):
            weight = getattr(experts, name)
            self.register_parameter(name, nn.Parameter(distribute_tensor(weight.data, mesh, [Shard(0)])))

    def exchange(self, counts: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        """The counts' all-to-all: (rows this rank sends to each rank, rows it receives from each,
        rows it receives per local expert, the expert-major order of the rows as they arrive)."""
        local = counts.numel() // self.ep
        in_splits = counts.view(self.ep, local).sum(dim=1).tolist()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank, local expert]
        received = received.view(self.ep, local)
        return in_splits, received.sum(dim=1).tolist(), received.sum(dim=0), expert_major(received)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        in_splits, out_splits, local_counts, order = self.exchange(counts)
        rows = _AllToAll.apply(x, out_splits, in_splits, self.group)
        weights = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)]
        out = experts_forward(rows[order], local_counts, *weights, self.grouped)
        out = torch.empty_like(out).index_copy(0, order, out)  # rank-major again
        return _AllToAll.apply(out, in_splits, out_splits, self.group)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every MoE layer's routed experts over `mesh` (the ep group: 'dp_cp', or the experts'
    mesh's 'ep') by expert, on the meta device or not; each forward then issues an all-to-all of E
    int64 counts and two of the assignments' rows (dim x the activations' bytes each) over it."""
    for _, layer in moe_layers(model):
        layer.experts = ExpertParallelExperts(layer.experts, mesh)


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """The expert-parallel experts of `model`, which data parallelism leaves alone."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
