"""Step-time model: its parts against hand-derived numbers, its closed forms against the
general functions they stand for, and where each mesh axis lands on a cluster."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gridtrain.model.args import llama3_8b, llama3_405b
from gridtrain.plan import comm, dptime, flops, placement, shape, specs, steptime
from gridtrain.plan.layout import Layout
from gridtrain.plan.memory import layer_activation_bytes
from gridtrain.plan.pipeline import bubble_fraction

approx = pytest.approx
GB = 1e9
DGX = specs.cluster("dgx-h100")
EFF = steptime.CALIBRATED


@pytest.mark.parametrize("model", [shape.from_args(llama3_8b()), shape.gpt(4096, 36, 32)])
@pytest.mark.parametrize("recompute", ["none", "selective", "attention", "full"])
def test_layer_flops_add_up_to_hardware_flops(model, recompute):
    # L layers plus the head (forward + backward, never recomputed) = flops.hardware_flops_per_token.
    per_layer = steptime.layer_hardware_flops_per_token(model, 2048, recompute)
    total = model.num_layers * per_layer + steptime.edge_flops_per_token(model)
    assert total == approx(flops.hardware_flops_per_token(model, 2048, recompute), rel=1e-12)


@pytest.mark.parametrize("comm_s, compute_s, chunks", [(1.0, 5.0, 10), (10.0, 5.0, 10), (3.0, 3.0, 4), (7, 2, 3)])
def test_overlap_closed_form(comm_s, compute_s, chunks):
    # The closed form equals the bucket-by-bucket timelines of comm.py for equal buckets, both after
    # compute (DDP buckets in backward) and before it (FSDP prefetch in forward).
    got = dptime.overlapped(comm_s, compute_s, chunks)
    after = comm.exposed_after_compute([compute_s / chunks] * chunks, [comm_s / chunks] * chunks)
    before = comm.exposed_before_compute([comm_s / chunks] * chunks, [compute_s / chunks] * chunks)
    assert got == approx(after) and got == approx(before)
    assert dptime.overlapped(0.0, 1.0, 4) == 0.0


def test_axis_levels_on_grand_teton():
    # 8 GPUs per node, 384 nodes (3,072 GPUs) per pod, 1:7 between pods.
    tp = placement.axis_levels(DGX, 8, 1, 0.6, 0.8)
    assert [(lv.ranks, lv.name) for lv in tp] == [(8, "node")]
    # dp 128 at stride 128 (tp 8 x pp 16): no two in a node; 3,072 / 128 = 24 per pod, so the
    # largest divisor of 128 that fits, 16, shares a pod and 8 pods remain.
    dp = placement.axis_levels(DGX, 128, 128, 0.6, 0.8)
    assert [(lv.ranks, lv.name) for lv in dp] == [(16, "pod"), (8, "cluster")]
    assert dp[1].link.bytes_per_s == approx(50 * GB / 7)
    # dp 16 at stride 2 (tp 2): 4 share a node, 4 nodes.
    assert [(lv.ranks, lv.name) for lv in placement.axis_levels(DGX, 16, 2, 0.6, 0.8)] == [(4, "node"), (4, "pod")]
    assert placement.axis_levels(DGX, 1, 8, 0.6, 0.8) == ()


def test_hierarchical_time_equals_comm():
    # Bandwidth-wise, two levels are comm.hierarchical_all_reduce_time (reduce-scatter in the
    # node, all-reduce of 1/g across nodes, all-gather back).
    flat = replace(DGX, nodes_per_pod=0)
    levels = placement.axis_levels(flat, 32, 1, 0.6, 0.8)
    assert [lv.ranks for lv in levels] == [8, 4]
    intra, inter = comm.Link(450 * GB, 0, 0.6), comm.Link(50 * GB, 0, 0.8)
    expected = comm.hierarchical_all_reduce_time(4 * GB, 8, 4, intra, inter).total
    # plus one call's latency by NCCL's model: the tree's 8.4 + 2 x (7 NVLink steps x 4 + 2 network
    # steps x 14) us = 120.4 us beats the ring's 8.4 + 56 x 3.4 + 6 x 14 = 282.8 us
    assert placement.all_reduce_time(4 * GB, levels) == approx(expected + 120.4e-6)
    # One level is a ring plus its 14 NVLink steps' latency; in 10 calls, ten times the latency.
    one = placement.axis_levels(DGX, 8, 1, 0.6, 0.8)
    ring = comm.ring_all_reduce_time(1 * GB, 8, comm.Link(450 * GB, 0, 0.6))
    assert placement.all_reduce_time(1 * GB, one) == approx(ring + 8.4e-6 + 14 * 3.4e-6)
    assert placement.all_reduce_time(1 * GB, one, 10) == approx(ring + 10 * (8.4e-6 + 14 * 3.4e-6))


def test_p2p_link_follows_the_slowest_hop():
    t = placement.p2p_time(1 * GB, DGX, 4, 2, 0.6, 0.8)  # 4 ranks 2 apart: inside a node
    assert t == approx(1 / (450 * 0.6) + 13e-6)
    t = placement.p2p_time(1 * GB, DGX, 4, 4, 0.6, 0.8)  # spans two nodes
    assert t == approx(1 / (50 * 0.8) + 55e-6)
    t = placement.p2p_time(1 * GB, DGX, 16, 1024, 0.6, 0.8)  # 16,384 GPUs: across pods
    assert t == approx(1 / (50 / 7 * 0.8) + 55e-6)


def test_single_gpu_step_by_hand():
    # One GPU, no parallelism: step = m x (L x layer + head) + optimizer, every part by hand.
    s = shape.from_args(llama3_8b())
    lay = Layout(micro_batch=1, seq_len=4096, num_microbatches=4, zero_stage=0, recompute="selective")
    st = steptime.step_time(s, lay, DGX)
    acc = DGX.accelerator
    tokens = 4096
    matmul = steptime.layer_hardware_flops_per_token(s, 4096, "selective") * tokens / (acc.peak_flops * EFF.matmul)
    saved = layer_activation_bytes(s, 4096, 1, recompute="none")
    kept = layer_activation_bytes(s, 4096, 1, recompute="selective")
    bound = (4 * saved + 2 * (saved - kept)) / (acc.hbm_gb_per_s * GB * EFF.hbm)
    layer = matmul + bound + EFF.layer_overhead_s
    head = (steptime.edge_flops_per_token(s) * tokens / (acc.peak_flops * EFF.matmul)
            + 4 * 4 * tokens * s.vocab / (acc.hbm_gb_per_s * GB * EFF.hbm))
    n = shape.param_counts(s).total
    optimizer = n * (2 + 2 + 24) / (acc.hbm_gb_per_s * GB * EFF.hbm)
    assert st.compute_s == approx(4 * (32 * layer + head))
    assert st.optimizer_s == approx(optimizer)
    assert st.tp_s == st.cp_s == st.pp_s == st.bubble_s == st.dp_s == 0
    total = 4 * (32 * layer + head) + optimizer
    assert st.total_s == approx(total)
    # Throughput: 4 micro-batches of 4,096 tokens in the hand-derived step.
    assert st.tokens_per_s == approx(4 * 4096 / total)
    # Utilization on one H100 SXM (989 TFLOP/s dense bf16). N of Llama 3 8B, every parameter but
    # the input embedding (norms included, as gridtrain counts them): 32 blocks of
    # 4096 x (2 x 4096 + 2 x 1024) + 3 x 4096 x 14336 + 2 x 4096, the final norm's 4096 and the
    # head's 128,256 x 4096: 7,504,924,672. Model FLOPs per token 6N + 12 L H Q T with L = 32,
    # H = 32, Q = 128, T = 4096; gridtrain's selective recomputation keeps the matmuls' and the
    # attention core's outputs: no FLOPs repeated, HFU = MFU.
    matmul_params = 32 * (4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14336 + 2 * 4096) + 4096 + 128_256 * 4096
    model_fpt = 6 * matmul_params + 12 * 32 * 32 * 128 * 4096
    hardware_fpt = model_fpt
    assert st.mfu == approx(4 * 4096 / total * model_fpt / 989e12)
    assert st.hfu == approx(4 * 4096 / total * hardware_fpt / 989e12)


def test_tp_and_bubble_by_hand():
    s = shape.from_args(llama3_405b())
    lay = Layout(tp=8, pp=16, dp_replicate=128, micro_batch=1, seq_len=8192, num_microbatches=16,
                 pp_schedule="interleaved-1f1b", pp_virtual_stages=2, sequence_parallel=True, recompute="full")
    pt = steptime.pipeline_time(s, lay, DGX, EFF)
    # TP: 6 all-reduces (full recomputation) of 8,192 x 16,384 x 2 bytes per layer, ring of 8 on NVLink,
    # each call NCCL's 8.4 us + 14 ring steps x 3.4 us.
    one = 2 * 7 / 8 * (8192 * 16384 * 2) / (450 * GB * EFF.intra_node) + 8.4e-6 + 14 * 3.4e-6
    assert pt.layer.tp_s == approx(6 * one)
    # Bubble: interleaved 1F1B's (p-1)/v = 7.5 micro-batches of idle time (Narayanan et al.; m a
    # multiple of p, where torch's order replayed gives the same), beside m = 16 of work: f / (1 - f) of it.
    assert bubble_fraction(16, 16, 2, "interleaved-1f1b") == approx(7.5 / (16 + 7.5))
    f = 7.5 / (16 + 7.5)
    assert pt.bubble_s == approx(f / (1 - f) * 16 * pt.micro_s)
    # Pipeline sends: 2 per micro-batch per chunk, 1/tp of the activation, between nodes (the 16
    # stages are 16 consecutive nodes, tp inside each: one pod).
    send = 8192 * 16384 * 2 / 8 / (50 * GB * EFF.inter_node) + 55e-6
    assert pt.pp_s == approx(2 * 16 * 2 * send)
    # 126 layers in 32 stages: the middle ranks hold 8, and set the pace.
    assert pt.layers == 8 and pt.micro_s == approx(8 * pt.layer.total_s)


def test_dp_hides_behind_backward():
    # ZeRO-1 over 8 ranks in one node: gradients all-reduced in per-layer buckets during the last
    # micro-batch's backward; what is left is the last bucket when every bucket fits its layer.
    s = shape.from_args(llama3_8b())
    lay = Layout(dp_replicate=8, zero_stage=1, micro_batch=1, seq_len=8192, num_microbatches=8)
    st = steptime.step_time(s, lay, DGX)
    grads = shape.param_counts(s).total * 2
    # DDP's buckets: 1 MiB, then 25 MiB each, one all-reduce call apiece, each NCCL's 8.4 us +
    # 14 ring steps x 3.4 us
    calls = 1 + math.ceil((grads - 2**20) / (25 * 2**20))
    assert calls == 614
    total = 2 * 7 / 8 * grads / (450 * GB * EFF.intra_node) + calls * (8.4e-6 + 14 * 3.4e-6)
    # then ZeRO-1's broadcast of the updated fp32 parameters (an all-gather's bytes, one call per
    # layer), after the step
    after = 7 / 8 * grads * 2 / (450 * GB * EFF.intra_node) + 32 * (8.4e-6 + 7 * 3.4e-6)
    assert st.dp_total_s == approx(total + after)
    # the all-reduce overlapped layer by layer: the last layer's share waited for, the rest slowing
    # the backward beside it by 0.35 s a second
    assert st.dp_s == approx(total / 32 + 0.35 * total * 31 / 32 + after)
    # ZeRO-3 moves 1.5x the bytes and exposes more.
    z3 = steptime.step_time(s, replace(lay, zero_stage=3, dp_replicate=1, dp_shard=8), DGX)
    wire = 2 * 7 / 8 * grads / (450 * GB * EFF.intra_node)
    assert z3.dp_total_s > 1.4 * 8 * wire and z3.dp_s >= st.dp_s


def test_monotone_in_the_constants():
    s = shape.from_args(llama3_405b())
    lay = Layout(tp=8, pp=16, dp_replicate=128, micro_batch=1, seq_len=8192, num_microbatches=16,
                 pp_schedule="1f1b", sequence_parallel=True, recompute="full")
    base = steptime.step_time(s, lay, DGX).total_s
    assert steptime.step_time(s, lay, DGX, replace(EFF, matmul=0.8)).total_s < base
    assert steptime.step_time(s, lay, DGX, replace(EFF, intra_node=0.9)).total_s < base
    assert steptime.step_time(s, replace(lay, recompute="none"), DGX).total_s < base
    assert math.isfinite(base) and base > 0


def test_zero3_under_a_pipeline_gathers_the_blocks_it_does_not_keep_every_micro_batch():
    """Every schedule keeps each stage's last block gathered from its first forward to its last
    backward and gathers the others in each micro-batch's forward and once in backward
    (dptime.fsdp_gather_passes). By hand: a rank of 8 blocks in 7 interleaved stages, 32
    micro-batches: 1/8 of its weights not kept, 1/8 x 32 + 7/8 forward passes, 1/8 backward; one
    block a stage: one pass a step; 1F1B's one stage of 2 blocks, 4 micro-batches: 2.5 and 0.5."""
    from gridtrain.plan.dptime import fsdp_gather_passes

    interleaved = Layout(pp=16, dp_shard=8, zero_stage=3, pp_schedule="interleaved-1f1b", pp_virtual_stages=7,
                         num_microbatches=32, micro_batch=1, seq_len=8192)
    assert fsdp_gather_passes(interleaved, 8) == pytest.approx((1 / 8 * 32 + 7 / 8, 1 / 8))
    assert fsdp_gather_passes(interleaved, 7) == pytest.approx((1.0, 0.0))
    one_f_one_b = Layout(pp=2, dp_shard=2, zero_stage=3, pp_schedule="1f1b", num_microbatches=4, micro_batch=1,
                         seq_len=64)
    assert fsdp_gather_passes(one_f_one_b, 2) == pytest.approx((2.5, 0.5))
    # Against a dry run: the small model at 8 layers, pp 2 x dp_shard 2, interleaved 1F1B v2, ZeRO-3
    # in fp32 (`gridtrain train --dry-run --world 4 --rank 0 --model.preset small --model.n_layers 8
    # --parallel.pp 2 --parallel.dp_shard 2 --parallel.zero_stage 3 --parallel.pp_schedule
    # interleaved-1f1b --parallel.pp_virtual_stages 2 --data.seq_len 64 --train.micro_batch 2
    # --train.global_batch 16 or 32`): rank 0's all-gathers were 39,084,032 bytes at 4 micro-batches
    # and 65,576,960 at 8. Its weights: 4 blocks of 786,944 parameters and the 81,920 of the
    # embedding, 4 bytes each; half of them (2 blocks of its 2 stages) are not kept.
    weights = (4 * 786_944 + 81_920) * 4
    lay = Layout(pp=2, dp_shard=2, zero_stage=3, pp_schedule="interleaved-1f1b", pp_virtual_stages=2,
                 micro_batch=2, seq_len=64, num_microbatches=4)
    per_step = {m: sum(fsdp_gather_passes(replace(lay, num_microbatches=m), 4)) * weights for m in (4, 8)}
    assert (per_step[8] - per_step[4]) / 4 == pytest.approx((65_576_960 - 39_084_032) / 4, rel=0.05)
    assert per_step[4] == pytest.approx(39_084_032, rel=0.05)
