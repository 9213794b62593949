"""One vocabulary: the names of the choices that the configuration, the runtime and the planner
share, defined once, the same in flags, JSON and messages. The pipeline schedules are in
`gridtrain.layout.schedules` (with what each does); the memory buckets are the fields of
`gridtrain.plan.memory.RankMemory`."""

from __future__ import annotations

from typing import Literal, get_args

Precision = Literal["fp32", "bf16", "fp16"]
"""fp32; bf16 (autocast, fp32 master weights); fp16 (autocast and dynamic loss scaling)."""
PRECISIONS: tuple[str, ...] = get_args(Precision)

Float8 = Literal["none", "tensorwise", "rowwise"]
"""FP8 training of the block linears beside bf16 (torchao's float8 training): none; tensorwise (one
scale per tensor, FSDP gathers weights in float8); rowwise (one scale per row)."""
FLOAT8: tuple[str, ...] = get_args(Float8)

Recompute = Literal["none", "selective", "full"]
"""Activation recomputation gridtrain runs: none; selective (keeps matmul and attention outputs,
recomputes norms, RoPE and SwiGLU's elementwise ops in backward); full (whole blocks)."""
RECOMPUTE: tuple[str, ...] = get_args(Recompute)

PlanRecompute = Literal[Recompute, "attention"]
"""What the planner can cost: gridtrain's modes, and Korthikanti et al.'s attention-core
recomputation (Megatron-LM's "selective"), which the runtime does not run: the planner uses it to
compare with published runs."""
PLAN_RECOMPUTE: tuple[str, ...] = get_args(PlanRecompute)

LRSchedule = Literal["cosine", "linear", "wsd", "constant"]
"""The learning rate's decay after warm-up (wsd: warmup-stable-decay)."""
LR_SCHEDULES: tuple[str, ...] = get_args(LRSchedule)

OnSaveError = Literal["stop", "continue"]
"""What a failed checkpoint save does to the run."""
ON_SAVE_ERROR: tuple[str, ...] = get_args(OnSaveError)
