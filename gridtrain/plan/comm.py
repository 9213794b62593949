"""Collective costs (alpha-beta model) and the bytes each parallelism puts on each mesh axis.

Cost model: a collective over N ranks runs in steps; each step costs the per-step latency alpha
plus the bytes one rank sends in that step over its one-way bandwidth, derated by an achieved
efficiency (a rule of thumb: tuned NCCL all-reduce reaches ~78% of the link's bandwidth as bus
bandwidth). "Payload" is always the full, unsharded tensor: what all-reduce reduces, what
all-gather assembles.

| collective | steps | bytes a rank sends |
|---|---|---|
| ring all-reduce | 2(N-1) | 2(N-1)/N x payload |
| reduce-scatter, all-gather (ring) | N-1 | (N-1)/N x payload |
| tree all-reduce (binary, not pipelined) | 2 ceil(log2 N) | payload per step |
| all-to-all (pairwise) | N-1 | (N-1)/N x payload |
| point-to-point | 1 | payload |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gridtrain.plan.float8 import gathered_bytes
from gridtrain.plan.layout import Layout
from gridtrain.plan.memory import kv_heads_per_rank, rank_expert_params, rank_layers, rank_moe_layers, rank_params
from gridtrain.plan.shape import ModelShape
from gridtrain.plan.state import StateBytes

# Innermost (fastest links) to outermost: Llama 3 paper, section 3.3.2, orders the dimensions
# [TP, CP, PP, DP]. A common alternative is TP, PP, CP, DP; we follow the paper: CP's
# ring attention exchanges KV blocks in every layer of every micro-batch, far more often than
# PP's one activation per stage boundary.
AXIS_ORDER_INNER_TO_OUTER = ("tp", "cp", "pp", "dp")


@dataclass(frozen=True)
class Link:
    """What one rank sees of the network for one collective."""

    bytes_per_s: float
    """One-way bandwidth per rank, bytes/s."""
    latency_s: float = 0.0
    """Per-step latency alpha, s."""
    efficiency: float = 1.0
    """Achieved fraction of bytes_per_s (NCCL bus bandwidth / link bandwidth)."""

    @property
    def effective(self) -> float:
        return self.bytes_per_s * self.efficiency


def ring_all_reduce_bytes(payload: float, n: int) -> float:
    """Bytes one rank sends (and receives) in a ring all-reduce: 2(N-1)/N x payload
    (reduce-scatter (N-1)/N, then all-gather (N-1)/N). Worked example: N=8, 1 GB -> 1.75 GB."""
    return 2 * (n - 1) / n * payload if n > 1 else 0.0


def ring_all_reduce_time(payload: float, n: int, link: Link) -> float:
    """2(N-1) steps of payload/N each: 2(N-1)/N x payload / bw + 2(N-1) x alpha.
    Worked example: N=8, 2 GB, 50 GB/s -> 70 ms; 14 steps x 5 us = 70 us of latency."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1)
    return steps * (payload / n / link.effective + link.latency_s)


