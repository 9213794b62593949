"""Once per optimizer step, for a mixture-of-experts model: the expert load of the whole global
batch (every micro-batch, every data-parallel rank), the expert bias moved by it (DeepSeek-V3's
auxiliary-loss-free balance, Wang et al. 2024), and the step's MoE metrics.

The MoE layers count their routing as they run (gridtrain.model.moe); this sums the counts over
the data-parallel (and context-parallel) ranks, so every rank moves its bias by the same global
counts and the biases stay equal, then zeroes the counters for the next step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gridtrain.model.moe import MoE, moe_layers


def set_loss_scale(parts: list[nn.Module], scale: float) -> None:
    """The factor each micro-batch's loss is multiplied by before its backward (1 / the global
    batch's loss shares, times fp16's loss scale): the balance losses' gradients take it too."""
    for part in parts:
        for _, layer in moe_layers(part):
            layer.loss_scale = scale


def reset_routing(parts: list[nn.Module]) -> None:
    """Zero the MoE layers' counters of the step's routing (after it is read, or when a step is run
    again: its first attempt's routing must not count)."""
    for part in parts:
        for _, layer in moe_layers(part):
            _zero_counters(layer)


def _zero_counters(layer: MoE) -> None:
    for buffer in (layer.tokens_per_expert, layer.dropped, layer.balance_losses):
        buffer.zero_()


def balance_step(parts: list[nn.Module], groups: list[dist.ProcessGroup], shares: int, stepped: bool,
                 n_layers: int, pp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Sum the step's routing over `groups` (data and context parallelism), move the expert biases
    if the optimizer stepped, zero the counters; returns the metrics of the whole model (gathered
    over the pipeline stages through `pp_group`, one all-reduce of 3 numbers per layer of the
    model's `n_layers` and 2): per MoE layer the load (max / mean tokens per expert), and over all,
    the largest load, the fraction of assignments dropped by capacity and the balance losses (summed
    over layers, mean over the micro-batches of the global batch: their sum over the ranks divided
    by `shares`, the micro-batches times the context-parallel degree, since each context-parallel
    rank holds its micro-batch's whole auxiliary loss and a 1 / cp part of its z-loss)."""
    layers = [(name, layer) for part in parts for name, layer in moe_layers(part)]
    table = metrics_table(parts, n_layers)
    if layers:
        counts, losses = reduce_routing(layers, groups)
        for (name, layer), row in zip(layers, counts):
            _zero_counters(layer)  # read into counts and losses
            load = row[:-1].double()
            if stepped:
                _move_bias(layer, load)
            i = _layer_index(name)
            table[3 * i:3 * i + 3] = torch.stack([load.max() / load.mean() if load.sum() > 0 else load.sum(),
                                                  row[-1].double(), load.sum()])
        table[-2:] = losses.sum(dim=0).double()
    if pp_group is not None:
        dist.all_reduce(table, group=pp_group)
    rows = table[:-2].view(n_layers, 3)
    metrics = {f"moe/load/layer{i}": float(rows[i, 0]) for i in range(n_layers) if rows[i, 2] > 0}
    assigned = float(rows[:, 2].sum())
    metrics["moe/load_max"] = max(metrics.values(), default=0.0)
    metrics["moe/dropped_frac"] = float(rows[:, 1].sum()) / assigned if assigned else 0.0
    metrics["moe/aux_loss"] = float(table[-2]) / shares
    metrics["moe/z_loss"] = float(table[-1]) / shares
    return metrics


def metrics_table(parts: list[nn.Module], n_layers: int) -> torch.Tensor:
    """Per layer of the model (load, dropped, assigned), then the two losses: a stage fills its rows."""
    device = next(p for part in parts for p in part.parameters()).device
    return torch.zeros(3 * n_layers + 2, dtype=torch.float64, device=device)


def reduce_routing(layers: list[tuple[str, MoE]], groups: list[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's counts (exact integers: layers x (experts + 1), the last column the dropped
    assignments) and losses (layers x 2) of this rank's MoE layers, summed over `groups`."""
    counts = torch.stack([torch.cat([layer.tokens_per_expert, layer.dropped.view(1)]) for _, layer in layers])
    losses = torch.stack([layer.balance_losses for _, layer in layers])
    for group in groups:
        dist.all_reduce(counts, group=group)
        dist.all_reduce(losses, group=group)
    return counts, losses


def _move_bias(layer: MoE, load: torch.Tensor) -> None:
    """b_i += gamma * sign(mean load - load_i): an overloaded expert is chosen less next step."""
    if layer.args.balance != "bias":
        return
    with torch.no_grad():
        step = layer.args.bias_update_rate * torch.sign(load.mean() - load)
        layer.expert_bias += step.to(layer.expert_bias.dtype)


def _layer_index(module_name: str) -> int:
    """'layers.3.moe' -> 3 (a pipeline stage's module names keep the global index)."""
    parts = module_name.split(".")
    return int(parts[parts.index("layers") + 1])
