"""What rank 0 prints at start-up: the model and the machine, and the run's units of one training
step (GPUs, nodes, TP groups, pipeline stages, model-parallel groups, data-parallel replicas,
micro-batch, accumulation, global batch, optimizer steps)."""

from __future__ import annotations

import torch

from gridtrain.config import Config
from gridtrain.layout.dims import ParallelDims, stage_layer_counts
from gridtrain.layout.schedules import stage_ranks
from gridtrain.train.device import device_name


def units_table(cfg: Config, dims: ParallelDims, num_nodes: int) -> str:
    """GPUs (processes), nodes, TP groups, pipeline stages and their layers, model-parallel
    groups, data-parallel replicas, micro-batch, accumulation, global batch, optimizer steps."""
    p, t = cfg.parallel, cfg.train
    n_layers = cfg.model.args().n_layers
    world = dims.world_size
    stages = dims.pp * p.pp_virtual_stages
    counts = stage_layer_counts(n_layers, stages, p.pp_fewer_edge_layers)
    ranks = stage_ranks(dims.pp, p.pp_virtual_stages, p.pp_schedule) if dims.pp > 1 else [0]
    start, layer_text = 0, []
    for s, c in enumerate(counts):
        layer_text.append(f"stage {s} (pp rank {ranks[s]}): layers {start}-{start + c - 1}")
        start += c
    global_seqs = cfg.global_batch_seqs
    micro_batches = global_seqs // (t.micro_batch * dims.dp)
    tokens = global_seqs * cfg.data.seq_len
    rows = [
        ("processes (GPUs)", f"{world}", "one rank each"),
        ("nodes", f"{num_nodes}", f"{world // num_nodes} processes per node"),
        ("tensor-parallel groups", f"{world // dims.tp}", f"{dims.tp} ranks each (tp={dims.tp})"
         + (", sequence parallel" if p.sequence_parallel else "")),
        ("pipeline stages", f"{stages}", f"pp={dims.pp} x {p.pp_virtual_stages} virtual, "
         f"schedule {p.pp_schedule if dims.pp > 1 else 'none'}"),
        ("model-parallel groups", f"{world // dims.model_parallel}", f"{dims.model_parallel} ranks each (tp x pp)"),
        ("data-parallel replicas", f"{dims.dp}", f"dp_replicate={dims.dp_replicate} x dp_shard="
         f"{dims.dp_shard}, ZeRO stage {p.zero_stage}"),
        ("micro-batch", f"{t.micro_batch}", f"sequences of {cfg.data.seq_len} tokens = "
         f"{t.micro_batch * cfg.data.seq_len:,} tokens"),
        ("accumulation steps", f"{micro_batches}", "micro-batches per replica per optimizer step"
         + (" (pipeline micro-batches)" if dims.pp > 1 else "")),
        ("global batch", f"{global_seqs}", f"sequences = {tokens:,} tokens "
         f"(micro {t.micro_batch} x accumulation {micro_batches} x data-parallel {dims.dp})"),
        ("optimizer steps", f"{t.steps}", f"{t.steps * tokens / 1e6:,.1f}M tokens in all"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"  {name:<{width}}  {count:>7}  {detail}" for name, count, detail in rows]
    if dims.pp > 1:
        lines += [f"  {'':<{width}}           {text}" for text in layer_text]
    return "units of this run:\n" + "\n".join(lines)


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
