"""What a mixture-of-experts layer adds to the planner's step on one rank: its feed-forward's FLOPs,
the expert-parallel all-to-alls and their time, and the allowance for routing imbalance.

gridtrain's MoE layer (model/moe.py, parallel/expert_parallel.py) on a rank of a layout:
- the router (E x h) and the shared experts run on every tensor-parallel rank in full (the
  mixture is replicated over TP, parallel/tensor_parallel.moe_plan), as do the routed experts;
- each of the rank's tokens (micro-batch x seq / cp) goes to its top_k experts: A = tokens x k
  assignments. Without expert parallelism the rank runs all E experts on them; with ep ranks (ep
  of the data- and context-parallel ranks, the innermost) it sends each assignment to the rank
  holding its expert and runs the rows it receives on its E / ep experts;
- the dp x cp / ep ranks left that hold the same experts keep them as gridtrain.layout.experts
  says: FSDP-sharded over edp_shard (gathered and reduce-scattered per sync like a block) and
  replicated over edp_replicate (the shard's gradient all-reduced), expert_dp_seconds;
- per layer and micro-batch, five all_to_all_single calls (plan/moe_collectives.py): the counts
  (8 E bytes), the dispatch (4 A h: the residual stream's fp32 rows) and the combine (c A h, c
  the compute dtype's bytes) forward, their gradients backward (c A h, 4 A h); recomputation
  (full or selective: neither keeps their outputs, and the grouped matmul is not among the ops
  selective checkpointing saves) runs the forward three and the routed experts again;
- the all-to-alls run in line: the dispatch waits for the router, the experts for the dispatch
  (no overlap with compute, unlike DeepSeek-V3's DualPipe, which hides them behind another
  micro-batch's compute), so their whole time is on the critical path;
- the busiest rank sets the pace of every all-to-all and of the experts behind it.

ROUTING_IMBALANCE is the planner's allowance for that: the rows the busiest expert-parallel rank
receives over the mean, by ep, applied to its routed-expert compute, to the rows it receives and to
its routed activations (a capacity factor c caps it at c: busiest_rows). It is measured, not
guessed (`python bench/bench_moe_load.py`): 300-step runs of small-moe's shape balanced by the
auxiliary loss (gridtrain's default, and Mixtral's and Qwen3's), their validation sequences routed
by the final checkpoint and grouped as an ep group's micro-batch is, each rank holding E / ep
consecutive experts: the busiest rank's rows over the mean, averaged over layers and micro-batches
(what a step sums, layer after layer), at 1,024 tokens a rank. It depends on the routing's shape as
much as on ep: at ep 8, 8 experts at top-2 (Mixtral's routing, one expert a rank) measure 1.37, 32
experts at top-8 (four a rank) 1.16, 128 at top-8 (Qwen3's routing, sixteen a rank) 1.27: 300 steps
balance 128 experts worse than 32. So there is one table per measured routing, (E, k), and a plan
reads the one whose expert count is nearest its model's (in log2 E): 8 experts for Mixtral, 128 for
Qwen3. These are routers trained for 300 steps; one trained far longer may be balanced better,
which they cannot show. It is the experts' popularity more than sampling noise: at 4,096 tokens a
rank the figures move by 0.04 at most. Between the measured ep it is interpolated in log2(ep), and
beyond the widest held there (not measured there). The other balance methods, measured on the
8-expert shape at ep 2, 4, 8: the expert bias at rate 0.01 with sigmoid scores (DeepSeek-V3's
pairing) 1.06, 1.13, 1.24, with softmax scores 1.06, 1.20, 1.39; no balancing 1.63, 2.48, 3.53.
A plan reads the auxiliary loss's tables whatever the model's balance method (every preset uses it).
"""

from __future__ import annotations

import math

from gridtrain.plan import placement
from gridtrain.plan.layout import Layout
from gridtrain.plan.shape import ModelShape, moe_mlp_params
from gridtrain.plan.specs import ClusterSpec

ROUTING_IMBALANCE: dict[tuple[int, int], dict[int, float]] = {
    (8, 2): {2: 1.11, 4: 1.20, 8: 1.37},
    (32, 8): {2: 1.045, 4: 1.092, 8: 1.162, 16: 1.401, 32: 1.535},
    (128, 8): {2: 1.031, 4: 1.125, 8: 1.272, 16: 1.402, 32: 1.574, 64: 2.040},
}
"""Rows the busiest of ep expert-parallel ranks receives over the mean, by the measured routing's
(experts, top-k) and ep (module docstring)."""


