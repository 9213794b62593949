"""Predicted step time of a gridtrain run on the calibrated local machine (CPU ranks over gloo),
for `gridtrain plan --check`: the same decomposition as the cluster model (steptime.py), with the
constants `gridtrain calibrate` measured on this machine instead of a data sheet's.

One optimizer step on one rank:

    step = contention x (m + bubble) x t_mb + collectives + optimizer
    t_mb = matmul FLOPs / (matmul peak x matmul share) + attention FLOPs / attention rate
           + saved-activation bytes x HBM_PASSES / (memory bandwidth x elementwise share)
           + layers x framework time per layer (and tensor parallelism's host time per layer)

- matmul FLOPs: 6 x the rank's matmul parameters x tokens per micro-batch (8 x with full
  recomputation; selective recomputation rebuilds only elementwise work); TP divides them;
- attention: counted in full (no causal halving), 3 x 4 s^2 d per head, at the rate measured for
  causal SDPA forward + backward (a CPU's attention kernel runs far below its matmul peak); under
  data.doc_mask s^2 becomes s x the attention span (plan/documents.py), at the same rate (the
  blockwise document kernel's own rate is not calibrated);
- the rates are calibrate's at the run's shape (train/calibrate_kernels.py, the same as
  `plan --gpu local`'s): attention at its head size and sequence, the linear layers at its width
  (CPU_MATMUL of the peak in an older calibration), elementwise work at the share of the
  bandwidth a real block's reached;
- memory-bound work: the census of saved activations (check_run.microbatch_activations),
  each byte passed HBM_PASSES times at the measured bandwidth of an elementwise add;
- framework time: calibrate's time per layer per micro-batch of a block too small to compute,
  with what the run's recomputation mode adds;
- bubble: GPipe and 1F1B idle p - 1 micro-batch slots per step;
- collectives: the predicted bytes per collective (run_collectives.predict_collectives), a ring all-reduce
  moving 2(N-1)/N of its payload and an all-gather (N-1)/N, at the bus bandwidth measured
  between two gloo ranks, not overlapped: on a CPU, gloo's threads compete with compute; and
  FSDP's host time per collective call (train/calibrate_gloo.py) for each call a step issues
  (dptime.fsdp_calls);
- contention: ranks x threads beyond the machine's cores share them;
- optimizer: AdamW in fp32 streams 28 bytes per local parameter (gradient read, parameter and both
  moments read and written).
Left out: data loading, logging, the latency of each collective (calibrate measures it, but the
count of collectives per step is not modelled), and collectives whose bytes are not modelled
(the row says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gridtrain.config import Config
from gridtrain.layout.dims import ParallelDims, stage_layer_counts
from gridtrain.model.args import ModelArgs
from gridtrain.plan.dptime import fsdp_calls
from gridtrain.plan.run_collectives import run_layout
from gridtrain.plan.steptime import HBM_PASSES

CPU_MATMUL = 0.85
"""Fraction of the calibrated matmul peak that a model's matmuls reach on a CPU (bench_step.py
--profile: 846 of 950 GFLOP/s, 0.89, on the 26M shape in bf16; smaller shapes reach less)."""
ADAMW_BYTES = 28


def log_interpolate(grid: dict[int, float], x: float) -> float:
    """`grid` (size -> value) at `x`, linear in log size between the two sizes around it, the
    nearest beyond them."""
    sizes = sorted(grid)
    if x <= sizes[0] or x >= sizes[-1]:
        return grid[sizes[0] if x <= sizes[0] else sizes[-1]]
    low, high = max(d for d in sizes if d <= x), min(d for d in sizes if d >= x)
    if low == high:
        return grid[low]
    t = (math.log(x) - math.log(low)) / (math.log(high) - math.log(low))
    return grid[low] + t * (grid[high] - grid[low])


def attention_rate(entry: dict, mode: str, head_dim: int | None, seq_len: int | None = None) -> float | None:
    """The calibrated attention rate at the model's head size and sequence length: interpolated in
    log size over the grid calibrate timed (attention_flops_by_shape: head size x sequence); an
    older calibration's rate by head size alone, or its one rate, without it; None without any."""
    by_shape = entry.get("attention_flops_by_shape", {}).get(mode, {})
    if by_shape and head_dim is not None and seq_len is not None:
        per_dim = {int(d): log_interpolate({int(s): r for s, r in seqs.items()}, seq_len)
                   for d, seqs in by_shape.items()}
        return log_interpolate(per_dim, head_dim)
    grid = {int(d): r for d, r in entry.get("attention_flops_by_head_dim", {}).get(mode, {}).items()}
    if not grid or head_dim is None:
        return entry.get("attention_flops", {}).get(mode)
    return log_interpolate(grid, head_dim)


def matmul_share(entry: dict, mode: str, dim: int | None) -> float:
    """The fraction of the matmul peak a block's linear layers reach at the model's width (calibrate's
    matmul_flops_by_dim, interpolated in log width); CPU_MATMUL without it."""
    grid = {int(d): r for d, r in entry.get("matmul_flops_by_dim", {}).get(mode, {}).items()}
    if not grid or dim is None:
        return CPU_MATMUL
    return min(1.0, log_interpolate(grid, dim) / entry["peak_flops"][mode])


