"""The one ordered composition of what gridtrain applies to a single-device model from outside.

Order (torchtitan's): pipeline split, tensor parallel, activation checkpointing, compile, then
FSDP/DDP. Until the parallel runtime lands, a world of one applies the middle two.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from gridtrain.model.llama import Transformer

# Selective recomputation keeps the outputs of the expensive ops (matmuls and attention) and
# recomputes the cheap, memory-hungry elementwise ones (norms, RoPE, SiLU x gate) in backward:
# most of full recomputation's memory saving at a fraction of its FLOPs (Korthikanti et al. 2022
# make the same trade at the level of the attention core).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():  # noqa: ANN202 - a pair of context managers, as checkpoint expects
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Wrap each transformer block: 'full' recomputes the whole block, 'selective' the cheap ops.

    The wrapper keeps state-dict keys unchanged, so checkpoints are independent of this choice.
    """
    if mode == "off":
        return
    for name, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
        model.layers[name] = wrapped


def apply_compile(model: Transformer) -> None:
    """Compile each block in place (names and state-dict keys unchanged); blocks share one graph."""
    for block in model.layers.values():
        block.compile(fullgraph=True)


def parallelize(model: Transformer, activation_checkpointing: str, compile: bool) -> nn.Module:
    """Apply, in order, everything gridtrain does to the model from outside."""
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        apply_compile(model)
    return model