def reduce_scatter_time(payload: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of a `payload`-byte tensor: (N-1) steps of payload/N."""
    if n <= 1:
        return 0.0
    return (n - 1) * (payload / n / link.effective + link.latency_s)


def all_gather_time(payload: float, n: int, link: Link) -> float:
    """Ring all-gather assembling a `payload`-byte tensor: same cost as reduce-scatter."""
    return reduce_scatter_time(payload, n, link)


def tree_all_reduce_time(payload: float, n: int, link: Link) -> float:
    """Binary tree, reduce up then broadcast down, whole payload per step (not pipelined):
    2 ceil(log2 N) x (payload/bw + alpha). Worked example: 6 steps at N=8 against the ring's 14;
    the root link carries the whole payload each step, so the ring wins for large messages."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * (payload / link.effective + link.latency_s)


def all_to_all_time(payload: float, n: int, link: Link) -> float:
    """Pairwise all-to-all: each rank keeps 1/N of its `payload` bytes and sends the rest,
    (N-1)/N x payload in N-1 steps."""
    if n <= 1:
        return 0.0
    return (n - 1) * (payload / n / link.effective + link.latency_s)


def p2p_time(payload: float, link: Link) -> float:
    """One send/recv: payload/bw + alpha."""
    return payload / link.effective + link.latency_s


def bus_bandwidth(payload: float, seconds: float, n: int) -> float:
    """NCCL's all-reduce bus bandwidth: algorithm bandwidth (payload / time) x 2(N-1)/N, which
    makes it comparable with the link bandwidth whatever N is (nccl-tests, doc/PERFORMANCE.md)."""
    return payload / seconds * 2 * (n - 1) / n


@dataclass(frozen=True)
class HierarchicalTime:
    intra_first: float
    """Inside each node first (reduce-scatter or reduce), s."""
    inter: float
    """Across nodes, s: the phase the node boundary makes slow."""
    intra_last: float
    """Inside each node last (all-gather or broadcast), s."""

    @property
    def total(self) -> float:
        return self.intra_first + self.inter + self.intra_last


def hierarchical_all_reduce_time(payload: float, gpus_per_node: int, num_nodes: int,
                                 intra: Link, inter: Link, leader: bool = False) -> HierarchicalTime:
    """Two-level all-reduce across the node boundary.

    Default (NCCL/Horovod style): reduce-scatter inside the node, then each of the g GPUs
    all-reduces its 1/g shard with its peers in the other nodes over its own NIC (`inter` is per
    GPU), then all-gather inside the node. Inter-node bytes per GPU: 2(n-1)/n x payload/g.

    `leader=True` is the simpler leader-based version: reduce to one GPU per node, all-reduce the
    whole payload between nodes over `inter` (the node's link), broadcast inside the node. Worked
    example: 10B model (20 GB fp16), 8 nodes at 100 GB/s -> 2 x 20 x 7/8 / 100 = 350 ms across nodes.
    The node steps are a pipelined chain reduce to the leader and broadcast from it: the leader
    takes in (and every GPU receives) the whole payload, payload / bw each, plus the pipeline's
    fill of g-1 latencies.
    """
    g = gpus_per_node
    if leader:
        intra_phase = payload / intra.effective + (g - 1) * intra.latency_s if g > 1 else 0.0
        return HierarchicalTime(intra_phase, ring_all_reduce_time(payload, num_nodes, inter), intra_phase)
    return HierarchicalTime(reduce_scatter_time(payload, g, intra),
                            ring_all_reduce_time(payload / g, num_nodes, inter),
                            all_gather_time(payload, g, intra))


# ---- bytes per step on each mesh axis (per rank, ring algorithms) ----

def dp_bytes_per_step(param_bytes: float, n: int, zero_stage: int, num_microbatches: int = 1,
                      grad_bytes: float | None = None) -> float:
    """Bytes one data-parallel rank sends per optimizer step over the `n` ranks that shard
    (ZeRO 2/3) or replicate (0/1), following the ZeRO paper (Rajbhandari et al. 2020, sec. 7):

    - stage 0 (DDP), 1: gradients all-reduced once per step (accumulation under no_sync):
      2(n-1)/n x G. ZeRO-1 as a reduce-scatter of G plus an all-gather of updated parameters moves
      the same bytes. (torch's ZeroRedundancyOptimizer, which gridtrain uses, all-reduces G and
      then broadcasts each shard from its owner: 1/n x P more, not modelled here.)
    - stage 2: gradients reduce-scattered after every micro-batch (they cannot be accumulated
      unsharded), parameters all-gathered once after the step: (m + 1)(n-1)/n x payload.
    - stage 3: per micro-batch, all-gather of parameters in forward and again in backward, and a
      reduce-scatter of gradients: 3m(n-1)/n x payload, 1.5x DDP at m = 1 (ZeRO paper, sec. 7).
      The "3x DP" often quoted for FSDP counts DDP's all-reduce as one model size, not two.
    """
    g = param_bytes if grad_bytes is None else grad_bytes
    if n <= 1:
        return 0.0
    one_way = (n - 1) / n
    if zero_stage in (0, 1):
        return 2 * one_way * g
    if zero_stage == 2:
        return one_way * (num_microbatches * g + param_bytes)
    if zero_stage == 3:
        return one_way * num_microbatches * (2 * param_bytes + g)
    raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage}")


