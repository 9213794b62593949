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


def balance_step(parts: list[nn.Module], groups: list[dist.ProcessGroup], shares: int,
                 stepped: bool) -> dict[str, float]:
    """Sum the step's routing over `groups` (data and context parallelism), move the expert biases
    if the optimizer stepped, zero the counters; returns the metrics: per MoE layer the load
    (max / mean tokens per expert), and over all, the largest load, the fraction of assignments
    dropped by capacity and the balance losses (summed over layers, mean over the micro-batches of
    the global batch: their sum over the ranks divided by `shares`, the micro-batches times the
    context-parallel degree, since each context-parallel rank holds its micro-batch's whole
    auxiliary loss and a 1 / cp part of its z-loss)."""
    layers = [(name, layer) for part in parts for name, layer in moe_layers(part)]
    if not layers:
        return {}
    # Exact integers: (layers, experts + 1), the last column the dropped assignments.
    counts = torch.stack([torch.cat([layer.tokens_per_expert, layer.dropped.view(1)]) for _, layer in layers])
    losses = torch.stack([layer.balance_losses for _, layer in layers])
    for group in groups:
        dist.all_reduce(counts, group=group)
        dist.all_reduce(losses, group=group)
    loads, dropped = counts[:, :-1].double(), counts[:, -1]
    metrics: dict[str, float] = {}
    for (name, layer), load in zip(layers, loads):
        if stepped:
            _move_bias(layer, load)
        metrics[f"moe/load/{_layer_name(name)}"] = float(load.max() / load.mean()) if load.sum() > 0 else 0.0
        for buffer in (layer.tokens_per_expert, layer.dropped, layer.balance_losses):
            buffer.zero_()
    assigned = float(loads.sum())
    metrics["moe/load_max"] = max(metrics.values())
    metrics["moe/dropped_frac"] = float(dropped.sum()) / assigned if assigned else 0.0
    metrics["moe/aux_loss"] = float(losses[:, 0].sum()) / shares
    metrics["moe/z_loss"] = float(losses[:, 1].sum()) / shares
    return metrics


def _move_bias(layer: MoE, load: torch.Tensor) -> None:
    """b_i += gamma * sign(mean load - load_i): an overloaded expert is chosen less next step."""
    if layer.args.balance != "bias":
        return
    with torch.no_grad():
        step = layer.args.bias_update_rate * torch.sign(load.mean() - load)
        layer.expert_bias += step.to(layer.expert_bias.dtype)


def _layer_name(module_name: str) -> str:
    """'layers.3.moe' -> 'layer3' (a pipeline stage's module names keep the global index)."""
    parts = module_name.split(".")
    return f"layer{parts[parts.index('layers') + 1]}" if "layers" in parts else module_name
