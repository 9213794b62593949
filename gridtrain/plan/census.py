"""What one rank of a gridtrain run holds, tensor by tensor: the parameters of its pipeline stages
(global names, in the order the model registers them), split by tensor parallelism, sharded by
FSDP or partitioned by ZeRO-1, as element counts per memory bucket.

The rules are the runtime's (gridtrain/parallel):
- tensor parallelism splits column-parallel weights (wq, wk, wv, w1, w3, output) on their rows,
  row-parallel ones (wo, w2) on their columns and the embedding on its vocabulary rows; norms are
  replicated. One quirk of DTensor is kept, not assumed away: under tensor parallelism without
  FSDP, the embedding's gradient comes back replicated (full size), unless the head shares it
  (tied), whose column-parallel use keeps it sharded;
- FSDP (ZeRO 2 and 3) splits each local tensor's first dimension into dp_shard chunks of
  ceil(d / N) rows; rank i holds chunk i (the last chunks may be shorter or empty);
- ZeRO-1 (torch's ZeroRedundancyOptimizer) gives each whole tensor's optimizer state to one
  data-parallel rank: within each parameter group (decayed matrices, then the rest), largest
  tensor first, to the rank with the fewest elements so far;
- expert parallelism (ep > 1) splits each MoE layer's routed experts (w1, w2, w3, stacked [E, ...])
  by expert over ep of the data- and context-parallel ranks, E / ep each; the ranks left that hold
  the same experts split their dimension 1 evenly over edp_shard (gridtrain.layout.experts; 1 when
  ep spans every data- and context-parallel rank, FSDP then leaving them alone); with ep = 1 they
  are weights like the others (FSDP splits their expert dimension). Tensor parallelism leaves a
  mixture of experts whole (router, experts, shared);
- AdamW keeps two moments of each parameter's local size and one step count per tensor.
Nothing here imports torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from gridtrain.layout.dims import stage_layer_counts
from gridtrain.layout.schedules import stage_ranks
from gridtrain.plan.shape import ModelShape

Shape = tuple[int, ...]
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3", "output")
ROWWISE = ("attention.wo", "feed_forward.w2")


def block_shapes(shape: ModelShape, i: int, moe: bool) -> dict[str, Shape]:
    """Name -> shape of block `i`'s parameters in registration order: attention norm, wq, wk, wv,
    wo (QK-norm's q_norm and k_norm), MLP norm, then a dense SwiGLU (w1, w2, w3) or, with `moe`,
    the router's gate [E, h], the routed experts w1, w2, w3 ([E, F, h], [E, h, F], [E, F, h], F
    the expert width) and the shared experts' SwiGLU of width num_shared x F."""
    h, f, kv, q = shape.hidden, shape.ffn, shape.kv_width, shape.q_width
    p = f"layers.{i}."
    out = {p + "attention_norm.weight": (h,), p + "attention.wq.weight": (q, h), p + "attention.wk.weight": (kv, h),
           p + "attention.wv.weight": (kv, h), p + "attention.wo.weight": (h, q)}
    if shape.qk_norm:
        out.update({p + "attention.q_norm.weight": (shape.head_dim,), p + "attention.k_norm.weight": (shape.head_dim,)})
    out[p + "ffn_norm.weight"] = (h,)
    if not moe:
        out.update({p + "feed_forward.w1.weight": (f, h), p + "feed_forward.w2.weight": (h, f),
                    p + "feed_forward.w3.weight": (f, h)})
        return out
    e, fe, shared = shape.num_experts, shape.expert_ffn, shape.num_shared_experts * shape.expert_ffn
    out.update({p + "moe.router.gate.weight": (e, h), p + "moe.experts.w1": (e, fe, h),
                p + "moe.experts.w2": (e, h, fe), p + "moe.experts.w3": (e, fe, h)})
    if shared:
        out.update({p + "moe.shared.w1.weight": (shared, h), p + "moe.shared.w2.weight": (h, shared),
                    p + "moe.shared.w3.weight": (shared, h)})
    return out