def hsdp_bytes_per_step(param_bytes: float, shard: int, replicate: int,
                        num_microbatches: int = 1) -> dict[str, float]:
    """HSDP: ZeRO-3 inside a shard group of `shard` ranks, then each rank all-reduces its 1/shard
    gradient slice with the `replicate` ranks holding the same slice, once per step.
    Returns bytes per rank per axis: {'dp_shard': ..., 'dp_replicate': ...}."""
    return {"dp_shard": dp_bytes_per_step(param_bytes, shard, 3, num_microbatches),
            "dp_replicate": ring_all_reduce_bytes(param_bytes / shard, replicate)}


def tp_bytes_per_layer(tokens: int, hidden: int, tp: int, act_bytes: int = 2,
                       recompute: bool = False) -> float:
    """Bytes one TP rank sends per layer per micro-batch of `tokens` (b x s / cp) tokens.

    Megatron (Shoeybi et al. 2019): forward all-reduces the (tokens, h) activation after attention
    and after the MLP (g), backward does the same for the input gradients (f): 4 all-reduces;
    full recomputation repeats the forward's 2. Sequence parallelism replaces each all-reduce by
    an all-gather plus a reduce-scatter of the same tensor: the same bytes (Korthikanti et al.)."""
    count = 6 if recompute else 4
    return count * ring_all_reduce_bytes(tokens * hidden * act_bytes, tp)


def moe_tp_bytes_per_layer(tokens: int, hidden: int, tp: int, act_bytes: int, recompute: str,
                           sequence_parallel: bool) -> float:
    """Bytes one TP rank sends per mixture-of-experts layer per micro-batch: the attention's 2
    all-reduces (3 with full recomputation; the mixture runs whole on every TP rank), and under
    sequence parallelism the mixture's all-gathers, (tp - 1) / tp of each gathered tensor: its fp32
    input forward (again where the forward is recomputed) and its output's gradient backward
    (parallel/tensor_parallel.moe_plan; steptime.layer_cost times the same)."""
    size = tokens * hidden
    out = (3 if recompute == "full" else 2) * ring_all_reduce_bytes(size * act_bytes, tp)
    if sequence_parallel:
        out += (tp - 1) / tp * size * (4 * (1 + (recompute != "none")) + act_bytes)
    return out


