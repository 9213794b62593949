"""Where each mesh axis lands on a cluster, and what a collective over it costs there.

The planner places the axes innermost (fastest links) to outermost as comm.AXIS_ORDER_INNER_TO_OUTER
says, tp, cp, pp, dp (Llama 3 paper, sec. 3.3.2), so the ranks of one group are `stride` GPUs apart,
stride being the product of the degrees inside it (tp: 1, cp: tp, pp: tp x cp, dp: tp x cp x pp;
HSDP's dp_shard sits inside dp_replicate). For 16 GPUs, 8 per node, tp 2, pp 2, dp 4:

    GPU:   0 1 2 3 4 5 6 7 | 8 9 ...
    tp:    0 1 0 1 0 1 0 1 | 0 1
    pp:    0 0 1 1 0 0 1 1 | 0 0
    dp:    0 0 0 0 1 1 1 1 | 2 2

A group of `degree` ranks splits into levels: the ranks that share a node (NVLink), then the nodes
that share a pod (full-bisection fabric, one NIC per GPU), then the pods (the fabric above them
oversubscribed, so each GPU gets inter-node bandwidth / oversubscription). A collective runs level
by level (two-level NCCL/Horovod style, generalized): reduce-scatter inside the innermost level,
the next level on 1/k of the payload, all-gather back. Each level costs the ring's bytes over its
link's achieved bandwidth. Each call adds its latency as NCCL's own tuning model prices it
(`nccl_latency`): a base plus one per-step latency for every step of the ring, NVLink or network,
so that a collective over 2,048 ranks pays 2,047 steps, and FSDP's per-layer calls pay it per layer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from gridtrain.plan import comm
from gridtrain.plan.specs import ClusterSpec

GB = 1e9


@dataclass(frozen=True)
class Level:
    ranks: int
    """Ranks of the group that meet at this level (k)."""
    link: comm.Link
    """Bandwidth per GPU one way, achieved efficiency, latency of one small collective."""
    name: str
    """'node', 'pod' or 'cluster'."""
    gloo_step_s: float | None = None
    """Gloo's measured per-step latency where the cluster's ranks talk over gloo (local CPU ranks:
    ClusterSpec.gloo_step_s); None: NCCL, priced by its tuning model."""


def _largest_divisor_at_most(n: int, bound: int) -> int:
    bound = max(1, min(n, bound))
    return max(d for d in range(1, bound + 1) if n % d == 0)


@functools.lru_cache(maxsize=4096)
def axis_levels(cluster: ClusterSpec, degree: int, stride: int, intra_efficiency: float,
                inter_efficiency: float) -> tuple[Level, ...]:
    """The levels a group of `degree` ranks, `stride` GPUs apart, spans on `cluster` (innermost
    first; levels of one rank are left out, so a group of one has none)."""
    g = cluster.gpus_per_node
    pod_gpus = g * cluster.nodes_per_pod if cluster.nodes_per_pod else math.inf
    intra = comm.Link(cluster.intra_node_gb_per_s * GB, cluster.intra_node_latency_s, intra_efficiency)
    inter = comm.Link(cluster.inter_node_gb_per_s * GB, cluster.inter_node_latency_s, inter_efficiency)
    cross = comm.Link(cluster.cross_pod_gb_per_s * GB, cluster.inter_node_latency_s, inter_efficiency)
    levels: list[Level] = []
    left, span = degree, stride
    in_node = _largest_divisor_at_most(left, g // span) if span < g else 1
    if in_node > 1:
        levels.append(Level(in_node, intra, "node", cluster.gloo_step_s))
    left, span = left // in_node, span * in_node
    if left > 1 and pod_gpus != math.inf:
        in_pod = _largest_divisor_at_most(left, int(pod_gpus // max(span, g)))
        if in_pod > 1:
            levels.append(Level(in_pod, inter, "pod", cluster.gloo_step_s))
        left //= in_pod
        if left > 1:
            levels.append(Level(left, cross, "cluster", cluster.gloo_step_s))
    elif left > 1:
        levels.append(Level(left, inter, "pod", cluster.gloo_step_s))
    return tuple(levels)


NCCL_BASE_S = 8.4e-6
"""NCCL's base latency of one call, ring and tree, Simple protocol (src/graph/tuning.cc, baseLat,
NCCL 2.2x): the protocol it picks for the megabyte-and-up buckets that gradients, FSDP's
gathers and TP's activations move."""
NCCL_RING_STEP_S = {"nvlink": 3.4e-6, "net": 14.0e-6}
"""Per ring step (hwLat, Ring, Simple): over NVLink, over the network. With one GPU per node NCCL
charges the tree's network latency, also 14 us."""
NCCL_TREE_STEP_S = {"nvlink": 4.0e-6, "net": 14.0e-6}
"""Per tree step (hwLat, Tree, Simple), for all-reduce only."""


