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
1,979 TFLOP/s, twice bf16's 989). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from gridtrain.model.args import ModelArgs
from gridtrain.plan.specs import AcceleratorSpec

LINEARS_PER_BLOCK = 7
"""wq, wk, wv, wo, w1, w2, w3."""
SCALE_BYTES = 4
"""One fp32 scale."""


def block_linear_params(args: ModelArgs) -> int:
    """Parameters of one block's linears: attention's q and o (dim x dim each), k and v
    (dim x n_kv_heads x head_dim each), the MLP's three (dim x hidden)."""
    kv = args.n_kv_heads * args.head_dim
    return 2 * args.dim * args.dim + 2 * args.dim * kv + 3 * args.dim * args.hidden_dim


@dataclass(frozen=True)
class Float8Step:
    """FP8's share of a step: matmul seconds at the peaks, bytes gathered per parameter, scales held."""

    matmul_s: float
    """Seconds of the step's FLOPs: the block linears' at the FP8 peak (16-bit without one), the rest at 16-bit."""
    gather_bytes_per_param: float
    """Bytes FSDP's all-gather moves per block-linear parameter: 1 (tensorwise), else 2."""
    scale_bytes: int
    """Bytes of the weights' precomputed scales a rank holds (tensorwise under FSDP)."""


def float8_step(args: ModelArgs, acc: AcceleratorSpec, recipe: str, fsdp: bool, tokens: int,
                other_flops_per_token: float, efficiency: float = 1.0) -> Float8Step:
    """FP8's step for `tokens` tokens on one rank of a whole model (no model parallelism): the block
    linears' 6 x params FLOPs per token at the FP8 peak, `other_flops_per_token` at the 16-bit
    peak, both at `efficiency` of their peak."""
    linear_flops = 6 * args.n_layers * block_linear_params(args) * tokens
    fp8_peak = acc.fp8_tflops * 1e12 if recipe != "none" and acc.fp8_tflops > 0 else acc.peak_flops
    matmul_s = (linear_flops / fp8_peak + other_flops_per_token * tokens / acc.peak_flops) / efficiency
    gathered = 1.0 if recipe == "tensorwise" and fsdp else 2.0
    scales = SCALE_BYTES * LINEARS_PER_BLOCK * args.n_layers if recipe == "tensorwise" and fsdp else 0
    return Float8Step(matmul_s, gathered, scales)
