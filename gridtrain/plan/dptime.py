"""Data-parallel communication in the step: where its groups land, how often gridtrain's runtime
issues each collective, and how much of it the compute hides (steptime.py's DP term).

- DP: ZeRO 0/1 all-reduce gradients once, in buckets overlapped with the last micro-batch's
  backward; ZeRO 2 reduce-scatters every micro-batch (overlapped with its backward) and all-gathers
  the parameters once (prefetched behind the first forward); ZeRO 3 all-gathers every block in
  forward (prefetched) and backward and reduce-scatters its gradients (overlapped); HSDP adds the
  replicate axis's all-reduce of the 1/shard slice. Under expert parallelism a rank's experts
  are not the dense weights' business: reduced only among the ranks that hold the same experts
  (moe_cost.expert_dp_seconds), not at all when ep spans every data- and context-parallel rank.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from gridtrain.layout.schedules import schedule
from gridtrain.plan import placement
from gridtrain.plan.float8 import gathered_bytes
from gridtrain.plan.layout import Layout
from gridtrain.plan.memory import (DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, edge_ranks, rank_expert_params,
                                  rank_params)
from gridtrain.plan.shape import ModelShape
from gridtrain.plan.specs import ClusterSpec
from gridtrain.plan.state import StateBytes

if TYPE_CHECKING:
    from gridtrain.plan.steptime import Efficiency, PipelineTime


def overlapped(comm_s: float, compute_s: float, chunks: int) -> float:
    """Communication left exposed when it is issued in `chunks` equal buckets, each after (or,
    prefetched, before) an equal slice of `compute_s`: the closed form of
    comm.exposed_after_compute for uniform lists, max(one bucket, comm - compute + one slice)."""
    if comm_s <= 0:
        return 0.0
    return max(comm_s / chunks, comm_s - compute_s + compute_s / chunks)


def grad_levels(layout: Layout, cluster: ClusterSpec, eff: Efficiency) -> tuple[
        tuple[placement.Level, ...], tuple[placement.Level, ...]]:
    """(shard levels, replicate levels) of the gradient reduction. Context-parallel ranks hold the
    same weights, so their gradients are summed too: under ZeRO 2/3 FSDP shards over dp_shard x cp
    (as gridtrain's runtime and torchtitan do; the cp axis innermost), under ZeRO 0/1 the cp axis
    joins the all-reduce over DP."""
    cp = placement.axis_levels(cluster, layout.cp, layout.tp, eff.intra_node, eff.inter_node)
    inner = layout.tp * layout.cp * layout.pp
    if layout.zero_stage in (0, 1):
        return (), cp + placement.axis_levels(cluster, layout.dp, inner, eff.intra_node, eff.inter_node)
    shard = placement.axis_levels(cluster, layout.dp_shard, inner, eff.intra_node, eff.inter_node)
    rep = placement.axis_levels(cluster, layout.dp_replicate, inner * layout.dp_shard,
                                eff.intra_node, eff.inter_node)
    return cp + shard, rep


def dp_time(shape: ModelShape, layout: Layout, cluster: ClusterSpec, eff: Efficiency, pt: PipelineTime,
            state: StateBytes = StateBytes()) -> tuple[float, float]:
    """(exposed, total) seconds of data-parallel communication per step on the critical rank, the
    exposed part with the compute the hidden part slows down (Efficiency.overlap_slowdown); with
    the routed experts' own collectives where ep leaves data-parallel ranks over (moe_cost)."""
    exposed, total = _dp_overlap(shape, layout, cluster, eff, pt, state)
    if layout.ep > 1:
        from gridtrain.plan.moe_cost import expert_dp_seconds  # it imports this module's importers

        more = expert_dp_seconds(shape, layout, cluster, eff.intra_node, eff.inter_node,
                                 rank_expert_params(shape, layout, pt.critical_rank), pt.micro_s,
                                 pt.layer.backward_share, pt.layers, state.compute, state.gradients)
        host = expert_fsdp_calls(layout, pt.moe_layers) * eff.fsdp_call_s
        exposed, total = exposed + more[0] + host, total + more[1] + host
    return exposed + eff.overlap_slowdown * (total - exposed), total


def expert_fsdp_calls(layout: Layout, moe_layers: int) -> int:
    """FSDP collective calls of the experts' own units (one per MoE layer) where ep leaves data-
    parallel ranks over (gridtrain.layout.experts), as fsdp_calls counts a block's: all-gathers
    and reduce-scatters over edp_shard when it has several ranks, an all-reduce per sync over
    edp_replicate when it has several."""
    if layout.ep == 1 or layout.dp * layout.cp == layout.ep:
        return 0
    replicas, shards = layout.expert_split
    syncs = 1 if layout.pp > 1 else layout.num_microbatches
    gathers = (round(sum(fsdp_gather_passes(layout, moe_layers))) if layout.zero_stage == 3 else syncs) if shards > 1 else 0
    return moe_layers * (gathers + syncs * ((shards > 1) + (replicas > 1)))


def ddp_buckets(grad_bytes: float) -> int:
    """All-reduce calls DDP makes for `grad_bytes` of gradients: a first bucket of 1 MiB, then 25 MiB each."""
    return 1 + max(0, math.ceil((grad_bytes - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES))


def fsdp_gather_passes(layout: Layout, layers: int) -> tuple[float, float]:
    """(forward, backward) all-gathers of the weights of a rank holding `layers` blocks, per step
    under ZeRO-3, in passes over all of them, as gridtrain's runtime makes them (fsdp_calls, counted
    by dry runs): without a pipeline every micro-batch gathers in forward and again in backward.
    Under a pipeline, every schedule keeps each stage's last block gathered from its first forward
    to its last backward (one gather a step), and gathers every other block in each micro-batch's
    forward and once in backward: a rank of s stages holds min(layers, s) kept blocks, and the
    rest, a share n of its weights, make n x m + (1 - n) forward passes and n backward ones. (With
    one block a stage, as Llama 3 405B's interleaved stages mostly have, one pass a step; with two
    blocks a stage under interleaved 1F1B, the dry run's all-gather bytes grow with m: 39.1 MB at 4
    micro-batches, 65.6 MB at 8, where one pass each way was assumed before.)"""
    m = layout.num_microbatches
    if layout.pp == 1:
        return m, m
    normal = (layers - kept_blocks(layout, layers)) / max(layers, 1)
    return normal * m + (1 - normal), normal


def kept_blocks(layout: Layout, layers: int) -> int:
    """Blocks of a rank holding `layers` that ZeRO-3 keeps gathered from forward to backward: each
    stage's last, one per stage the rank holds under its schedule (one without a pipeline)."""
    stages = schedule(layout.pp_schedule).virtual(layout.pp_virtual_stages) if layout.pp > 1 else 1
    return min(layers, stages)


def step_sync_seconds(layout: Layout, cluster: ClusterSpec, eff: Efficiency) -> float:
    """The small all-reduces the trainer makes every step beside the gradients': the global loss
    over each of the pipeline, data- and context-parallel axes it spans, and the world's roll call
    for a stop signal (train/trainer.py), each priced as a ring all-reduce at the cluster's
    latency per step. A GPU pays it in microseconds. On CPU ranks (plan/local.py) that latency is
    a 16 KB all-reduce's, which over-prices these one-element ones where the ranks outnumber the
    cores: over 4 processes on 2 cores a 16 KB all-reduce took 4.7 ms here, a one-element one
    0.35 ms (over 2 processes 0.2 and 0.1 ms). Left out: the gradient norm's (parallel/grads.py:
    one over pp, and DTensor's, one per mesh axis a group of like-placed gradients is sharded
    over; dry runs of the tiny model count 1 over the FSDP shard axis, and with TP 3 there and 2
    over tp), fp16's overflow check and a mixture of experts' balance statistics."""
    if layout.num_gpus == 1:
        return 0.0
    inner = {"cp": layout.tp, "dp": layout.tp * layout.cp, "pp": layout.tp * layout.cp * layout.dp}
    groups = [(degree, inner[axis]) for axis, degree in (("pp", layout.pp), ("dp", layout.dp), ("cp", layout.cp))
              if degree > 1] + [(layout.num_gpus, 1)]
    return sum(placement.all_reduce_time(8, placement.axis_levels(cluster, degree, stride, eff.intra_node,
                                                                  eff.inter_node)) for degree, stride in groups)


def fsdp_calls(layout: Layout, layers: int, pp_rank: int = 0, tied: bool = False) -> int:
    """FSDP collective calls a step issues on pipeline rank `pp_rank` holding `layers` blocks, unit
    by unit as parallel/data_parallel.apply_fsdp makes them (counted by dry runs of the tiny model:
    `gridtrain train --dry-run`'s comm/*_calls, ZeRO 2 and 3, HSDP, tied, GPipe, 1F1B, interleaved
    1F1B, looped BFS, ZB-V and interleaved ZB): each block a unit; the embedding one gathered in
    forward only; the final norm with the head one kept gathered from forward to backward, as is
    each stage's last block; a tied head (pp 1) and its embedding in the root unit, gathered like a
    block. Per sync (each micro-batch, once per step under a pipeline) every unit is reduce-
    scattered, all-reduced over dp_replicate too under HSDP, and all-reduced alone under FSDP
    replication (ZeRO-0 beside TP or PP). ZeRO 2 gathers every unit once per sync; ZeRO 3 gathers
    a kept unit and the embedding in every micro-batch's forward (once a step for kept units under a
    pipeline, which keeps them gathered until the last backward), and any other unit in forward
    and backward of every micro-batch without a pipeline, in every forward and once in backward
    with one (every schedule, the split-backward ones too). 0 under DDP."""
    if layout.dp * layout.cp == 1 or layout.zero_stage == 1 or (
            layout.zero_stage == 0 and layout.tp == 1 and layout.pp == 1 and layout.ep == 1):
        return 0  # DDP (ZeRO-1 runs without TP, PP and experts only)
    first, last = edge_ranks(layout)
    kept = kept_blocks(layout, layers)
    normal, forward_only = layers - kept, 0
    if tied and layout.pp == 1:
        normal += 1  # the root unit: embedding, final norm and head
    else:
        forward_only, kept = int(pp_rank == first), kept + int(pp_rank == last)
    m, units = layout.num_microbatches, normal + kept + forward_only
    syncs = 1 if layout.pp > 1 else m
    if layout.zero_stage == 0:
        return syncs * units
    reductions = syncs * units * (2 if layout.dp_replicate > 1 else 1)
    if layout.zero_stage == 2:
        return syncs * units + reductions
    if layout.pp == 1:
        return m * (2 * normal + kept + forward_only) + reductions
    return (m + 1) * normal + kept + m * forward_only + reductions


def _dp_overlap(shape: ModelShape, layout: Layout, cluster: ClusterSpec, eff: Efficiency, pt: PipelineTime,
                state: StateBytes) -> tuple[float, float]:
    """(exposed, total) seconds of data-parallel communication per step on the critical rank,
    whose P parameters (this pipeline rank's, 1/tp of each matrix) weigh G = P x gradient bytes
    and W = P x weight bytes, each collective as often as gridtrain's runtime issues it. Gradients
    are reduced once per micro-batch without a pipeline and once per step with one (syncs).
    DDP (ZeRO 0/1 on DP alone): one all-reduce of G over cp x dp in its buckets, and ZeRO-1's
    broadcast of the updated parameters after the step (the bytes of an all-gather of P in fp32).
    FSDP replication (ZeRO-0 beside TP or PP): an all-reduce of G per sync. ZeRO 2: per sync an
    all-gather of W and a reduce-scatter of G over dp_shard (x cp). ZeRO 3: W gathered
    fsdp_gather_passes times, G reduce-scattered per sync. ZeRO 2/3 add an all-reduce of the
    shard G / (dp_shard x cp) over dp_replicate per sync (HSDP). FSDP's collectives are issued
    unit by unit (one per layer), DDP's bucket by bucket; every call pays its latency."""
    if layout.dp * layout.cp == 1:
        return 0.0, 0.0
    host = fsdp_calls(layout, pt.layers, pt.critical_rank, shape.tie_embeddings) * eff.fsdp_call_s
    exposed, total = _dp_wire(shape, layout, cluster, eff, pt, state)
    return exposed + host, total + host


def _dp_wire(shape: ModelShape, layout: Layout, cluster: ClusterSpec, eff: Efficiency, pt: PipelineTime,
             state: StateBytes) -> tuple[float, float]:
    """_dp_overlap's collectives on the wire, without FSDP's host time per call."""
    # Under expert parallelism a rank's experts are its own: neither gathered nor reduced.
    params = rank_params(shape, layout, pt.critical_rank, pt.layers) - (
        rank_expert_params(shape, layout, pt.critical_rank) if layout.ep > 1 else 0.0)
    weights = gathered_bytes(shape, params, pt.layers, layout.tp, state.compute, layout.float8, layout.zero_stage,
                             layout.zero_shard_degree)
    grads = params * state.gradients
    m, chunks = layout.num_microbatches, max(pt.layers, 1)
    syncs = 1 if layout.pp > 1 else m
    backward = pt.micro_s * pt.layer.backward_share
    forward = pt.micro_s - backward
    shard, rep = grad_levels(layout, cluster, eff)
    if layout.zero_stage in (0, 1):
        if layout.zero_stage == 0 and (layout.tp > 1 or layout.pp > 1):
            passes = 1 if eff.grads_once_per_step else syncs
            one = placement.all_reduce_time(grads, rep, chunks)
            return passes * overlapped(one, backward, chunks), passes * one
        calls = ddp_buckets(grads)
        total = placement.all_reduce_time(grads, rep, calls)
        exposed = overlapped(total, backward, min(calls, chunks))
        if layout.zero_stage == 1:
            after = placement.all_gather_time(params * 4, rep, chunks)
            return exposed + after, total + after
        return exposed, total
    rs = placement.reduce_scatter_time(grads, shard, chunks)
    ag = placement.all_gather_time(weights, shard, chunks)
    ar = placement.all_reduce_time(grads / layout.zero_shard_degree, rep, chunks)
    if layout.zero_stage == 2:
        exposed = syncs * overlapped(ag, forward, chunks) + (syncs - 1) * overlapped(rs + ar, backward, chunks)
        return exposed + overlapped(rs + ar, backward, chunks), syncs * (ag + rs + ar)
    ag_forward, ag_backward = fsdp_gather_passes(layout, pt.layers)
    if layout.pp == 1:  # each micro-batch's backward gathers, reduces and (HSDP) all-reduces
        exposed = m * overlapped(ag, forward, chunks) + m * overlapped(ag + rs + ar, backward, chunks)
        return exposed, m * (2 * ag + rs + ar)
    exposed = ag_forward * overlapped(ag, forward, chunks) + overlapped(ag_backward * ag + rs + ar, backward, chunks)
    return exposed, (ag_forward + ag_backward) * ag + rs + ar