NCCL_PAT_BANDWIDTH = 0.75
"""PAT (NCCL >= 2.23, all-gather and reduce-scatter with one GPU per node) reaches 0.75 of the
ring's bus bandwidth (busBw *= .75 in the tuning model)."""


def _ppn_nodes(levels: tuple[Level, ...]) -> tuple[int, int]:
    """(ranks per node, nodes) of a group: every node level's ranks share one node."""
    n = math.prod(level.ranks for level in levels)
    ppn = math.prod(level.ranks for level in levels if level.name == "node")
    return ppn, n // ppn


def nccl_latency(kind: str, levels: tuple[Level, ...]) -> float:
    """The latency NCCL's tuning model gives one call over the group (ncclTopoTuneModel, Simple
    protocol). Ring over n ranks on `nodes` nodes: n-1 steps (all-gather, reduce-scatter) or
    2(n-1) (all-reduce), of which nodes-1 (2(nodes-1)) cross the network; tree (all-reduce):
    2 ((n/nodes - 1) NVLink steps + floor(log2 nodes) network steps), NCCL taking the cheaper.
    Worked examples: an all-reduce over 8 in a node, 8.4 + 14 x 3.4 = 56 us; a ring all-gather
    over 2,048 ranks one per node, 8.4 + 2,047 x 14 us = 28.7 ms (NCCL picks PAT there instead:
    pat_latency). A cluster with its own per-step latency (gloo between local ranks) pays that
    on each of the ring's steps."""
    n = math.prod(level.ranks for level in levels)
    if n <= 1:
        return 0.0
    twice = 2 if kind == "all_reduce" else 1
    if levels[0].gloo_step_s is not None:
        return twice * (n - 1) * levels[0].gloo_step_s
    ppn, nodes = _ppn_nodes(levels)
    steps, net_steps = twice * (n - 1), twice * (nodes - 1)
    ring = NCCL_BASE_S + (steps - net_steps) * NCCL_RING_STEP_S["nvlink"] + net_steps * NCCL_RING_STEP_S["net"]
    if kind != "all_reduce":
        return ring
    tree = NCCL_BASE_S + 2 * ((ppn - 1) * NCCL_TREE_STEP_S["nvlink"]
                              + int(math.log2(nodes)) * NCCL_TREE_STEP_S["net"])
    return min(ring, tree)


def pat_latency(levels: tuple[Level, ...]) -> float | None:
    """PAT's latency for an all-gather or reduce-scatter with one rank per node (NCCL's tuning
    model: 8 us + floor(log2 nodes) x 14 / 3.5 us + 2.8 us per rank); None where NCCL does not run it."""
    n = math.prod(level.ranks for level in levels)
    if n <= 1 or levels[0].gloo_step_s is not None or _ppn_nodes(levels)[0] != 1:
        return None
    return 8e-6 + int(math.log2(n)) * NCCL_RING_STEP_S["net"] / 3.5 + 2.8e-6 * n


def _level_time(kind: str, payload: float, level: Level) -> float:
    link = comm.Link(level.link.bytes_per_s, 0.0, level.link.efficiency)
    if kind == "all_reduce":
        return comm.ring_all_reduce_time(payload, level.ranks, link)
    return comm.reduce_scatter_time(payload, level.ranks, link)


def _all_reduce_bytes_time(payload: float, levels: tuple[Level, ...]) -> float:
    if not levels:
        return 0.0
    if len(levels) == 1:
        return _level_time("all_reduce", payload, levels[0])
    inner = levels[0]
    edge = 2 * _level_time("reduce_scatter", payload, inner)
    return edge + _all_reduce_bytes_time(payload / inner.ranks, levels[1:])


def all_reduce_time(payload: float, levels: tuple[Level, ...], calls: int = 1) -> float:
    """All-reduce of a `payload`-byte tensor over the levels, in `calls` equal collectives:
    reduce-scatter inside the innermost, all-reduce of payload/k over the rest, all-gather back
    (inter-level bytes per GPU shrink by k), plus each call's latency."""
    return _all_reduce_bytes_time(payload, levels) + calls * nccl_latency("all_reduce", levels)