def imbalance_tables(experts: int) -> list[tuple[int, int]]:
    """The measured routings a model of `experts` routed experts is costed by: the nearest in log2
    of the expert count, both where two are equally near (routing_imbalance takes the larger)."""
    distance = {key: abs(math.log2(key[0] / experts)) for key in ROUTING_IMBALANCE}
    nearest = min(distance.values())
    return [key for key, d in distance.items() if d == nearest]


def _interpolated(table: dict[int, float], ep: int) -> float:
    """A measured table at ep: linear in log2(ep) between its points (from 1 at ep 1), held beyond
    the widest."""
    points = [(1, 1.0), *sorted(table.items())]
    for (lo, a), (hi, b) in zip(points, points[1:]):
        if ep <= hi:
            return a + (b - a) * math.log2(ep / lo) / math.log2(hi / lo)
    return points[-1][1]


def routing_imbalance(ep: int, experts: int) -> float:
    """The allowance at ep ranks for a model of `experts` routed experts: 1 for one rank running
    every expert (it receives exactly its own assignments, dropless) and for a dense model, else
    the nearest measured table's at its ep (imbalance_tables; the larger of two equally near)."""
    if ep <= 1 or experts <= 0:
        return 1.0
    return max(_interpolated(ROUTING_IMBALANCE[key], ep) for key in imbalance_tables(experts))


def busiest_rows(shape: ModelShape, ep: int) -> float:
    """Rows the busiest of ep expert-parallel ranks runs, over the mean of dropless routing: the
    allowance (routing_imbalance), capped by a capacity factor c. Each rank sends an expert at most
    ceil(c N k / E) of its N k assignments, so a rank holding E / ep experts receives at most about
    c N k rows from its ep peers, c times the mean; at ep 1 the rank keeps at most min(1, c) of its
    own (an upper bound where routing is uneven: what it drops depends on routing)."""
    slow = routing_imbalance(ep, shape.num_experts)
    return slow if shape.capacity_factor is None else min(slow, shape.capacity_factor)


def kept_share(shape: ModelShape) -> float:
    """The share of a rank's assignments it dispatches at most: min(1, c) under a capacity factor
    c (moe_collectives.assignments under uniform routing), all of them dropless."""
    return 1.0 if shape.capacity_factor is None else min(1.0, shape.capacity_factor)


def imbalance(shape: ModelShape, layout: Layout) -> float:
    """The allowance of the layout's expert-parallel ranks (busiest_rows)."""
    return busiest_rows(shape, layout.ep)


def recomputes_experts(recompute: str) -> bool:
    """Whether the routed experts and the all-to-alls run again in backward (module docstring)."""
    return recompute in ("full", "selective")


def moe_ffn_flops_per_token(shape: ModelShape, recompute: str, ep_imbalance: float = 1.0) -> float:
    """Hardware FLOPs of one MoE feed-forward per token on a rank (not split by TP): 6 x (router,
    shared experts and k routed experts; the routed ones x the imbalance allowance), and the
    forward again where it is recomputed (the routed experts under selective recomputation too
    when the grouped matmul runs them, whose outputs that policy does not save, unlike the loop's
    matmuls; the router and shared experts only under full)."""
    routed = 3 * shape.top_k * shape.hidden * shape.expert_ffn * ep_imbalance
    common = moe_mlp_params(shape)
    model = 6 * (common + routed)
    experts_again = recompute == "full" or (recompute == "selective" and shape.moe_grouped)
    again = 2 * routed * experts_again + 2 * common * (recompute == "full")
    return model + again


def all_to_all_payloads(shape: ModelShape, layout: Layout, act_bytes: int) -> list[tuple[float, bool]]:
    """(bytes one rank puts into it, whether it carries rows) of each all-to-all per MoE layer and
    micro-batch, in the order they run (module docstring), the rows dropless. Empty without expert
    parallelism."""
    if layout.ep == 1 or not shape.num_experts:
        return []
    rows = layout.tokens_per_microbatch / layout.cp * shape.top_k * shape.hidden
    forward = [(8.0 * shape.num_experts, False), (4.0 * rows, True), (act_bytes * rows, True)]
    backward = [(act_bytes * rows, True), (4.0 * rows, True)]
    return forward + backward + (forward if recomputes_experts(layout.recompute) else [])


