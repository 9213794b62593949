"""Pipeline parallelism through `torch.distributed.pipelining`, over the 'pp' axis.

The model is cut into pp x pp_virtual_stages stages of consecutive layers (embedding on the first,
final norm and head on the last); each pipeline rank keeps its stages and drops the rest. Between
stages, one point-to-point send per micro-batch carries the B x T x dim activations forward (or
B x T/tp x dim with sequence parallelism), and the same size of gradient comes back.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import (FORWARD, PipelineScheduleMulti, PipelineScheduleSingle, _Action,
                                                    _add_send_recv, _add_unshard_reshard, _PipelineScheduleRuntime)

from gridtrain.layout.dims import stage_layer_counts
from gridtrain.layout.schedules import SCHEDULES, stage_ranks
from gridtrain.model.llama import Transformer
from gridtrain.model.moe import routing_uncounted


def stage_layer_ranges(n_layers: int, num_stages: int, fewer_edge_layers: int) -> list[range]:
    counts = stage_layer_counts(n_layers, num_stages, fewer_edge_layers)
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def split_stage(model: Transformer, layers: range, first: bool, last: bool) -> Transformer:
    """A copy of `model` that keeps only `layers` (with their global names), plus the embedding
    on the first stage and norm and head on the last."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if int(name) not in layers:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def local_stage_indices(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    return [s for s, r in enumerate(stage_ranks(pp, virtual, schedule)) if r == pp_rank]


def build_stages(model: Transformer, pp_mesh: DeviceMesh, virtual: int, schedule: str,
                 fewer_edge_layers: int) -> list[tuple[int, Transformer]]:
    """(stage index, stage module) for each stage this pipeline rank runs."""
    pp = pp_mesh.size()
    num_stages = pp * virtual
    ranges = stage_layer_ranges(model.args.n_layers, num_stages, fewer_edge_layers)
    mine = local_stage_indices(pp_mesh.get_local_rank(), pp, virtual, schedule)
    return [(s, split_stage(model, ranges[s], s == 0, s == num_stages - 1)) for s in mine]