def stage_shapes(shape: ModelShape, layers: range, first: bool, last: bool) -> dict[str, Shape]:
    """Name -> shape of the parameters of a stage holding `layers`, in registration order: the
    embedding (first stage), each block (block_shapes), final norm and head (last stage; a tied
    head is the embedding, not a second tensor)."""
    h = shape.hidden
    out: dict[str, Shape] = {}
    if first:
        out["tok_embeddings.weight"] = (shape.vocab, h)
    for i in layers:
        out.update(block_shapes(shape, i, shape.is_moe_layer(i)))
    if last:
        out["norm.weight"] = (h,)
        if not (shape.tie_embeddings and first):
            out["output.weight"] = (shape.vocab, h)
    return out


def is_routed_expert(name: str) -> bool:
    """Whether the parameter is an MoE layer's stacked routed experts (w1, w2 or w3)."""
    return ".moe.experts." in name


def ep_local(shape: Shape, ep: int, expert_shard: int = 1) -> Shape:
    """One expert-parallel rank's routed experts: E / ep of them (ep divides E: validate), their
    dimension 1 split over the `expert_shard` ranks that FSDP shards them over (evenly: validate)."""
    return (shape[0] // ep, shape[1] // expert_shard, *shape[2:])


def rank_stage_shapes(shape: ModelShape, pp: int, virtual: int, schedule: str, fewer_edge_layers: int,
                      pp_rank: int) -> list[dict[str, Shape]]:
    """The parameter shapes of each stage pipeline rank `pp_rank` runs (one model part each)."""
    num_stages = pp * virtual if pp > 1 else 1
    counts = stage_layer_counts(shape.num_layers, num_stages, fewer_edge_layers)
    owners = stage_ranks(pp, virtual, schedule) if pp > 1 else [0]
    parts = []
    for stage, owner in enumerate(owners):
        if owner == pp_rank:
            start = sum(counts[:stage])
            parts.append(stage_shapes(shape, range(start, start + counts[stage]), stage == 0, stage == num_stages - 1))
    return parts


def tp_local(name: str, shape: Shape, tp: int) -> Shape:
    if tp == 1 or len(shape) == 1:
        return shape
    if name.startswith("tok_embeddings") or any(f"{m}.weight" in name for m in COLWISE):
        return (shape[0] // tp, *shape[1:])
    if any(f"{m}.weight" in name for m in ROWWISE):
        return (shape[0], shape[1] // tp)
    return shape


def fsdp_local(shape: Shape, shards: int, index: int) -> Shape:
    chunk = math.ceil(shape[0] / shards)
    rows = max(0, min(chunk, shape[0] - index * chunk))
    return (rows, *shape[1:])


def numel(shape: Shape) -> int:
    return math.prod(shape)


@functools.lru_cache(maxsize=1024)
def zero1_shares(part: tuple[tuple[str, Shape], ...], dp: int) -> tuple[tuple[int, int], ...]:
    """(elements, tensors) whose optimizer state each data-parallel rank keeps under ZeRO-1:
    ZeroRedundancyOptimizer's greedy partition over gridtrain's two parameter groups (decayed
    matrices, then norms and the embedding), largest tensor first (ties in registration order),
    each to the rank with the fewest elements so far (the first such rank)."""
    decayed = [(n, s) for n, s in part if len(s) >= 2 and not n.startswith("tok_embeddings")]
    rest = [(n, s) for n, s in part if not (len(s) >= 2 and not n.startswith("tok_embeddings"))]
    sizes, counts = [0] * dp, [0] * dp
    for group in (decayed, rest):
        for _, s in sorted(group, key=lambda item: numel(item[1]), reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += numel(s)
            counts[rank] += 1
    return tuple(zip(sizes, counts))


@dataclass(frozen=True)
class Elements:
    """Elements one rank keeps per bucket (the optimizer's as parameter elements, each with two
    moments), and the parameter tensors whose optimizer state it keeps (one step count each)."""

    params: int
    grads: int
    optimizer: int
    optimizer_tensors: int


@functools.lru_cache(maxsize=4096)
def rank_elements(shape: ModelShape, tp: int, pp: int, virtual: int, schedule: str, fewer_edge_layers: int,
                  zero_stage: int, dp_replicate: int, dp_shard: int, pp_rank: int, dp_index: int,
                  ep: int = 1, expert_shard: int = 1) -> Elements:
    """The elements rank (pp_rank, dp_index) holds; dp_index counts over dp_replicate x dp_shard
    (its position in dp_shard is dp_index % dp_shard). Every expert-parallel rank holds as many
    routed experts (E / ep, split evenly over `expert_shard`), so dp_index does not pick them."""
    dp = dp_replicate * dp_shard
    fsdp = zero_stage in (2, 3) and dp > 1
    shard = (dp_shard, dp_index % dp_shard) if fsdp else None
    total = Elements(0, 0, 0, 0)
    num_stages = pp * virtual if pp > 1 else 1
    counts = stage_layer_counts(shape.num_layers, num_stages, fewer_edge_layers)
    owners = stage_ranks(pp, virtual, schedule) if pp > 1 else [0]
    for stage, owner in enumerate(owners):
        if owner != pp_rank:
            continue
        if zero_stage == 1 and dp > 1:  # whole tensors to ranks: count them one by one
            start = sum(counts[:stage])
            part = stage_shapes(shape, range(start, start + counts[stage]), stage == 0, stage == num_stages - 1)
            local = tuple((n, tp_local(n, s, tp)) for n, s in part.items())
            held, count = zero1_shares(local, dp)[dp_index]
            n = sum(numel(s) for _, s in local)
            grads = sum(_grad(name, part[name], s, tp, False, shape.tie_embeddings) for name, s in local)
            total = _add(total, Elements(n, grads, held, count))
            continue
        # The blocks of a kind (dense, MoE) have the same tensors: count one of each and the edges.
        start = sum(counts[:stage])
        moe = shape.moe_layers_in(start, start + counts[stage])
        for kind, n in ((False, counts[stage] - moe), (True, moe)):
            if n:
                block = _local_elements(tuple(block_shapes(shape, 0, kind).items()), tp, shard, False, ep,
                                        expert_shard)
                total = _add(total, _scale(block, n))
        edges = _local_elements(tuple(stage_shapes(shape, range(0), stage == 0, stage == num_stages - 1).items()),
                                tp, shard, shape.tie_embeddings)
        total = _add(total, edges)
    return total


@functools.lru_cache(maxsize=1024)
def _local_elements(part: tuple[tuple[str, Shape], ...], tp: int, shard: tuple[int, int] | None,
                    tied: bool, ep: int = 1, expert_shard: int = 1) -> Elements:
    """Elements of a set of tensors on one rank, every tensor's optimizer state kept there."""
    params = grads = 0
    for name, s in part:
        if ep > 1 and is_routed_expert(name):
            local = ep_local(s, ep, expert_shard)
        elif shard is not None:
            local = fsdp_local(tp_local(name, s, tp), *shard)
        else:
            local = tp_local(name, s, tp)
        params += numel(local)
        grads += _grad(name, s, local, tp, shard is not None, tied)
    return Elements(params, grads, params, len(part))


def _grad(name: str, full: Shape, local: Shape, tp: int, fsdp: bool, tied: bool) -> int:
    """Elements of a tensor's gradient: its local size, except the embedding's under tensor
    parallelism without FSDP, which DTensor returns replicated (full size) when the embedding
    alone uses it (measured by dry runs: a tied head's use keeps it sharded)."""
    replicated = tp > 1 and not fsdp and not tied and name.startswith("tok_embeddings")
    return numel(full) if replicated else numel(local)


def _add(a: Elements, b: Elements) -> Elements:
    return Elements(a.params + b.params, a.grads + b.grads, a.optimizer + b.optimizer,
                    a.optimizer_tensors + b.optimizer_tensors)


def _scale(a: Elements, k: int) -> Elements:
    return Elements(a.params * k, a.grads * k, a.optimizer * k, a.optimizer_tensors * k)


@functools.lru_cache(maxsize=4096)
def peak_dp_index(shape: ModelShape, tp: int, pp: int, virtual: int, schedule: str, fewer_edge_layers: int,
                  zero_stage: int, dp_replicate: int, dp_shard: int, pp_rank: int) -> int:
    """The data-parallel index that holds the most: 0 under FSDP (the first chunks are the
    longest) and without sharding; under ZeRO-1 the rank the partition gave most to."""
    dp = dp_replicate * dp_shard
    if zero_stage != 1 or dp == 1:
        return 0
    parts = rank_stage_shapes(shape, pp, virtual, schedule, fewer_edge_layers, pp_rank)
    held = [0] * dp
    for part in parts:
        shares = zero1_shares(tuple((n, tp_local(n, s, tp)) for n, s in part.items()), dp)
        held = [h + e for h, (e, _) in zip(held, shares)]
    return held.index(max(held))
