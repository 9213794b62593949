"""gridtrain's own runs on one GPU, and the kernel efficiencies they fix for one-GPU predictions.

Measured 2026-11-27 by `python bench/gpu/suite.py` on one H100 80GB HBM3 (SXM, 700 W limit),
torch 2.11.0+cu130 (bench/gpu/results/2026-11-27-h100): Llama 3.2 1B at seq 8,192 without
recomputation and the 3B shape at seq 4,096 with full recomputation, micro-batch 1, bf16, fused
AdamW, eager and under torch.compile. Each row's `matmul` is the share of the dense peak that makes
steptime.step_time equal the measured median step (the memory-bound passes, per-layer overhead and
optimizer kept at their calibrated values); the two shapes agree within 0.5% eager and 4.4%
compiled, and ONE_GPU takes their mean.

They lie well above the 'eager' and 'compiled' constants fixed by torchtitan's published FSDP
rows (reference_titan, 0.41 and 0.49): those ran in December 2024 on H100s held at 500 W, with
FSDP's own time over 8 to 128 GPUs and selective checkpointing that recomputes every second
matmul, none of which one GPU at 700 W pays. Until a multi-GPU run of gridtrain splits that gap,
layouts of several GPUs keep the published constants and `plan --check` of a one-GPU run uses
these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gridtrain.plan.steptime import IMPLEMENTATIONS, Efficiency

SOURCE = "bench/gpu/results/2026-11-27-h100 (gridtrain on one H100 80GB HBM3, torch 2.11.0+cu130)"


@dataclass(frozen=True)
class GpuRun:
    shape: str
    """'1b' (dim 2048, 16 layers, 32/8 heads, FFN 8192, vocabulary 128,256, tied) or '3b' (dim 3072,
    28 layers, 24/8 heads, FFN 8192, tied)."""
    seq_len: int
    recompute: str
    implementation: str
    step_s: float
    """Median step, steps 6-15."""
    matmul: float
    """The share of the peak that predicts step_s (module docstring)."""
    peak_allocated_GiB: float
    peak_reserved_GiB: float


RUNS = (
    GpuRun("1b", 8192, "none", "eager", 0.1997, 0.595, 43.74, 46.33),
    GpuRun("3b", 4096, "full", "eager", 0.3017, 0.597, 50.49, 52.95),
    GpuRun("1b", 8192, "none", "compiled", 0.1804, 0.684, 39.74, 42.36),
    GpuRun("3b", 4096, "full", "compiled", 0.2669, 0.714, 50.49, 52.05),
)


def _mean_matmul(implementation: str) -> float:
    shares = [r.matmul for r in RUNS if r.implementation == implementation]
    return sum(shares) / len(shares)


ONE_GPU: dict[str, Efficiency] = {name: replace(IMPLEMENTATIONS[name], matmul=round(_mean_matmul(name), 3))
                                  for name in ("eager", "compiled")}
"""What gridtrain's kernels reach on one H100 (eager 0.596, compiled 0.699 of the dense peak)."""