class SplitBackwardStage(PipelineStage):
    """A PipelineStage whose split backward (zero-bubble schedules) also works under ZeRO-3.

    Zero-bubble schedules run each micro-batch's backward in two passes: gradients of the stage
    input first (I), of the weights later (W). Both passes find the weights through
    `submod.parameters()`. ZeRO-3 reshards a block after its forward, so at that moment the
    module holds its 1/N shards, not the gathered tensors autograd used: the I pass then finds no
    weight in the graph and the W pass never computes the weight gradients (torch 2.13; measured:
    gradient norm 0.04-0.10 where one process has 0.85). Gathering the stage's blocks first makes
    both passes see the parameters the graph used. It costs no memory that the stage would not
    spend anyway: under a pipeline the gathered parameters stay until the step's last backward
    (torch's stage turns resharding after backward off), and at most one all-gather per block
    where a forward in between resharded it.
    """

    def _forward_metadata_inference(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - torch >= 2.13
        """torch's forward that learns the stage's tensor shapes, at the first step: with grad on,
        on the first micro-batch (first stage) or on uninitialised tensors of the real shape (the
        others). A mixture of experts must not count its routing there (it moved the expert bias by
        a ghost micro-batch)."""
        with routing_uncounted(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _shape_inference(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - torch 2.11 and 2.12
        with routing_uncounted(self.submod):
            return super()._shape_inference(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type in ("input", "weight") and isinstance(self.submod, FSDPModule):
            for module in self.submod.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()
        if backward_type == "weight":
            bwd_kwargs = {**bwd_kwargs, "param_groups": merged_param_groups(bwd_kwargs["param_groups"])}
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def merged_param_groups(groups: list[dict] | None) -> list[dict] | None:
    """The weight pass's parameter groups as one: torch's `stage_backward_weight` calls
    `autograd.grad` once per group, one per weight of a block, and under full recomputation each
    call recomputes the checkpointed block again (a small block ran its attention 11 times a
    micro-batch, tests/test_split_backward.py). One call over every group's intermediates, each
    with the gradient the input pass saved for it, gives the same gradients bit for bit (torch
    clamps a group of several intermediates to their saved gradients, so none is counted twice
    through another) and recomputes each block once: 3 attention runs a micro-batch."""
    if groups is None or len(groups) <= 1:
        return groups
    intermediates, grads, params, seen_nodes, seen_params = [], [], [], set(), set()
    for group in groups:
        for node, grad in zip(group["intermediates"], group["grads"]):
            if node not in seen_nodes:
                seen_nodes.add(node)
                intermediates.append(node)
                grads.append(grad)
        params += [p for p in group["params"] if p not in seen_params]
        seen_params.update(group["params"])
    return [{"params": params, "intermediates": intermediates, "grads": grads}]


def build_schedule(stages: list[tuple[int, nn.Module]], pp_mesh: DeviceMesh, num_stages: int,
                   schedule: str, n_microbatches: int, loss_fn: Callable, device: torch.device
                   ) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The schedule over this rank's stages. `loss_fn` already divides each micro-batch's loss
    by the micro-batches of the global batch, so the schedule sums the gradients (scale_grads off)."""
    group = pp_mesh.get_group()
    pipeline_stages = [SplitBackwardStage(module, index, num_stages, device, group=group)
                       for index, module in stages]
    cls = getattr(torch_schedules, SCHEDULES[schedule].torch_class)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(pipeline_stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


class ForwardOnly(_PipelineScheduleRuntime):
    """Validation over the stages of a V-shape schedule (zbv, dualpipev), forward only.

    torch 2.13's runtime runs those schedules' backward actions in `eval()` too, and fails on the
    first one ("can't steal_bwd_input if this stage doesn't have backward"), so every run that
    validated under them crashed. This runs the same stages with forward actions alone: on each
    rank its stages in order, all micro-batches of one before the next (activations go forward
    only, so nothing waits on a later stage); the runtime adds the sends and receives, and FSDP's
    unshard and reshard."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable,
                 placement: list[int]) -> None:
        super().__init__(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        # What _prepare_schedule_with_comms does, without its check that wants a backward per forward.
        self.stage_index_to_group_rank = dict(enumerate(placement))
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        forward = {rank: _add_unshard_reshard([_Action(stage, FORWARD, mb) for stage, owner in enumerate(placement)
                                               if owner == rank for mb in range(n_microbatches)])
                   for rank in sorted(set(placement))}
        self.pipeline_order_with_comms = _add_send_recv(forward, stage_to_rank=self.stage_index_to_group_rank.get,
                                                        num_stages=self._num_stages)


def build_eval_schedule(train: PipelineScheduleSingle | PipelineScheduleMulti, pp: int, virtual: int,
                        schedule: str) -> ForwardOnly | None:
    """The schedule validation runs: a ForwardOnly over the training schedule's stages for the
    V-shape schedules, None (the training schedule's own eval) for the others."""
    if not SCHEDULES[schedule].v_shape:
        return None
    return ForwardOnly(train._stages, train._n_microbatches, train._loss_fn, stage_ranks(pp, virtual, schedule))


class PipelineTraffic:
    """Bytes this rank sends to its pipeline neighbours, observed on the stage modules: each
    forward of a stage that is not the last sends its output; each backward of a stage that is
    not the first sends the gradient of its input, the size of that input. (Point-to-point ops
    are not in gloo's flight recorder, so they are counted here.) The first step also counts the
    schedule's one-off shape-inference pass over one micro-batch."""

    def __init__(self, stages: list[tuple[int, nn.Module]], num_stages: int) -> None:
        self.send_bytes = 0
        self.sends = 0
        for index, module in stages:
            module.register_forward_hook(self._hook(first=index == 0, last=index == num_stages - 1))

    def _hook(self, first: bool, last: bool) -> Callable:
        def count(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not last:
                self.send_bytes += _local_nbytes(output)
                self.sends += 1
            if not first and torch.is_grad_enabled():
                self.send_bytes += _local_nbytes(args[0])
                self.sends += 1
        return count


def _local_nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()
