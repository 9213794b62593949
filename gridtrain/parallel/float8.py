"""FP8 training through torchao's float8 training (`train.float8`), applied from outside the model.

The linear layers of every transformer block (attention's wq, wk, wv, wo and the MLP's w1, w2, w3)
become torchao `Float8Linear`s; the embedding and the output head stay as they are, as torchtitan
leaves them. Each such matmul casts its two operands to float8 with a scale per tensor
('tensorwise') or per row ('rowwise'), forward in e4m3 (3 mantissa bits, unit roundoff 2^-4) and,
for 'tensorwise', the output gradient in e5m2 (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", arXiv:2209.05433, section 3: e4m3 for weights and activations, e5m2 for gradients);
the master weights, the gradients handed to the optimizer and its state stay fp32, the rest of the
block runs under bf16 autocast (validate requires train.precision = 'bf16'). Without a GPU of
compute capability 8.9 or newer the float8 matmul is emulated (`Float8LinearConfig.emulate`):
the same casts and scales, the product taken in high precision of the float8 values, so CPU runs
train the numbers a GPU would, only slower. (On CPU the linear's output stays fp32: torchao reads
the CUDA autocast state only.)

With FSDP and 'tensorwise' scaling, FSDP gathers the weights in float8 (1 byte a parameter, each
shard cast with the scale of the whole tensor), and the scales of all weights are computed after
each optimizer step in one all-reduce (max) over the data-parallel shards
(`precompute_scales`). With tensor parallelism and 'tensorwise' on GPUs, the block's column and
row splits are torchao's float8 styles, which gather in float8 too (`block_tp_styles`).

torchao is imported here only, and only when a run asks for float8.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

FLOAT8_DIM_MULTIPLE = 16
"""The float8 matmul (`torch._scaled_mm`) wants both dimensions of each weight a multiple of 16."""


def has_float8_matmul(device: torch.device) -> bool:
    """Whether the device multiplies in float8 itself (NVIDIA compute capability 8.9 or newer)."""
    if device.type != "cuda" or torch.version.hip is not None:  # XPU and ROCm (its fnuz float8) emulate
        return False
    return torch.get_device_module(device.type).get_device_capability(device) >= (8, 9)


def float8_config(recipe: str, device: torch.device, fsdp: bool) -> Float8LinearConfig:
    """torchao's config for `recipe` ('tensorwise' or 'rowwise'): emulated where the device has no
    float8 matmul, FSDP's float8 all-gather on where FSDP shards a 'tensorwise' model."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=not has_float8_matmul(device),
                               enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")


def converts(module: nn.Module, fqn: str) -> bool:
    """Whether a module becomes a Float8Linear: a linear of a transformer block whose dimensions
    are multiples of 16 (validate refuses a model with any other linear in its blocks)."""
    return (isinstance(module, nn.Linear) and fqn.startswith("layers.")
            and module.in_features % FLOAT8_DIM_MULTIPLE == 0 and module.out_features % FLOAT8_DIM_MULTIPLE == 0)


def apply_float8(model: nn.Module, recipe: str, device: torch.device, fsdp: bool) -> int:
    """Swap the block linears of `model` (one pipeline stage, or the whole model, still unsharded)
    for Float8Linears in place; parameter names and state-dict keys are unchanged. Returns how
    many it swapped. Issues no collective."""
    from torchao.float8 import convert_to_float8_training

    before = sum(converts(m, n) for n, m in model.named_modules())
    convert_to_float8_training(model, config=float8_config(recipe, device, fsdp), module_filter_fn=converts)
    return before


def block_tp_styles(recipe: str, device: torch.device) -> dict[str, type] | None:
    """torchao's float8 tensor-parallel styles in place of the plain ones, by name
    (ColwiseParallel, RowwiseParallel, PrepareModuleInput), for 'tensorwise' where collectives
    carry float8 (NCCL): they cast before the all-gathers of sequence parallelism, forward and
    backward, and move 1 byte an element. None (the plain styles) for 'rowwise', whose scales are
    per row of each rank's shard, and on CPU, where gloo refuses float8 tensors: there each
    Float8Linear casts its DTensor operands itself, one scale over the whole tensor as before
    (measured: the same losses as the float8 styles without sequence parallelism, to the bit)."""
    if recipe != "tensorwise" or device.type == "cpu":
        return None
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)

    return {"ColwiseParallel": Float8ColwiseParallel, "RowwiseParallel": Float8RowwiseParallel,
            "PrepareModuleInput": PrepareFloat8ModuleInput}


def precompute_scales(parts: list[nn.Module]) -> None:
    """After an optimizer step under FSDP's float8 all-gather: each weight's float8 scale, for the
    next forward's all-gather, from the amax of all its shards: one all-reduce (max) over the
    'dp_shard' axis of one fp32 per weight. A no-op for a model without such weights."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
