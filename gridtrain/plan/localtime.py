"""Predicted step time of a gridtrain run on the calibrated local machine (CPU ranks over gloo),
for `gridtrain plan --check`: the same decomposition as the cluster model (steptime.py), with the
constants `gridtrain calibrate` measured on this machine instead of a data sheet's.

One optimizer step on one rank:

    step = contention x (m + bubble) x t_mb + collectives + optimizer
    t_mb = matmul FLOPs / (matmul peak x CPU_MATMUL) + attention FLOPs / attention rate
           + saved-activation bytes x HBM_PASSES / memory bandwidth

- matmul FLOPs: 6 x the rank's matmul parameters x tokens per micro-batch (8 x with full
  recomputation; selective recomputation rebuilds only elementwise work); TP divides them;
- attention: counted in full (no causal halving), 3 x 4 s^2 d per head, at the rate measured for
  causal SDPA forward + backward (a CPU's attention kernel runs far below its matmul peak); under
  data.doc_mask s^2 becomes s x the attention span (plan/documents.py), at the same rate (the
  blockwise document kernel's own rate is not calibrated);
- memory-bound work: the census of saved activations (check_run.microbatch_activations),
  each byte passed HBM_PASSES times at the measured bandwidth of an elementwise add;
- bubble: GPipe and 1F1B idle p - 1 micro-batch slots per step;
- collectives: the predicted bytes per collective (run_collectives.predict_collectives), a ring all-reduce
  moving 2(N-1)/N of its payload and an all-gather (N-1)/N, at the bus bandwidth measured
  between two gloo ranks, not overlapped: on a CPU, gloo's threads compete with compute;
- contention: ranks x threads beyond the machine's cores share them;
- optimizer: AdamW in fp32 streams 28 bytes per local parameter (gradient read, parameter and both
  moments read and written).
Left out: data loading, logging, the latency of each collective (calibrate measures it, but the
count of collectives per step is not modelled), and collectives whose bytes are not modelled
(the row says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from gridtrain.config import Config
from gridtrain.layout.dims import ParallelDims, stage_layer_counts
from gridtrain.model.args import ModelArgs
from gridtrain.plan.steptime import HBM_PASSES

CPU_MATMUL = 0.85
"""Fraction of the calibrated matmul peak that a model's matmuls reach on a CPU (bench_step.py
--profile: 846 of 950 GFLOP/s, 0.89, on the 26M shape in bf16; smaller shapes reach less)."""
ADAMW_BYTES = 28


@dataclass(frozen=True)
class LocalMachine:
    matmul_flops: float
    attention_flops: float
    memory_bytes_per_s: float
    gloo_bytes_per_s: float
    cores: int

    @classmethod
    def from_calibration(cls, entry: dict, precision: str, cores: int) -> LocalMachine:
        peak = entry["peak_flops"][precision]
        return cls(peak, entry.get("attention_flops", {}).get(precision, peak), entry["memory_bytes_per_s"],
                   entry["gloo_bytes_per_s"], cores)


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
    block_matmul = h * (2 * h + 2 * kv) + 3 * h * args.hidden_dim
    factor = 8 if recompute == "full" else 6
    matmul = factor * tokens * (layers * block_matmul + (args.vocab_size * h if last else 0)) / dims.tp
    keys = seq if span is None else span
    attention = (4 if recompute == "full" else 3) * 4 * tokens * keys * h * layers / dims.tp
    return (matmul / (machine.matmul_flops * CPU_MATMUL) + attention / machine.attention_flops
            + activation_bytes * HBM_PASSES / machine.memory_bytes_per_s)


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
    return LocalStep(m * t_mb, bubble, collective_seconds(collectives, dims, machine), optimizer)
