"""Parameter counts by part and model FLOPs per token, on the meta device (no weights allocated)."""

from __future__ import annotations

import dataclasses

import torch

from gridtrain.model.args import ModelArgs, ParamCounts
from gridtrain.model.llama import Transformer


def build_meta(args: ModelArgs) -> Transformer:
    """The model with every tensor on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return Transformer(args)


def count_parameters(model: torch.nn.Module) -> ParamCounts:
    """Counts by part; a tied output head counts once, under the embedding."""
    parts = dict(embedding=0, attention=0, mlp=0, norms=0, output=0, experts=0, experts_active=0)
    seen: set[int] = set()
    moe = getattr(getattr(model, "args", None), "moe", None)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if ".moe.experts." in name:
            parts["experts"] += p.numel()
            parts["experts_active"] += p.numel() // moe.num_experts * moe.top_k
        elif ".moe." in name:  # the router and the shared experts: every token uses them
            parts["mlp"] += p.numel()
        elif name.startswith("tok_embeddings"):
            parts["embedding"] += p.numel()
        elif ".attention." in name:
            parts["attention"] += p.numel()
        elif ".feed_forward." in name:
            parts["mlp"] += p.numel()
        elif "norm" in name:
            parts["norms"] += p.numel()
        elif name.startswith("output"):
            parts["output"] += p.numel()
        else:
            raise ValueError(f"parameter {name} belongs to no known part")
    return ParamCounts(**parts)


PARTS = tuple(f.name for f in dataclasses.fields(ParamCounts))


def model_parameters(args: ModelArgs) -> ParamCounts:
    """`count_parameters` of the model `args` describes, from meta models of one and two layers:
    the blocks of a kind (dense, MoE) are identical, so L layers add L - 1 times the second's
    count. The same numbers as building all L (tests/test_model.py), in constant time (Llama 3
    405B with 100,000 layers took minutes layer by layer)."""
    if args.n_layers <= 2 and args.moe is None:
        return count_parameters(build_meta(args))
    kinds = [args.moe is not None and args.moe.is_moe_layer(i) for i in range(args.n_layers)]
    total = {part: 0 for part in PARTS}
    for kind in set(kinds):
        # A model of one and of two blocks of this kind: the second block is what each one adds.
        same = args.moe if kind else None
        one = count_parameters(build_meta(dataclasses.replace(args, n_layers=1, moe=_all_layers(same))))
        two = count_parameters(build_meta(dataclasses.replace(args, n_layers=2, moe=_all_layers(same))))
        for part in PARTS:
            total[part] += kinds.count(kind) * (getattr(two, part) - getattr(one, part))
            if kind == kinds[0]:  # the parts outside the blocks, once
                total[part] += 2 * getattr(one, part) - getattr(two, part)
    return ParamCounts(**total)


def _all_layers(moe: object) -> object:
    """The same experts on every layer (so a model of one or two layers is all MoE)."""
    return None if moe is None else dataclasses.replace(moe, every=1, first_dense=0)


def flops_per_token(args: ModelArgs, seq_len: int, counts: ParamCounts | None = None,
                    span: float | None = None) -> float:
    """Model FLOPs per token of one training step (forward + backward): 6N + 12 L H Q T.

    N counts the parameters that take part in matmuls (every parameter but the input embedding,
    which is a lookup; a tied head is counted since its matmul is done); 12 L H Q T is attention's
    scores and weighted sum (L layers, H heads, Q head dim, T sequence), counted in full with no
    causal halving: PaLM's convention (Chowdhery et al. 2022, appendix B), used by torchtitan.
    Recomputation is not counted: this is model FLOPs (MFU), not hardware FLOPs (HFU). For a
    mixture of experts N counts the parameters a token passes through (its top_k routed experts,
    the shared ones and the router), as Mixtral's and DeepSeek's active-parameter figures do.
    With document masking (data.doc_mask) T is the attention span `span`, sum L_i^2 / T over a
    sequence's documents: the masked FLOPs (plan/documents.py says why MFU counts those).
    """
    counts = counts or model_parameters(args)
    n = counts.active - counts.embedding + (counts.embedding if args.tie_embeddings else 0)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * (seq_len if span is None else span)
