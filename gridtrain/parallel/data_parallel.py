"""Data parallelism: DDP, ZeRO-1, ZeRO-2, ZeRO-3/FSDP and HSDP, over the data-parallel mesh axes.

| zero_stage | held per rank | collectives per step (payload = gradient bytes G or parameter bytes P) |
|---|---|---|
| 0 (DDP) | everything | all-reduce of G over 'dp_replicate', bucketed and overlapped with backward |
| 1 | optimizer state / N | all-reduce of G, then the updated parameter shards are broadcast |
| 2 | gradients and optimizer state / N | reduce-scatter of G per micro-batch, all-gather of P before forward |
| 3 (FSDP) | also parameters / N | all-gather of P per block in forward and again in backward, reduce-scatter of G |

Every variant sums the gradients over the data-parallel ranks rather than averaging them: the
trainer divides each micro-batch's loss by the number of micro-batches in the global batch, so
each backward runs at the scale one process gives it (with fp16, the same values overflow) and
the sum is the gradient of the global batch's mean loss.

Stages 0 and 1 keep full copies on every data-parallel rank (dp_shard is 1, dp_replicate the
degree); 2 and 3 shard over 'dp_shard' (under context parallelism 'dp_shard_cp', dp_shard x cp)
and, when dp_replicate > 1, all-reduce the shards across 'dp_replicate' too (HSDP). With tensor or
pipeline parallelism, stage 0 is FSDP2 over a (dp_replicate, 1) mesh, which replicates like DDP:
torch's DDP does not take DTensor parameters, and a pipeline stage drives the gradient sync of FSDP
modules (once per step, after the last micro-batch) but not that of composable `replicate` (under PP
2 x DDP 2 the two copies of stage 0 drifted apart within 4 steps).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import Shard

from gridtrain.parallel.expert_parallel import expert_parallel_modules
from gridtrain.parallel.mesh import Mesh


def dp_mesh(mesh: Mesh, dp_replicate: int) -> DeviceMesh:
    """The mesh FSDP shards over: 1-D 'dp_shard', or 2-D (replicate, shard) for HSDP; under
    context parallelism 'dp_shard_cp' (dp_shard x cp flattened: the CP ranks of a batch slice
    hold the same weights, and each one's gradient is a part of the slice's)."""
    shard = "dp_shard_cp" if mesh.dims.cp > 1 else "dp_shard"
    return mesh["dp_replicate", shard] if dp_replicate > 1 else mesh[shard]


def mixed_precision(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP's precision for bf16 and fp16 training: gather the parameters in the training dtype
    (half the bytes of fp32) and reduce gradients in fp32 (sums of many low-precision gradients
    lose bits), as torchtitan does. The fp32 shards stay the master weights the optimizer updates.

    Forward inputs are not cast: the residual stream stays fp32, as it does under autocast in one
    process (the model keeps it so); autocast still runs each matmul in the training dtype.
    """
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool,
               param_dtype: torch.dtype | None = None, expert_mesh: DeviceMesh | None = None) -> None:
    """fully_shard the embedding, each transformer block, and the final norm with the head, each
    a unit of its own (as torchtitan does), then the model as the root.

    Each unit's parameters are one all-gather (in `param_dtype`, fp32 when None) and one
    reduce-scatter (fp32); FSDP2 prefetches the next unit's all-gather while the current one
    computes (implicit forward and backward prefetch). As units of their own, the embedding and
    the head are gathered only while they compute (the embedding not at all in backward, which
    needs only the token ids), and the head's gradient is reduce-scattered as soon as it is
    computed, not at the end of backward. A tied head is the embedding's parameter: the two then
    stay in the root unit.

    Expert-parallel experts: with `expert_mesh` (edp_replicate, edp_shard), the ranks that hold
    the same experts, each layer's experts are a unit of their own over it, sharded on dimension 1
    (`gridtrain.layout.experts`); without it ep spans every data-parallel rank, each expert's
    gradient is whole on its rank, and FSDP leaves the experts alone.
    """
    policy = mixed_precision(param_dtype)
    experts = expert_parallel_modules(model)
    ignored = {p for m in experts for p in m.parameters()} if expert_mesh is None else set()
    embedding, head = model.tok_embeddings, [m for m in (model.norm, model.output) if m is not None]
    tied = embedding is not None and model.output is not None and model.output.weight is embedding.weight
    if embedding is not None and not tied:
        fully_shard(embedding, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        embedding.set_unshard_in_backward(False)  # its backward reads the token ids, not the table
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(blocks) - 1
        if expert_mesh is not None:
            for unit in (m for m in block.modules() if m in experts):
                fully_shard(unit, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=policy,
                            shard_placement_fn=lambda _: Shard(1))
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                    ignored_params=ignored or None)
    if head and not tied:  # needed again at once by backward, like the last block
        fully_shard(head, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                ignored_params=ignored or None)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # sum, do not average: see the module docstring
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Composable DDP over the 1-D data-parallel mesh: gradients all-reduced in 25 MB buckets as
    backward produces them. Module and parameter names stay as they were."""
    # Buffers (the RoPE tables) are computed identically on every rank: no need to sync them
    # before every forward.
    replicate(model, device_mesh=mesh, bucket_cap_mb=25, forward_sync_buffers=False)
    model.register_comm_hook(mesh.get_group(), sum_gradients)


DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 1 << 20, 25 << 20
"""DDP's buckets: the first 1 MiB (torch's dist._DEFAULT_FIRST_BUCKET_BYTES), the rest bucket_cap_mb."""


def all_reduce_as_ddp(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """What DDP's reducer does in a backward that syncs, for a dry run, where DDP itself cannot
    start: every gradient summed over `group` once, in buckets filled in reverse parameter order
    (the order backward produces them). The bytes are DDP's; its bucket boundaries, which follow
    the order gradients become ready, may differ."""
    buckets: list[list[torch.Tensor]] = [[]]
    size, cap = 0, DDP_FIRST_BUCKET_BYTES
    for p in reversed(params):
        if p.grad is None:
            continue
        if size and size + p.grad.nbytes > cap:
            buckets.append([])
            size, cap = 0, DDP_BUCKET_BYTES
        buckets[-1].append(p.grad)
        size += p.grad.nbytes
    for grads in buckets:
        if grads:
            dist.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group=group)


def sum_gradients(group, bucket):  # noqa: ANN001, ANN201 - DDP compares real annotations at runtime
    """DDP communication hook (ProcessGroup, GradBucket) -> Future[Tensor]: all-reduce a bucket of
    gradients as a sum (DDP's default divides by the group size; the trainer has divided each
    micro-batch's loss already)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def uses_ddp(zero_stage: int, tp: int, pp: int, ep: int = 1) -> bool:
    """Whether data parallelism is DDP (applied to real weights: it broadcasts them at start) or
    FSDP (applied on the meta device, before each rank allocates its shards). Beside expert
    parallelism, stage 0 is FSDP2 over (dp_replicate, 1) too: composable DDP turns every DTensor
    parameter into its local tensor at its first forward, the experts' included (their checkpoint
    would then lose which experts each rank holds)."""
    return zero_stage in (0, 1) and tp == 1 and pp == 1 and ep == 1


def apply_data_parallel(model: nn.Module, mesh: Mesh, zero_stage: int, dp_replicate: int,
                        tp: int, pp: int, param_dtype: torch.dtype | None = None, ep: int = 1,
                        expert_mesh: DeviceMesh | None = None) -> None:
    """DDP, ZeRO-1/2/3 or HSDP over the data-parallel axes; `param_dtype` is the training
    precision's (bf16, fp16) in which FSDP gathers parameters, None for fp32; `expert_mesh` the
    experts' (edp_replicate, edp_shard) mesh when ep leaves data-parallel ranks over (apply_fsdp)."""
    if uses_ddp(zero_stage, tp, pp, ep):
        apply_ddp(model, mesh["dp_replicate"])
    elif zero_stage == 0:
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"], reshard_after_forward=False, param_dtype=param_dtype,
                   expert_mesh=expert_mesh)
    else:
        apply_fsdp(model, dp_mesh(mesh, dp_replicate), reshard_after_forward=zero_stage == 3,
                   param_dtype=param_dtype, expert_mesh=expert_mesh)


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
