"""The run as a whole: the units of one step, total compute, time, GPU-hours, cost, energy,
compute-optimal tokens, and the batch-size rules (learning-rate scaling, warm-up, critical batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PF_DAY = 1e15 * 86_400
"""FLOPs in one petaFLOP/s-day: 8.64e19."""


@dataclass(frozen=True)
class StepUnits:
    """The units of one training step (GPU, node, TP group, pipeline stage, model-parallel group,
    data-parallel replica, micro-batch, accumulation, global batch, optimizer step), counted."""

    num_gpus: int
    num_nodes: int
    tp_groups: int
    """Tensor-parallel groups (each tp GPUs): one per (pipeline stage, replica, cp rank)."""
    pipeline_stages: int
    """Pipeline-stage groups across the cluster (each one TP group, or tp x cp GPUs with CP)."""
    model_parallel_gpus: int
    """GPUs per model copy: tp x pp x cp."""
    replicas: int
    """Data-parallel replicas: GPUs / (tp x pp x cp)."""
    layers_per_stage: float
    tokens_per_microbatch: int
    accumulation: int
    global_batch_tokens: int
    optimizer_steps: float
    """Steps for the token budget: tokens / global batch tokens."""


def step_units(num_gpus: int, gpus_per_node: int, tp: int, pp: int, num_layers: int,
               micro_batch: int, seq_len: int, accumulation: int, total_tokens: float,
               cp: int = 1) -> StepUnits:
    """Worked example (an illustrative layout; Meta has not published the 70B's): Llama 3 70B on
    16,384 H100 (tp 8, pp 4, 4 x 8192-token micro-batches, accumulation 4): 2,048 nodes, 512
    replicas of 32 GPUs, 20 layers per stage, 67,108,864 tokens per step."""
    mp = tp * pp * cp
    if num_gpus % mp:
        raise ValueError(f"tp({tp}) x pp({pp}) x cp({cp}) = {mp} does not divide {num_gpus} GPUs")
    replicas = num_gpus // mp
    tokens = micro_batch * seq_len
    global_tokens = tokens * accumulation * replicas
    return StepUnits(num_gpus, math.ceil(num_gpus / gpus_per_node), num_gpus // tp,
                     num_gpus // (tp * cp), mp, replicas, num_layers / pp, tokens, accumulation,
                     global_tokens, total_tokens / global_tokens)


def global_batch(micro_batch: int, accumulation: int, dp: int) -> int:
    """global = micro x accumulation x DP."""
    return micro_batch * accumulation * dp


def accumulation_steps(global_batch_: int, micro_batch: int, dp: int) -> int:
    """ceil(global / (micro x DP)). Worked example: 2048 / (4 x 8) = 64."""
    return math.ceil(global_batch_ / (micro_batch * dp))


def accumulated_step_seconds(accumulation: int, micro_s: float, allreduce_s: float,
                             reduce_every_micro_batch: bool = False) -> float:
    """One optimizer step of `accumulation` micro-batches with the gradient all-reduce left
    exposed: once per step (accumulation), or after every micro-batch. Worked example: 64 x 120 ms
    + 50 ms = 7.73 s; reduced every micro-batch 64 x 170 ms = 10.88 s."""
    reductions = accumulation if reduce_every_micro_batch else 1
    return accumulation * micro_s + reductions * allreduce_s


def training_flops(num_params: float, tokens: float) -> float:
    """6 N D (Kaplan et al. 2020): 2 forward + 4 backward FLOPs per parameter per token."""
    return 6 * num_params * tokens


def pf_days(flops: float) -> float:
    """Worked example, Llama 3 405B on 15.6T tokens (Dubey et al. 2024): 6 x 405e9 x 15.6e12 /
    8.64e19 = 438,750 PF-days."""
    return flops / PF_DAY


def training_seconds(flops: float, num_gpus: int, peak_flops: float, mfu: float) -> float:
    """Wall-clock seconds at a model-FLOPs utilization: flops / (GPUs x peak x MFU)."""
    return flops / (num_gpus * peak_flops * mfu)


def training_days(flops: float, num_gpus: int, peak_flops: float, mfu: float) -> float:
    return training_seconds(flops, num_gpus, peak_flops, mfu) / 86_400


def gpu_hours(num_gpus: int, days: float) -> float:
    return num_gpus * days * 24


def energy_kwh(num_gpus: int, power_w: float, days: float, pue: float = 1.0) -> float:
    """GPUs x board power x hours, times the facility's PUE (1.0: the GPUs alone)."""
    return num_gpus * power_w / 1000 * days * 24 * pue


def cost_saving_from_mfu(cost: float, mfu_before: float, mfu_after: float) -> float:
    """Time, and so cost, scales as 1/MFU: saving = cost x (1 - before/after)."""
    return cost * (1 - mfu_before / mfu_after)


def chinchilla_tokens(num_params: float, tokens_per_param: float = 20.0) -> float:
    """Compute-optimal tokens, about 20 per parameter (Hoffmann et al. 2022)."""
    return tokens_per_param * num_params


def lr_linear(base_lr: float, base_batch: float, new_batch: float) -> float:
    """Linear scaling (Goyal et al. 2017): lr x B_new / B_base. Worked example: 3e-4, 256 -> 2048: 2.4e-3."""
    return base_lr * new_batch / base_batch


def lr_sqrt(base_lr: float, base_batch: float, new_batch: float) -> float:
    """Square-root scaling (Krizhevsky 2014; noise-scale argument): lr x sqrt(B_new / B_base).
    Worked example: 3e-4 x sqrt(8) = 8.49e-4."""
    return base_lr * math.sqrt(new_batch / base_batch)


def warmup_steps(base_warmup: float, base_batch: float, new_batch: float) -> float:
    """A rule of thumb: warm-up = (B_new / B_base) x base warm-up (1000 at 256 -> 8000 at 2048)."""
    return new_batch / base_batch * base_warmup


def critical_batch_tokens(loss_nats: float, b_star: float = 2e8, alpha_b: float = 0.21) -> float:
    """Kaplan et al. 2020, Eq. 1.4: B_crit(L) = B* / L^(1/alpha_B), B* ~ 2e8 tokens, alpha_B ~ 0.21
    (L in nats per token, their tokenizer). The often-quoted "GPT-3 scale: B_crit ~ 1-2M tokens"
    is this formula at a loss near 3 nats."""
    return b_star / loss_nats ** (1 / alpha_b)


def steps_at_batch(min_steps: float, batch: float, b_crit: float) -> float:
    """McCandlish et al. 2018: S = S_min (1 + B_crit / B). Below B_crit doubling B nearly halves
    the steps; above it, little changes."""
    return min_steps * (1 + b_crit / batch)


def examples_at_batch(min_examples: float, batch: float, b_crit: float) -> float:
    """McCandlish et al. 2018: E = E_min (1 + B / B_crit): the data (compute) price of large batches."""
    return min_examples * (1 + batch / b_crit)
