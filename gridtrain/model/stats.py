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
    parts = dict(embedding=0, attention=0, mlp=0, norms=0, output=0)
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.startswith("tok_embeddings"):
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


def model_parameters(args: ModelArgs) -> ParamCounts:
    """`count_parameters` of the model `args` describes, from meta models of one and two layers:
    the blocks are identical, so L layers add L - 1 times the second's count. The same numbers as
    building all L (tests/test_model.py), in constant time (Llama 3 405B with 100,000 layers
    took minutes layer by layer)."""
    if args.n_layers <= 2:
        return count_parameters(build_meta(args))
    one = count_parameters(build_meta(dataclasses.replace(args, n_layers=1)))
    two = count_parameters(build_meta(dataclasses.replace(args, n_layers=2)))
    return ParamCounts(**{part: getattr(one, part) + (args.n_layers - 1) * (getattr(two, part) - getattr(one, part))
                          for part in ("embedding", "attention", "mlp", "norms", "output")})


def flops_per_token(args: ModelArgs, seq_len: int, counts: ParamCounts | None = None) -> float:
    """Model FLOPs per token of one training step (forward + backward): 6N + 12 L H Q T.

    N counts the parameters that take part in matmuls (every parameter but the input embedding,
    which is a lookup; a tied head is counted since its matmul is done); 12 L H Q T is attention's
    scores and weighted sum (L layers, H heads, Q head dim, T sequence), counted in full with no
    causal halving: PaLM's convention (Chowdhery et al. 2022, appendix B), used by torchtitan.
    Recomputation is not counted: this is model FLOPs (MFU), not hardware FLOPs (HFU).
    """
    counts = counts or model_parameters(args)
    n = counts.non_embedding + (counts.embedding if args.tie_embeddings else 0)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