def all_gather_time(payload: float, levels: tuple[Level, ...], calls: int = 1) -> float:
    """All-gather of a `payload`-byte tensor in `calls` collectives, level by level, plus each
    call's latency; with one rank per node NCCL's PAT where its lower latency beats its lower
    bandwidth (NCCL picks by time)."""
    wire = 0.0
    for level in levels:
        wire += _level_time("reduce_scatter", payload, level)
        payload /= level.ranks
    ring = wire + calls * nccl_latency("all_gather", levels)
    pat = pat_latency(levels)
    return ring if pat is None else min(ring, wire / NCCL_PAT_BANDWIDTH + calls * pat)


def reduce_scatter_time(payload: float, levels: tuple[Level, ...], calls: int = 1) -> float:
    """Reduce-scatter: the all-gather's cost, but over gloo (local ranks), which has none: there
    FSDP all-reduces the gradients (run_collectives), at an all-reduce's cost."""
    if levels and levels[0].gloo_step_s is not None:
        return all_reduce_time(payload, levels, calls)
    return all_gather_time(payload, levels, calls)


def all_to_all_time(payload: float, levels: tuple[Level, ...]) -> float:
    """An all-to-all in which each rank sends `payload` bytes spread evenly over the group's n ranks
    (1/n to each, its own share staying): the share for ranks first reached at a level, (c_i -
    c_{i-1}) / n with c_i the ranks within that level, crosses that level's link, all levels at
    once (NCCL posts every send together), so the slowest level sets the time, plus NCCL's base
    latency and one step of the slowest link. Over gloo (local ranks) the n - 1 exchanges run one
    after another. Worked example: 64 ranks, 8 per node, 1 GB each: 7/64 GB over NVLink and 56/64
    over the NIC, which sets the pace. Levels of one kind (an expert-parallel group's context- and
    data-parallel parts both inside a node, or both across nodes) share their link: their shares add."""
    n = math.prod(level.ranks for level in levels)
    if n <= 1:
        return 0.0
    wires: dict[str, float] = {}  # by link: two levels of one kind (an EP group's CP and DP parts) share it
    inner = 1
    for level in levels:
        share = payload * (inner * level.ranks - inner) / n
        wires[level.name] = wires.get(level.name, 0.0) + share / level.link.effective
        inner *= level.ranks
    if levels[0].gloo_step_s is not None:
        return sum(wires.values()) + (n - 1) * levels[0].gloo_step_s
    step = NCCL_RING_STEP_S["net" if any(level.name != "node" for level in levels) else "nvlink"]
    return max(wires.values()) + NCCL_BASE_S + step


def p2p_time(payload: float, cluster: ClusterSpec, degree: int, stride: int, intra_efficiency: float,
             inter_efficiency: float) -> float:
    """One send between neighbours of a group of `degree` ranks `stride` GPUs apart (a pipeline,
    a ring-attention ring), at the pace of its slowest hop: NVLink when the whole group is inside
    a node, the NIC when it stays inside a pod, the oversubscribed fabric otherwise."""
    g = cluster.gpus_per_node
    pod_gpus = g * cluster.nodes_per_pod if cluster.nodes_per_pod else math.inf
    span = degree * stride
    if span <= g:
        link = comm.Link(cluster.intra_node_gb_per_s * GB, cluster.intra_node_latency_s, intra_efficiency)
    elif span <= pod_gpus:
        link = comm.Link(cluster.inter_node_gb_per_s * GB, cluster.inter_node_latency_s, inter_efficiency)
    else:
        link = comm.Link(cluster.cross_pod_gb_per_s * GB, cluster.inter_node_latency_s, inter_efficiency)
    return comm.p2p_time(payload, link)


def describe_levels(levels: tuple[Level, ...]) -> str:
    """'8 in a node (NVLink 300 GB/s) x 16 across nodes (50 GB/s)'; 'one rank' when empty."""
    if not levels:
        return "one rank"
    where = {"node": "in a node", "pod": "across nodes", "cluster": "across pods"}
    return " x ".join(f"{lv.ranks} {where[lv.name]} ({lv.link.bytes_per_s / GB:g} GB/s)" for lv in levels)
