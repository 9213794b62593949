"""What rank 0 prints at start-up: the model and the machine, and the run's units of one training
step (GPUs, nodes, TP groups, pipeline stages, model-parallel groups, data-parallel replicas,
micro-batch, accumulation, global batch, optimizer steps)."""

from __future__ import annotations

from dataclasses import asdict

import torch

from gridtrain.config import Config
from gridtrain.layout.dims import ParallelDims, stage_layer_counts
from gridtrain.layout.schedules import stage_ranks
from gridtrain.plan.app.render import render_units
from gridtrain.plan.budget import step_units
from gridtrain.train.device import device_name


def units_table(cfg: Config, dims: ParallelDims, num_nodes: int) -> str:
    """The units of one training step, counted and printed as the planner does for a plan
    (budget.step_units, render.render_units), then the layout's choices and, under a pipeline,
    each stage's layers."""
    p, t, seq = cfg.parallel, cfg.train, cfg.data.seq_len
    n_layers = cfg.model.args().n_layers
    units = step_units(dims.world_size, dims.world_size // num_nodes, dims.tp, dims.pp, n_layers, t.micro_batch, seq,
                       cfg.microbatches(dims.dp), t.steps * cfg.global_batch_seqs * seq, dims.cp)
    shown = asdict(units) | {"gpus_per_node": dims.world_size // num_nodes, "tp": dims.tp, "cp": dims.cp,
                             "pp": dims.pp, "micro_batch": t.micro_batch, "seq_len": seq,
                             "pp_virtual_stages": p.pp_virtual_stages}
    lines = render_units({"units": shown, "problem": {"accelerator": "process"}})
    lines.append(f"data parallelism dp_replicate={dims.dp_replicate} x dp_shard={dims.dp_shard}, ZeRO stage "
                 f"{p.zero_stage}; sequence parallel {'on' if p.sequence_parallel and dims.tp > 1 else 'off'}; "
                 f"pipeline schedule {p.pp_schedule if dims.pp > 1 else 'none'}")
    if dims.pp > 1:
        stages = dims.pp * p.pp_virtual_stages
        counts = stage_layer_counts(n_layers, stages, p.pp_fewer_edge_layers)
        ranks = stage_ranks(dims.pp, p.pp_virtual_stages, p.pp_schedule)
        starts = [sum(counts[:s]) for s in range(stages)]
        lines += [f"stage {s} (pp rank {ranks[s]}): layers {starts[s]}-{starts[s] + counts[s] - 1}"
                  for s in range(stages)]
    return "\n".join(lines)


def run_summary(cfg: Config, dims: ParallelDims, num_nodes: int, num_params: int, flops_per_token: float,
                train_tokens: int, device: torch.device, peak: float) -> str:
    """What rank 0 prints at start-up: the model, the device and precision, the units table."""
    a = cfg.model.args()
    return (f"model {cfg.model.preset}: {num_params / 1e6:.2f}M parameters, {a.n_layers} layers, "
            f"dim {a.dim}, {a.n_heads} heads / {a.n_kv_heads} KV, ffn {a.hidden_dim}, vocab "
            f"{a.vocab_size} | {flops_per_token / 1e6:.1f} MFLOP/token | "
            f"{train_tokens / 1e6:.1f}M tokens in the training split\n"
            f"device {device} ({device_name(device)}, {torch.get_num_threads()} threads), "
            f"precision {cfg.train.precision}, peak {peak / 1e12:.2f} TFLOP/s per process for MFU\n"
            + units_table(cfg, dims, num_nodes))