def pp_bytes_per_step(tokens: int, hidden: int, num_microbatches: int, virtual: int = 1,
                      act_bytes: int = 2, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes one pipeline rank sends per step: each of its `virtual` chunks sends its output
    activation (tokens x h) forward and an input gradient of the same size backward, per
    micro-batch: 2 m v x tokens x h x bytes (the first and last chunk of the pipeline send one way
    only). Interleaving multiplies the sends by v. With sequence parallelism the activation is
    already split over the TP ranks, so each sends 1/tp of it."""
    size = tokens * hidden * act_bytes / (tp if sequence_parallel else 1)
    return 2 * num_microbatches * virtual * size


def pp_total_bytes_per_step(activation_bytes: float, pp: int, num_microbatches: int,
                            virtual: int = 1) -> float:
    """All point-to-point bytes of one step over the whole pipeline: (pp x v - 1) stage boundaries,
    each crossed forward and backward by every micro-batch. Worked example: 500 MB, pp 4, m 12, v 4
    -> 15 x 24 x 0.5 GB = 180 GB. One pipeline rank sends nothing (its stages share the GPU)."""
    if pp <= 1:
        return 0.0
    return (pp * virtual - 1) * 2 * num_microbatches * activation_bytes


def ring_attention_payloads(tokens: int, kv_width: int, cp: int, act_bytes: int = 2, recompute: bool = False,
                            rotate: str = "ring") -> dict[str, float]:
    """Payload bytes one rank of a CP group issues per layer and micro-batch in gridtrain's ring
    attention (parallel/context_parallel.py), by kind as the accounting logs them. Each rank
    holds tokens/cp of the micro-batch's `tokens` (b x s); its keys and values, stacked at the
    KV-head count, are kv = 2 x tokens/cp x kv_width x act_bytes; their gradients travel in fp32
    (4/act_bytes x kv). Recomputation (full or selective) runs the forward, sends included, again.
    - ring: each forward sends kv to the next rank cp-1 times; backward sends kv cp-1 times again
      and its dK/dV accumulator cp times (after the last block it takes one more hop, home).
    - allgather: each forward and the backward all-gather kv (logged by the gathered cp x kv);
      backward's all-to-all hands every owner its cp gradient accumulators (cp x dKV in).
    Worked example (ring, 8192 tokens, kv_width 1024, cp 4, bf16): kv = 8 MiB; 2 x 3 x 8 MiB +
    4 x 16 MiB = 112 MiB per layer and micro-batch."""
    if cp <= 1:
        return {}
    kv = 2 * tokens / cp * kv_width * act_bytes
    grads, forwards = kv * 4 / act_bytes, 2 if recompute else 1
    if rotate == "allgather":
        return {"all_gather": (forwards + 1) * cp * kv, "all_to_all": cp * grads}
    return {"send": (forwards + 1) * (cp - 1) * kv + cp * grads}


def cp_bytes_per_layer(tokens: int, kv_width: int, cp: int, act_bytes: int = 2,
                       recompute: bool = False) -> float:
    """Bytes one rank puts on the wire per layer and micro-batch under ring attention
    (ring_attention_payloads: every ring payload is a point-to-point send).
    `tokens` is the whole micro-batch (b x s)."""
    return ring_attention_payloads(tokens, kv_width, cp, act_bytes, recompute).get("send", 0.0)


def ep_bytes_per_layer(tokens: int, hidden: int, top_k: int, ep: int, act_bytes: int = 2) -> float:
    """Expert parallelism: per MoE layer, one all-to-all dispatches each token's top_k copies to
    their experts and one combines the results (forward), and both again for the gradients
    (backward): 4 all-to-alls of tokens x top_k x h x bytes, each sending (ep-1)/ep of it (the
    textbook count; gridtrain's runtime dispatches the fp32 residual rows and exchanges the counts
    first: moe_cost.ep_bytes_per_layer)."""
    if ep <= 1:
        return 0.0
    return 4 * (ep - 1) / ep * tokens * top_k * hidden * act_bytes


def bytes_per_step(shape: ModelShape, layout: Layout, rank: int = 0, state: StateBytes = StateBytes(),
                   act_bytes: int = 2) -> dict[str, float]:
    """Bytes one GPU on pipeline rank `rank` sends per optimizer step, by mesh axis, from the
    per-axis functions above: 'dp' (stages 0/1: all-reduce over all DP ranks), or 'dp_shard' (under
    CP 'dp_shard_cp', FSDP's dp_shard x cp ranks) and 'dp_replicate' (stages 2/3, HSDP); 'tp' (4 or 6
    all-reduces per layer per micro-batch, an MoE layer's moe_tp_bytes_per_layer); 'pp' (activation sends); 'cp' (KV blocks); 'ep' (the
    expert-parallel all-to-alls of the rank's MoE layers), 'edp_shard' and 'edp_replicate' (the
    routed experts among the ranks holding the same ones, expert_dp_bytes). Axes of degree 1 are
    left out."""
    # Under expert parallelism the rank's experts are not the dense weights' business.
    params = rank_params(shape, layout, rank, rank_layers(shape, layout)[rank]) - (
        rank_expert_params(shape, layout, rank) if layout.ep > 1 else 0.0)
    layers, m = rank_layers(shape, layout)[rank], layout.num_microbatches
    weights = gathered_bytes(shape, params, layers, layout.tp, state.compute, layout.float8, layout.zero_stage,
                             layout.zero_shard_degree)
    grads = params * state.gradients
    tokens = layout.tokens_per_microbatch
    full = layout.recompute == "full"
    out: dict[str, float] = {}
    if layout.zero_stage in (0, 1) and layout.dp > 1:
        out["dp"] = dp_bytes_per_step(weights, layout.dp, layout.zero_stage, m, grads)
    elif layout.zero_stage in (2, 3):
        shards = layout.zero_shard_degree  # dp_shard x cp: FSDP shards over the CP ranks too
        if shards > 1:
            out["dp_shard_cp" if layout.cp > 1 else "dp_shard"] = dp_bytes_per_step(
                weights, shards, layout.zero_stage, m, grads)
        if layout.dp_replicate > 1:
            out["dp_replicate"] = ring_all_reduce_bytes(grads / shards, layout.dp_replicate)
    if layout.tp > 1:
        moe = rank_moe_layers(shape, layout, rank)
        dense = tp_bytes_per_layer(tokens // layout.cp, shape.hidden, layout.tp, act_bytes, full)
        out["tp"] = m * ((layers - moe) * dense + moe * moe_tp_bytes_per_layer(
            tokens // layout.cp, shape.hidden, layout.tp, act_bytes, layout.recompute, layout.sequence_parallel))
    if layout.pp > 1:
        out["pp"] = pp_bytes_per_step(tokens // layout.cp, shape.hidden, m, layout.pp_virtual_stages,
                                      act_bytes, layout.tp, layout.sequence_parallel)
    if layout.cp > 1:
        kv_width = kv_heads_per_rank(shape, layout.tp) * shape.head_dim
        out["cp"] = layers * m * cp_bytes_per_layer(tokens, kv_width, layout.cp, act_bytes,
                                                    layout.recompute != "none")
    if layout.ep > 1:
        from gridtrain.plan import moe_cost  # it prices its all-to-alls by placement, which imports this module

        out["ep"] = rank_moe_layers(shape, layout, rank) * m * moe_cost.ep_bytes_per_layer(shape, layout, act_bytes)
        out.update(expert_dp_bytes(shape, layout, rank, state))
    return out


def expert_dp_bytes(shape: ModelShape, layout: Layout, rank: int, state: StateBytes) -> dict[str, float]:
    """Bytes one GPU sends per step for its routed experts over the ranks that hold the same ones
    (gridtrain.layout.experts), by the ZeRO paper's arithmetic as dp_bytes_per_step: 'edp_shard'
    (FSDP's shards, ZeRO 2/3) and 'edp_replicate' (the shard's gradients all-reduced); none when ep
    spans every data- and context-parallel rank."""
    if layout.dp * layout.cp == layout.ep:
        return {}
    experts = rank_expert_params(shape, layout, rank)
    replicas, shards = layout.expert_split
    out = {}
    if shards > 1:
        out["edp_shard"] = dp_bytes_per_step(experts * state.compute, shards, layout.zero_stage,
                                             layout.num_microbatches, experts * state.gradients)
    if replicas > 1:
        out["edp_replicate"] = ring_all_reduce_bytes(experts * state.gradients / shards, replicas)
    return out


# ---- overlap of communication with compute ----

def exposed_after_compute(compute: list[float], comm: list[float]) -> float:
    """Bucketed DP all-reduce during backward: bucket i's collective starts when its gradients
    are ready (end of compute i) and when the previous collective is done (one comm stream).
    Returns the communication time left after the last compute: exposed on the critical path.
    Worked example: 40 layers x 5 ms backward, 1.5 ms per bucket -> 1.5 ms exposed of 60 ms (97.5% hidden)."""
    t_compute = t_comm = 0.0
    for c, k in zip(compute, comm, strict=True):
        t_compute += c
        t_comm = max(t_comm, t_compute) + k
    return max(0.0, t_comm - t_compute)


def exposed_before_compute(comm: list[float], compute: list[float], prefetch: int = 1) -> float:
    """FSDP forward with prefetch: block i's all-gather must finish before its compute; the
    all-gather of block i+prefetch may start once block i's compute starts (memory bounds the
    lookahead). Returns the time compute waits on communication."""
    comm_end: list[float] = []
    compute_start: list[float] = []
    t_compute = t_comm = 0.0
    for i, (k, c) in enumerate(zip(comm, compute, strict=True)):
        gate = compute_start[i - prefetch] if i >= prefetch else 0.0
        t_comm = max(t_comm, gate) + k
        comm_end.append(t_comm)
        start = max(t_compute, t_comm)
        compute_start.append(start)
        t_compute = start + c
    return t_compute - sum(compute)


def hidden_fraction(total_comm: float, exposed: float) -> float:
    """Share of the communication that compute hides."""
    return 1.0 - exposed / total_comm if total_comm else 1.0


def comm_compute_ratio(params: float, n: int, bytes_per_s: float, flops_per_step: float,
                       flops_per_s: float, grad_bytes: int = 2) -> float:
    """Communication-to-compute ratio: a ring all-reduce of the fp16 gradients over the DP group
    against the step's compute time (no overlap)."""
    comm = ring_all_reduce_bytes(params * grad_bytes, n) / bytes_per_s
    return comm / (flops_per_step / flops_per_s)
