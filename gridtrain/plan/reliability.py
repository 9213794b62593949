"""Checkpoints and failures: checkpoint size and write time, the optimal checkpoint interval
(Young 1974, Daly 2006), the work and money a failure costs, and MTBF at cluster scale.

Times are in seconds unless a name says otherwise.
"""

from __future__ import annotations

import math

CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 8
"""Mixed-precision Adam state on disk (the ZeRO paper's, sec. 3.1, less the gradients): 16-bit
weights (2), fp32 master weights (4), fp32 Adam moments (8). Gradients are not saved. (A
checkpoint that keeps only the fp32 master and re-derives the 16-bit copy needs 12.)"""


def checkpoint_bytes(num_params: float, bytes_per_param: float = CHECKPOINT_BYTES_PER_PARAM,
                     extra_bytes: float = 8) -> float:
    """num_params x bytes/param + scalars (step counter and learning rate: 8 bytes by default).
    Worked example: 70B -> 980 GB."""
    return num_params * bytes_per_param + extra_bytes


def checkpoint_write_seconds(size_bytes: float, bytes_per_s_per_writer: float, num_writers: int = 1,
                             aggregate_bytes_per_s: float = math.inf) -> float:
    """size / min(writers x per-writer bandwidth, storage's aggregate bandwidth). Every rank writing
    its own shard (torch.distributed.checkpoint) multiplies the bandwidth until the storage caps
    it. Worked example: 980 GB at 10 GB/s -> 98 s; 64 writers -> 1.5 s (if the storage keeps up)."""
    return size_bytes / min(num_writers * bytes_per_s_per_writer, aggregate_bytes_per_s)


def cluster_mtbf(mtbf_per_gpu: float, num_gpus: int) -> float:
    """Independent failures add their rates: MTBF_cluster = MTBF_gpu / N."""
    return mtbf_per_gpu / num_gpus


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): the compute time between checkpoints that minimizes the expected waste,
    sqrt(2 C M). Worked example: C = 98 s, M = 24 h -> 68.6 min."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006), the higher-order refinement of Young's interval, for C < 2M:
    sqrt(2CM) (1 + sqrt(C/(2M))/3 + (C/(2M))/9) - C; M itself when C >= 2M."""
    c, m = checkpoint_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def waste_fraction(interval_s: float, checkpoint_s: float, mtbf_s: float) -> float:
    """First-order expected waste per unit time (Young 1974): half an
    interval lost per failure plus the checkpoint overhead, (tau/2 + C M / tau) / M. At Young's
    interval both terms are equal and the waste is sqrt(2 C / M)."""
    return (interval_s / 2 + checkpoint_s * mtbf_s / interval_s) / mtbf_s


def expected_lost_seconds(interval_s: float, restart_s: float = 0.0) -> float:
    """Work lost to one failure: on average half an interval, plus the restart (reload and warm-up)."""
    return interval_s / 2 + restart_s


def cost_per_failure(num_gpus: int, price_per_gpu_hour: float, interval_s: float,
                     restart_s: float = 0.0) -> float:
    """Dollars of GPU time one failure wastes: GPUs x price x (tau/2 + restart) in hours.
    Worked example: 512 GPUs at $2, tau = 68.6 min, restart = one checkpoint time (98 s) -> $613."""
    return num_gpus * price_per_gpu_hour * expected_lost_seconds(interval_s, restart_s) / 3600


def expected_failures(duration_s: float, mtbf_s: float) -> float:
    return duration_s / mtbf_s


def daly_wall_seconds(solve_s: float, interval_s: float, checkpoint_s: float, mtbf_s: float,
                      restart_s: float = 0.0) -> float:
    """Daly (2006): expected wall-clock time to finish `solve_s` of work with exponential
    failures, M e^(R/M) (e^((tau + C)/M) - 1) solve / tau."""
    m = mtbf_s
    return m * math.exp(restart_s / m) * (math.exp((interval_s + checkpoint_s) / m) - 1) * solve_s / interval_s


def goodput_restarting(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """Useful work per wall second when every failure restarts the whole job from its last
    checkpoint: solve / Daly's expected wall time, tau / (M e^(R/M) (e^((tau + C)/M) - 1)).
    Worked example: tau = 240 s, C = 3 s, M = 3 h, R = 15 s -> 0.9752."""
    return interval_s / daly_wall_seconds(interval_s, interval_s, checkpoint_s, mtbf_s, restart_s)


def goodput_with_replicas(interval_s: float, checkpoint_s: float, mtbf_s: float, step_s: float,
                          recovery_s: float, num_replicas: int) -> float:
    """Useful work per wall second when a failure takes down one of `num_replicas` fault-tolerant
    replica groups (torchft) and the others keep stepping: each failure costs the step in flight
    (its quorum fails, every group redoes it) and the failed group's share of the job while it
    recovers from a live peer, recovery / r; checkpoints are still written every `interval_s`
    for what no replica survives (first order in 1/M: failures rarer than steps and recoveries).
    (1 - (step + recovery / r) / M) x tau / (tau + C). Worked example: tau = 240 s, C = 3 s,
    M = 3 h, step = 9 s, recovery = 20 s, r = 8 -> (1 - 11.5 / 10,800) x 240 / 243 = 0.9866."""
    per_failure = step_s + recovery_s / num_replicas
    return max(0.0, 1 - per_failure / mtbf_s) * interval_s / (interval_s + checkpoint_s)
