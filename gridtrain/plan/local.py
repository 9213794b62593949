"""This machine as a cluster: `gridtrain plan --gpu local` ranks layouts of N local processes (CPU
ranks over gloo, as `gridtrain train --nproc N` runs them) with the same search and step-time model
as any GPU cluster, its constants the ones `gridtrain calibrate` measured here.

Each rank is a "GPU" of one node holding all N:
- peak: the calibrated matmul peak at the rank's threads, shared when N x threads exceeds the
  cores (each rank gets cores / (N x threads) of its threads' time); a block's matmuls reach the
  share of it calibrate measured for a block's linear layers at the model's width
  (train/calibrate_kernels.py; localtime.CPU_MATMUL in an older calibration);
- memory bandwidth: the bandwidth of a large elementwise add, shared the same way; memory-bound
  work runs at the share of it that calibrate measured for a real block's elementwise work (its
  norms, RoPE, SiLU x gate and autocast's casts: about a quarter in bf16 on this 2-core machine,
  half in fp32); memory: the machine's RAM split evenly over the ranks;
- attention: the SDPA forward + backward rate calibrate timed at the model's head size and
  sequence length (interpolated over 32-128 x 128-2,048), shared the same way;
- framework time: the calibrated forward and backward of a block too small to compute (op
  dispatch, autograd, autocast), per layer per micro-batch, and what each recomputation mode's
  checkpoint machinery adds to it;
- collectives: gloo's all-reduce bus bandwidth between two processes, shared like the cores, each
  call costing the measured latency of a ring step per step (ring_step_seconds), never overlapped
  with compute (gloo's threads take the cores the matmuls run on: Efficiency.overlap_slowdown =
  1); gloo has no reduce-scatter, so FSDP's gradients cost an all-reduce;
- FSDP's host time per collective call (its copies, DTensor's dispatch and gloo's per-call cost
  between processes, train/calibrate_gloo.py), times the calls a step issues (dptime.fsdp_calls),
  shared like the cores; and tensor parallelism's host time per layer per micro-batch (DTensor's
  dispatch and redistributions, the same calibration), shared the same way.
Threads per rank: what torchrun gives each of N > 1 processes, OMP_NUM_THREADS or 1; one process
keeps torch's default, the cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gridtrain.plan.localtime import CPU_MATMUL, attention_rate, log_interpolate, matmul_share  # noqa: F401 (the kernels' rates)
from gridtrain.plan.machine import cached_entry, cpu_model_name
from gridtrain.plan.specs import AcceleratorSpec, ClusterSpec
from gridtrain.plan.steptime import Efficiency


class NoCalibration(ValueError):
    """This machine has not been calibrated at the threads per rank a plan needs."""


@dataclass(frozen=True)
class LocalPlanMachine:
    cluster: ClusterSpec
    eff: Efficiency
    threads: int
    contention: float


def rank_threads(ranks: int) -> int:
    """Threads per rank of `gridtrain train --nproc ranks` (module docstring)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return 1 if ranks > 1 else usable_cores()


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def ram_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9


def ring_step_seconds(entry: dict, ranks: int, contention: float) -> float:
    """The latency of one ring step of a collective over `ranks` local processes: calibrate's
    measurement over 2, the cores and twice the cores (gloo_ring_step_s; ranks beyond the cores
    wait for the scheduler at each step), in log ranks between them and in proportion beyond; an
    older calibration's half all-reduce between two threads, times the contention, without it."""
    table = {int(n): t for n, t in entry.get("gloo_ring_step_s", {}).items()}
    if not table:
        return entry.get("gloo_latency_s", 0.0) / 2 * contention
    most = max(table)
    return table[most] * ranks / most if ranks > most else log_interpolate(table, ranks)


def local_machine(ranks: int, precision: str, entry: dict | None = None, cores: int | None = None,
                  ram: float | None = None, head_dim: int | None = None, seq_len: int | None = None,
                  dim: int | None = None) -> LocalPlanMachine:
    """This machine as a one-node cluster of `ranks` CPU ranks (module docstring), for a model of
    `head_dim` and width `dim` at `seq_len`. `entry`, `cores` and `ram` replace the cached
    calibration and the machine's own figures (tests)."""
    threads = rank_threads(ranks)
    entry = entry if entry is not None else cached_entry(threads)
    if any(k not in entry for k in ("gloo_bytes_per_s", "layer_overhead_s")) or precision not in entry.get("peak_flops", {}):
        raise NoCalibration(f"--gpu local needs this machine calibrated at {threads} thread(s) per rank "
                            f"({ranks} rank(s)): run `gridtrain calibrate --threads {threads}` first")
    cores = cores or usable_cores()
    contention = max(1.0, ranks * threads / cores)
    peak = entry["peak_flops"][precision] / contention
    attention = attention_rate(entry, precision, head_dim, seq_len)
    gloo = entry["gloo_bytes_per_s"] / contention
    acc = AcceleratorSpec(f"local CPU rank ({cpu_model_name()}, {threads} thread(s))", peak / 1e12,
                          (ram or ram_bytes()) / ranks / 1e9, entry["memory_bytes_per_s"] / contention / 1e9, 0,
                          2 * gloo / 1e9)
    step_latency = ring_step_seconds(entry, ranks, contention)
    cluster = ClusterSpec("local", acc, ranks, gloo / 1e9, step_latency, gloo / 1e9, step_latency,
                          price_per_gpu_hour=0.0, gloo_step_s=step_latency)
    eff = Efficiency(matmul=matmul_share(entry, precision, dim),
                     hbm=entry.get("elementwise_share", {}).get(precision, 1.0), intra_node=1.0, inter_node=1.0,
                     layer_overhead_s=entry["layer_overhead_s"] * contention,
                     recompute_overhead_s=tuple((k, v * contention)
                                                for k, v in sorted(entry.get("recompute_overhead_s", {}).items())),
                     overlap_slowdown=1.0, attention=None if attention is None else attention / contention / peak,
                     fsdp_call_s=entry.get("fsdp_call_s", 0.0) * contention,
                     tp_block_s=entry.get("tp_block_s", 0.0) * contention)
    return LocalPlanMachine(cluster, eff, threads, contention)