def ep_levels(cluster: ClusterSpec, layout: Layout, intra: float, inter: float) -> tuple[placement.Level, ...]:
    """Where the expert-parallel group lands: the innermost ep of the data- and context-parallel
    ranks, its context-parallel ranks first (tp apart), then data-parallel ones (tp x cp x pp
    apart), as dptime.grad_levels places them."""
    in_cp = math.gcd(layout.ep, layout.cp)
    cp = placement.axis_levels(cluster, in_cp, layout.tp, intra, inter)
    return cp + placement.axis_levels(cluster, layout.ep // in_cp, layout.tp * layout.cp * layout.pp, intra, inter)


def expert_dp_levels(cluster: ClusterSpec, layout: Layout, intra: float, inter: float) -> tuple[
        tuple[placement.Level, ...], tuple[placement.Level, ...]]:
    """(edp_shard levels, edp_replicate levels): the ranks left beyond an ep group (ep_levels),
    the shard ones nearest, each group's ranks a whole ep group's span apart (the planner's
    placement of data parallelism outside tp x cp x pp)."""
    replicas, shards = layout.expert_split
    in_cp = math.gcd(layout.ep, layout.cp)
    stride = layout.tp * layout.cp * layout.pp * (layout.ep // in_cp) if layout.ep > in_cp else layout.tp * layout.ep
    shard = placement.axis_levels(cluster, shards, stride, intra, inter)
    return shard, placement.axis_levels(cluster, replicas, stride * shards, intra, inter)


def expert_dp_seconds(shape: ModelShape, layout: Layout, cluster: ClusterSpec, intra: float, inter: float,
                      experts: float, micro_s: float, backward_share: float, layers: int,
                      compute_bytes: float, grad_bytes: float) -> tuple[float, float]:
    """(exposed, total) seconds a step of the rank's `experts` routed-expert parameters (E / ep of
    each of its MoE layers) spends in the collectives of the ranks that hold the same experts, as
    gridtrain runs them (run_collectives.expert_collectives): per sync (every micro-batch without a
    pipeline, once with one) a reduce-scatter of their gradients over edp_shard and an all-reduce
    of the shard over edp_replicate, and their all-gathers in the compute dtype (ZeRO 2 once per
    sync, ZeRO 3 dptime.fsdp_gather_passes times), each overlapped with the compute of the pass it
    serves as dptime's FSDP collectives are; nothing when ep spans every data- and context-parallel
    rank (the experts are then each rank's own)."""
    from gridtrain.plan.dptime import fsdp_gather_passes, overlapped  # it imports memory, which imports this module

    if layout.ep == 1 or layout.dp * layout.cp == layout.ep or not experts:
        return 0.0, 0.0
    replicas, shards = layout.expert_split
    shard, rep = expert_dp_levels(cluster, layout, intra, inter)
    chunks, m = max(layers, 1), layout.num_microbatches
    syncs = 1 if layout.pp > 1 else m
    grads = experts * grad_bytes
    rs = placement.reduce_scatter_time(grads, shard, chunks) if shards > 1 else 0.0
    ag = placement.all_gather_time(experts * compute_bytes, shard, chunks) if shards > 1 else 0.0
    ar = placement.all_reduce_time(grads / shards, rep, chunks) if replicas > 1 else 0.0
    ag_forward, ag_backward = fsdp_gather_passes(layout, layers) if layout.zero_stage == 3 else (syncs, 0)
    backward = micro_s * backward_share
    forward = micro_s - backward
    exposed = (ag_forward * overlapped(ag, forward, chunks) + ag_backward * overlapped(ag, backward, chunks)
               + syncs * overlapped(rs + ar, backward, chunks))
    return exposed, (ag_forward + ag_backward) * ag + syncs * (rs + ar)


def ep_seconds(shape: ModelShape, layout: Layout, cluster: ClusterSpec, intra: float, inter: float,
               act_bytes: int = 2) -> float:
    """Seconds of all-to-all per MoE layer and micro-batch on the critical path: every call at
    the pace of the busiest rank, whose rows are the imbalance allowance over the mean (capped by
    a capacity factor: busiest_rows)."""
    levels = ep_levels(cluster, layout, intra, inter)
    slow = imbalance(shape, layout)
    return sum(placement.all_to_all_time(size * (slow if rows else 1.0), levels)
               for size, rows in all_to_all_payloads(shape, layout, act_bytes))


def ep_bytes_per_layer(shape: ModelShape, layout: Layout, act_bytes: int = 2) -> float:
    """Bytes one rank sends to other ranks per MoE layer and micro-batch: (ep - 1) / ep of every
    all-to-all's payload (its own share stays), at uniform routing, of the rows it keeps (kept_share)."""
    kept = kept_share(shape)
    return (sum(size * (kept if rows else 1.0) for size, rows in all_to_all_payloads(shape, layout, act_bytes))
            * (layout.ep - 1) / layout.ep)
