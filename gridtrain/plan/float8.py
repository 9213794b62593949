"""What FP8 training (train.float8, torchao's float8 training) changes in a rank's step: the block
linears' matmuls at the device's FP8 peak, FSDP's all-gather at 1 byte a parameter, and the scales.

Only the linear layers of the blocks run in float8 (gridtrain.parallel.float8): their FLOPs are
6 x the block linears' parameters per token; the attention core (12 L H Q T per token), the
embedding and the output head stay at the 16-bit peak. On a device without an FP8 matmul
(`AcceleratorSpec.fp8_tflops` 0) nothing gets faster. With 'tensorwise' scaling under FSDP each
block linear's weight is gathered in float8, 1 byte a parameter instead of bf16's 2, and holds
one fp32 scale (precomputed after the optimizer step); 'rowwise' gathers in bf16 and scales each
row of its casts, which live only inside the matmul. Sources: Micikevicius et al. 2022, "FP8
Formats for Deep Learning" (e4m3 forward, e5m2 gradients); the NVIDIA H100 data sheet (FP8 dense
1,979 TFLOP/s, twice bf16's 989). steptime.layer_cost prices the linears at `matmul_peak`,
steptime and comm count FSDP's gathers with `gathered_bytes`, memory the gathered block and the
scales; the casts' own memory-bound passes are not modelled yet. Imports no torch.
"""

from __future__ import annotations

import re

from gridtrain.plan.shape import ModelShape
from gridtrain.plan.specs import AcceleratorSpec

LINEARS_PER_BLOCK = 7
"""wq, wk, wv, wo, w1, w2, w3."""
FLOAT8_LINEAR = re.compile(r"^layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123])\.weight$")
"""The parameter names of the block linears FP8 converts (gridtrain.parallel.float8.converts)."""
SCALE_BYTES = 4
"""One fp32 scale."""


def matmul_peak(acc: AcceleratorSpec, recipe: str) -> float:
    """The peak the block linears run at: the device's dense FP8 peak under FP8 where it has one,
    else its 16-bit peak."""
    return acc.fp8_tflops * 1e12 if recipe != "none" and acc.fp8_tflops > 0 else acc.peak_flops


def gathers_float8(recipe: str, zero_stage: int, shards: int) -> bool:
    """Whether FSDP gathers the block linears' weights in float8: 'tensorwise' where FSDP shards
    them (ZeRO 2 and 3 over more than one rank), as gridtrain.parallel.float8 configures torchao."""
    return recipe == "tensorwise" and zero_stage in (2, 3) and shards > 1


def block_linear_params(shape: ModelShape) -> int:
    """One llama block's linear parameters: attention's q and o (h x heads x head_dim each), k and v
    (h x kv_heads x head_dim each), the MLP's three (h x ffn)."""
    return 2 * shape.hidden * (shape.q_width + shape.kv_width) + 3 * shape.hidden * shape.ffn


def gathered_bytes(shape: ModelShape, params: float, layers: int, tp: int, compute_bytes: float, recipe: str,
                   zero_stage: int, shards: int) -> float:
    """Bytes FSDP gathers for a rank's `params` parameters of `layers` blocks: the block linears'
    at 1 byte each where they are gathered in float8, everything else at `compute_bytes`."""
    if not gathers_float8(recipe, zero_stage, shards):
        return params * compute_bytes
    linear = min(params, layers * block_linear_params(shape) / tp)
    return linear + (params - linear) * compute_bytes


def scale_bytes(layers: int, recipe: str, zero_stage: int, shards: int) -> int:
    """The precomputed fp32 scales of a rank's block-linear weights under FSDP's float8 all-gather."""
    return SCALE_BYTES * LINEARS_PER_BLOCK * layers if gathers_float8(recipe, zero_stage, shards) else 0