@dataclass(frozen=True)
class LocalMachine:
    matmul_flops: float
    attention_flops: float
    memory_bytes_per_s: float
    gloo_bytes_per_s: float
    cores: int
    matmul_share: float = CPU_MATMUL
    """The share of the peak a block's linear layers reach at the model's width (calibrate_kernels)."""
    elementwise_share: float = 1.0
    """The share of the memory bandwidth the elementwise work reaches (calibrate_kernels)."""
    layer_overhead_s: float = 0.0
    """The framework's own time per layer per micro-batch (op dispatch, autograd, autocast)."""
    recompute_overhead_s: tuple[tuple[str, float], ...] = ()
    """What each recomputation mode's checkpoint machinery adds to it."""
    fsdp_call_s: float = 0.0
    """FSDP's host time per collective call beyond its bytes (train/calibrate_gloo.py)."""
    tp_block_s: float = 0.0
    """Tensor parallelism's host time per layer per micro-batch (train/calibrate_gloo.py)."""

    @classmethod
    def from_calibration(cls, entry: dict, precision: str, cores: int, args: ModelArgs | None = None,
                         seq_len: int | None = None) -> LocalMachine:
        """The calibrated rates, at the shape of model `args` at `seq_len` where the calibration has
        them by shape (plan/local.py: attention by head size and sequence, matmuls by width)."""
        peak = entry["peak_flops"][precision]
        head_dim, dim = (args.head_dim, args.dim) if args is not None else (None, None)
        attention = attention_rate(entry, precision, head_dim, seq_len) or peak
        return cls(peak, attention, entry["memory_bytes_per_s"], entry["gloo_bytes_per_s"], cores,
                   matmul_share(entry, precision, dim), entry.get("elementwise_share", {}).get(precision, 1.0),
                   entry.get("layer_overhead_s", 0.0), tuple(sorted(entry.get("recompute_overhead_s", {}).items())),
                   entry.get("fsdp_call_s", 0.0), entry.get("tp_block_s", 0.0))


@dataclass(frozen=True)
class LocalStep:
    compute_s: float
    bubble_s: float
    comm_s: float
    """NaN when the layout's collectives are not modelled."""
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s + self.optimizer_s


def microbatch_seconds(args: ModelArgs, dims: ParallelDims, cfg: Config, machine: LocalMachine,
                       layers: int, last: bool, activation_bytes: float, span: float | None = None) -> float:
    """One micro-batch's forward and backward on one rank holding `layers` blocks; `span`: the keys a
    query attends to under data.doc_mask (plan/documents.py), None: the whole sequence."""
    seq, mb, recompute = cfg.data.seq_len, cfg.train.micro_batch, cfg.train.recompute
    # Under CP a rank computes its seq/cp tokens, each attending to the whole sequence.
    tokens, h, kv = seq * mb // dims.cp, args.dim, args.n_kv_heads * args.head_dim
    q = args.n_heads * args.head_dim  # h unless the heads are wider (Qwen3)
    block_matmul = h * (2 * q + 2 * kv) + 3 * h * args.hidden_dim
    factor = 8 if recompute == "full" else 6
    matmul = factor * tokens * (layers * block_matmul + (args.vocab_size * h if last else 0)) / dims.tp
    keys = seq if span is None else span
    attention = (4 if recompute == "full" else 3) * 4 * tokens * keys * q * layers / dims.tp
    framework = layers * (machine.layer_overhead_s + dict(machine.recompute_overhead_s).get(recompute, 0.0)
                          + (machine.tp_block_s if dims.tp > 1 else 0.0))
    return (matmul / (machine.matmul_flops * machine.matmul_share) + attention / machine.attention_flops
            + activation_bytes * HBM_PASSES / (machine.memory_bytes_per_s * machine.elementwise_share) + framework)


def axis_size(dims: ParallelDims, axis: str) -> int:
    """Ranks of a mesh axis as the accounting names them: the mesh's own, 'dp_shard_cp' (FSDP's
    dp_shard x cp under CP) and 'world'."""
    if axis == "dp_shard_cp":
        return dims.dp_shard * dims.cp
    return dims.world_size if axis == "world" else getattr(dims, axis)


def collective_seconds(collectives: dict[str, float], dims: ParallelDims, machine: LocalMachine) -> float:
    """Wire time of the predicted collectives ('axis/op_bytes' -> payload bytes per step)."""
    if dims.world_size == 1:
        return 0.0
    if not collectives:
        return float("nan")
    total = 0.0
    for key, payload in collectives.items():
        axis, op = key.split("/")
        n = axis_size(dims, axis)
        share = {"all_reduce_bytes": 2 * (n - 1) / n, "all_gather_bytes": (n - 1) / n}.get(op, 1.0)
        total += payload * share / machine.gloo_bytes_per_s
    return total


def local_step(args: ModelArgs, dims: ParallelDims, cfg: Config, machine: LocalMachine, pp_rank: int,
               activation_bytes: float, collectives: dict[str, float], local_params: float, threads: int,
               span: float | None = None) -> LocalStep:
    """The predicted step of the rank at pipeline position `pp_rank` (module docstring)."""
    p, m = cfg.parallel, cfg.microbatches(dims.dp)
    counts = stage_layer_counts(args.n_layers, dims.pp, p.pp_fewer_edge_layers) if dims.pp > 1 else [args.n_layers]
    last = pp_rank == dims.pp - 1
    contention = max(1.0, dims.world_size * threads / machine.cores)
    t_mb = contention * microbatch_seconds(args, dims, cfg, machine, counts[pp_rank], last, activation_bytes, span)
    bubble = (dims.pp - 1) * t_mb if dims.pp > 1 else 0.0
    optimizer = contention * local_params * ADAMW_BYTES / machine.memory_bytes_per_s
    host = contention * machine.fsdp_call_s * fsdp_calls(run_layout(args, dims, cfg), counts[pp_rank], pp_rank,
                                                         args.tie_embeddings)
    return LocalStep(m * t_mb, bubble, collective_seconds(collectives, dims, machine) + host, optimizer)
