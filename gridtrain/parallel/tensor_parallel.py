"""Tensor parallelism (Megatron-LM) through DTensor `parallelize_module` plans, over the 'tp' axis.

Attention is split by heads (query and KV heads alike), the MLP column-then-row: per block one
all-reduce in forward after attention and one after the MLP (and their mirror in backward), each
of B x T x dim activations. With sequence parallelism the norms and residuals are split along the
sequence, and each all-reduce becomes a reduce-scatter plus an all-gather of the same total volume.
The embedding is vocabulary-parallel (row-wise) and the output head column-wise, its logits kept
sharded on the vocabulary for the loss (`loss_parallel`), so the full logits never exist on a rank.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)


def block_plan(sequence_parallel: bool, styles: dict[str, type] | None = None, moe: bool = False) -> dict[str, object]:
    """Placement of each submodule of a transformer block. `styles` replaces ColwiseParallel,
    RowwiseParallel and PrepareModuleInput by name (FP8's, which gather in float8). `moe`: the
    block's feed-forward is a mixture of experts (`moe_plan`)."""
    styles = styles or {}
    if moe:
        dense = block_plan(sequence_parallel, styles)
        return {**{k: v for k, v in dense.items() if not k.startswith("feed_forward")}, **moe_plan(sequence_parallel)}
    col, row = styles.get("ColwiseParallel", ColwiseParallel), styles.get("RowwiseParallel", RowwiseParallel)
    prepare = styles.get("PrepareModuleInput", PrepareModuleInput)
    if not sequence_parallel:
        # The block input enters attention (and the MLP) as one replicated DTensor, so the input
        # gradients of wq, wk and wv add up as partial sums and cross the group in one all-reduce
        # (Megatron's f), not one per projection.
        return {
            "attention": prepare(input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None)),
            "feed_forward": prepare(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "attention.wq": col(), "attention.wk": col(), "attention.wv": col(), "attention.wo": row(),
            "feed_forward.w1": col(), "feed_forward.w3": col(), "feed_forward.w2": row(),
        }
    return {
        "attention_norm": SequenceParallel(),
        "attention": prepare(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": col(), "attention.wk": col(),
        "attention.wv": col(), "attention.wo": row(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": col(), "feed_forward.w3": col(),
        "feed_forward.w2": row(output_layouts=Shard(1)),
    }


def moe_plan(sequence_parallel: bool) -> dict[str, object]:
    """A mixture of experts is replicated over the tensor-parallel ranks (router, experts and shared
    experts whole on each; torchtitan's expert tensor parallelism of 1): each rank routes the whole
    sequence and computes every token's experts itself, so the ranks' results and gradients are
    equal and nothing is summed. Without sequence parallelism its input is already whole (the
    attention's row-parallel output is all-reduced); with it, the input is gathered along the
    sequence and the output cut back to the rank's part (the cut needs no communication)."""
    if not sequence_parallel:
        return {}
    return {"moe": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_input=True, output_layouts=(Replicate(),),
                                            desired_output_layouts=(Shard(1),), use_local_output=True)}


def outer_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, object]:
    """Embedding (vocabulary-parallel), final norm and output head, for those this stage holds."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
             styles: dict[str, type] | None = None) -> None:
    """Shard the model's existing weights over `tp_mesh` in place (every rank holds the same full
    weights before, so each keeps exactly its slice of the single-process model).

    A tied embedding and output head stay one parameter: both plans shard the (vocab, dim) matrix
    on the vocabulary (Shard(0)), so the head takes the embedding's DTensor and both uses add into
    one gradient, as in one process. (`parallelize_module` would otherwise give each module its
    own copy, and the two would drift apart after the first step.) `styles`: `block_plan`'s."""
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    parallelize_module(model, tp_mesh, outer_plan(model, sequence_parallel))
    if tied:
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel, styles, moe=hasattr(block, "moe")))


def loss_context(tp: int) -> ContextManager:
    """Cross-entropy over vocabulary-sharded logits (forward and backward must run inside)."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
