"""The one ordered composition of everything applied to the single-device model from outside.

Order (torchtitan's): pipeline split, then per stage expert parallelism, float8 (the block linears swapped for
torchao's, `train.float8`), tensor parallel, activation checkpointing, compile, and data parallel
(FSDP/DDP) last, so FSDP shards what TP already split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from gridtrain.config import Config
from gridtrain.layout.dims import ParallelDims
from gridtrain.layout.experts import experts_fsdp_sharded
from gridtrain.model.llama import Transformer
from gridtrain.parallel.materialize import is_meta, materialize
from gridtrain.parallel.mesh import Mesh, expert_fsdp_mesh

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from gridtrain.parallel.context_parallel import RingTraffic
    from gridtrain.parallel.pipeline_parallel import PipelineTraffic

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The dtype of matmuls per training precision: autocast's, and the one FSDP gathers parameters in
# (fp32 trains as stored).
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Selective recomputation keeps the outputs of the expensive ops (matmuls and attention) and
# recomputes the cheap, memory-hungry elementwise ones (norms, RoPE, SiLU x gate) in backward:
# most of full recomputation's memory saving at a fraction of its FLOPs (Korthikanti et al. 2022
# make the same trade at the level of the attention core).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


SELECTIVE_SAVE_OBSERVERS: list[Callable[[Any], None]] = []
"""Called with the outputs selective checkpointing keeps for backward, as the forward makes them
(the accounting counts them: they are held in checkpointing's own cache, where saved-tensor
hooks do not see them)."""


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    if func not in _SAVE_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        for observe in SELECTIVE_SAVE_OBSERVERS:
            observe(ctx.op_output)
    return CheckpointPolicy.MUST_SAVE


def _selective_context():  # noqa: ANN202 - a pair of context managers, as checkpoint expects
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_recompute(model: Transformer, mode: str) -> None:
    """Wrap each transformer block: 'full' recomputes the whole block, 'selective' the cheap ops.

    The wrapper keeps state-dict keys unchanged, so checkpoints are independent of this choice.
    """
    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
        model.layers[name] = wrapped


def apply_compile(model: Transformer) -> None:
    """Compile each block in place (names and state-dict keys unchanged); blocks share one graph."""
    for block in model.layers.values():
        block.compile(fullgraph=True)


@dataclass
class ParallelModel:
    """What one rank runs: its model parts (the whole model, or its pipeline stages) and, with
    pipeline parallelism, the schedule that drives them."""

    parts: list[nn.Module]
    stage_indices: list[int] = field(default_factory=lambda: [0])
    num_stages: int = 1
    schedule: PipelineScheduleSingle | PipelineScheduleMulti | None = None
    eval_schedule: PipelineScheduleMulti | None = None
    """What validation runs where the training schedule cannot run forward only (V shapes)."""
    traffic: PipelineTraffic | None = None
    ring_traffic: RingTraffic | None = None
    dry_ddp: dist.ProcessGroup | None = None
    """A dry run's DDP group: DDP cannot start on fake tensors (it checks their storage), so the
    dry run sums the gradients over it as DDP would (data_parallel.all_reduce_as_ddp)."""

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]


def _apply_float8_and_tp(part: nn.Module, cfg: Config, dims: ParallelDims | None, mesh: Mesh | None,
                         fsdp: bool, device: torch.device) -> None:
    """Float8's block linears (`train.float8`), then tensor parallelism: with 'tensorwise' scaling
    through torchao's float8 styles, which gather the block input in float8."""
    recipe, styles = cfg.train.float8, None
    if recipe != "none":
        from gridtrain.parallel.float8 import apply_float8, block_tp_styles

        apply_float8(part, recipe, device, fsdp)
        styles = block_tp_styles(recipe, device)
    if dims is not None and dims.tp > 1:
        from gridtrain.parallel.tensor_parallel import apply_tp

        apply_tp(part, mesh["tp"], cfg.parallel.sequence_parallel, styles)


def parallelize(model: Transformer, cfg: Config, dims: ParallelDims | None = None, mesh: Mesh | None = None,
                loss_fn: LossFn | None = None, n_microbatches: int = 1,
                device: torch.device | None = None, fake: FakeTensorMode | None = None) -> ParallelModel:
    """Apply, in order: pipeline split, float8, tensor parallel, activation checkpointing, compile, FSDP;
    then give the model memory (each rank its own shards, initialised from cfg.train.seed) if it
    is still on the meta device; then DDP, which needs real weights to start. `cfg` is the run's
    Config; without `dims` (a world of one) only recomputation and compile apply. With `fake`
    (a dry run), the shards are that mode's fake tensors."""
    p, t = cfg.parallel, cfg.train
    if dims is not None and dims.pp > 1:
        from gridtrain.parallel.pipeline_parallel import build_stages

        stages = build_stages(model, mesh["pp"], p.pp_virtual_stages, p.pp_schedule, p.pp_fewer_edge_layers)
    else:
        stages = [(0, model)]
    data_parallel = dims is not None and dims.dp * dims.cp > 1  # CP ranks sum their gradients too
    if data_parallel:
        from gridtrain.parallel.data_parallel import apply_data_parallel, uses_ddp

        ddp = uses_ddp(p.zero_stage, dims.tp, dims.pp, dims.ep)
    expert_mesh = None
    if dims is not None and experts_fsdp_sharded(dims, p.zero_stage):
        expert_mesh = mesh.experts(p.zero_stage)
    for _, part in stages:
        if dims is not None and dims.ep > 1:
            from gridtrain.parallel.expert_parallel import apply_expert_parallel

            apply_expert_parallel(part, mesh["dp_cp"] if expert_mesh is None else expert_mesh["ep"])
        _apply_float8_and_tp(part, cfg, dims, mesh, data_parallel and not ddp, device or torch.device("cpu"))
        apply_recompute(part, t.recompute)
        if t.compile:
            apply_compile(part)
        if data_parallel and not ddp:
            apply_data_parallel(part, mesh, p.zero_stage, dims.dp_replicate, dims.tp, dims.pp,
                                COMPUTE_DTYPES.get(t.precision), dims.ep,
                                expert_fsdp_mesh(expert_mesh))
    parts = [m for _, m in stages]
    if is_meta(parts):
        materialize(parts, model.args, t.seed, device or torch.device("cpu"), fake)
    result = ParallelModel(parts, [s for s, _ in stages])
    if data_parallel and ddp and fake is not None:
        result.dry_ddp = mesh["dp_replicate"].get_group()
    elif data_parallel and ddp:
        apply_data_parallel(model, mesh, p.zero_stage, dims.dp_replicate, dims.tp, dims.pp)
    if dims is not None and dims.cp > 1:
        from gridtrain.parallel.context_parallel import apply_context_parallel

        result.ring_traffic = apply_context_parallel(parts, mesh["cp"].get_group(), cfg.data.seq_len,
                                                     p.cp_rotate, device or torch.device("cpu"))
    if dims is not None and dims.pp > 1:
        from gridtrain.parallel.pipeline_parallel import PipelineTraffic, build_eval_schedule, build_schedule

        result.num_stages = dims.pp * p.pp_virtual_stages
        result.traffic = PipelineTraffic(stages, result.num_stages)
        result.schedule = build_schedule(stages, mesh["pp"], result.num_stages, p.pp_schedule,
                                         n_microbatches, loss_fn, device)
        result.eval_schedule = build_eval_schedule(result.schedule, dims.pp, p.pp_virtual_stages, p.pp_schedule)
    return result
