"""Routing for a dry run of a mixture of experts: fake tensors carry shapes, not values, so the
router's choices (and every size that depends on them: rows per expert, the all-to-alls' splits)
cannot be read. A dry run routes instead by a fixed, perfectly balanced rule: assignment j of token
i goes to expert (i k + j) mod E, so expert e gets floor(N k / E) assignments, one more for the
first N k mod E experts, on every rank alike. Sizes are then known in Python: the counts become
real tensors a fake forward can read, and an expert-parallel rank receives from each rank the
counts of its own experts. The step runs the real code around them (router, dispatch, all-to-alls,
experts, combine, balance all-reduces), so its accounting is a real run's under uniform routing,
which is what `gridtrain plan` predicts for one rank, to the byte where E divides N k; otherwise
the ranks holding the first experts receive their extra rows (tests/test_plan_check_moe.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from gridtrain.model.moe import MoE, moe_layers
from gridtrain.parallel.expert_parallel import ExpertParallelExperts
from gridtrain.train.balance import metrics_table, reduce_routing


def balanced_counts(assignments: int, experts: int) -> list[int]:
    """Assignments per expert under the rule above."""
    return [assignments // experts + (e < assignments % experts) for e in range(experts)]


def _real(values: list[int]) -> torch.Tensor:
    with unset_fake_temporarily():
        return torch.tensor(values, dtype=torch.long)


def fixed_routing(layer: MoE):  # noqa: ANN201 - a closure, as MoE.fixed_routing takes
    args = layer.args

    def route(tokens: int) -> tuple[torch.Tensor, ...]:
        counts = balanced_counts(tokens * args.top_k, args.num_experts)
        capacity = args.capacity(tokens)
        kept = counts if capacity is None else [min(c, capacity) for c in counts]
        experts = (torch.arange(tokens * args.top_k) % args.num_experts).view(tokens, args.top_k)
        order = torch.arange(sum(kept))  # any indices of kept assignments: their values are never read
        return experts, order, _real(kept), _real(counts)

    return route


def fixed_exchange(module: ExpertParallelExperts):  # noqa: ANN201 - replaces the module's exchange
    """The counts' all-to-all, made (and accounted) as in a real step, with what every rank sends
    known: each rank's counts are alike, so rank r receives from each rank its own experts' counts."""
    me = module.mesh.get_local_rank()

    def exchange(counts: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        dist.all_to_all_single(torch.empty_like(counts), counts, group=module.group)
        values = counts.tolist()
        local = len(values) // module.ep
        in_splits = [sum(values[r * local:(r + 1) * local]) for r in range(module.ep)]
        mine = values[me * local:(me + 1) * local]
        out_splits = [sum(mine)] * module.ep
        return in_splits, out_splits, _real([module.ep * c for c in mine]), torch.arange(sum(out_splits))

    return exchange


def fix_routing(parts: list[nn.Module]) -> None:
    """Route every MoE layer of `parts` by the fixed rule, and exchange its counts accordingly."""
    for part in parts:
        for _, layer in moe_layers(part):
            layer.fixed_routing = fixed_routing(layer)
            if isinstance(layer.experts, ExpertParallelExperts):
                layer.experts.exchange = fixed_exchange(layer.experts)


def balance_collectives(parts: list[nn.Module], groups: list[dist.ProcessGroup], n_layers: int,
                        pp_group: dist.ProcessGroup | None) -> None:
    """The balance step's all-reduces (train/balance.py), whose values a fake step cannot read."""
    layers = [(name, layer) for part in parts for name, layer in moe_layers(part)]
    if layers:
        reduce_routing(layers, groups)
    if pp_group is not None:
        dist.all_reduce(metrics_table(parts, n_layers), group=pp_group)
