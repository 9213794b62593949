"""Worked numbers of training at Llama 3 405B scale with gridtrain's planner functions: memory and
compute walls, the H100 and its roofline, the Llama 3 cluster, ZeRO, HSDP, 3D parallelism, bubbles,
recomputation, tensor parallelism. Where a commonly quoted figure is wrong, the test asserts the
right value and says why."""

from __future__ import annotations

import pytest

from gridtrain.model.args import llama3_405b
from gridtrain.layout.dims import stage_layer_counts
from gridtrain.plan import budget, comm, flops, pipeline, shape, specs
from gridtrain.plan.state import StateBytes, model_state_bytes

GB, TB = 1e9, 1e12
approx = pytest.approx
H100 = specs.ACCELERATORS["H100-SXM"]


def test_memory_wall_405b():
    # The often-quoted "405e9 x (2 + 2 + 4 + 4) bytes = 4.86 TB", "over 60 GPUs worth". That is 12
    # bytes per parameter, without the fp32 master copy; the ZeRO paper's mixed-precision Adam is
    # 16 bytes: 6.48 TB, 81 H100s.
    assert 405e9 * StateBytes.no_master().total == approx(4.86 * TB)
    assert 405e9 * StateBytes.no_master().total / H100.hbm_bytes == approx(60.75)
    assert 405e9 * StateBytes.mixed().total == approx(6.48 * TB)
    assert 405e9 * StateBytes.mixed().total / H100.hbm_bytes == approx(81)
    # The often-quoted "3.2 TB ... a 40x gap" is the Adam moments alone: 8 x 405e9 = 3.24 TB / 80 GB.
    assert 405e9 * 8 / H100.hbm_bytes == approx(40.5)
    # By bucket in that convention: weights 810 GB, gradients 810 GB, optimizer (m, v) 3.24 TB.
    states = model_state_bytes(405e9, 0, 1, StateBytes.no_master())
    assert (states.weights, states.gradients, states.optimizer) == approx((810 * GB, 810 * GB, 3.24 * TB))


def test_compute_wall_405b():
    # 6 N D (Kaplan et al. 2020): 6 x 405e9 x 15e12 = 3.645e25 FLOPs; one H100 at 989 TFLOP/s: 3.69e10 s = 1,170 years.
    total = budget.training_flops(405e9, 15e12)
    assert total == approx(3.645e25)
    one_gpu = budget.training_seconds(total, 1, H100.peak_flops, 1.0)
    assert one_gpu == approx(3.69e10, rel=1e-2)
    assert one_gpu / (365 * 86400) == approx(1169, rel=1e-3)
    # "On 24,576 GPUs: 1,170/24,576 = 17 days at ~40% MFU": 17.4 days is at 100% of peak;
    # at 40% MFU it is 43.4 days.
    assert budget.training_days(total, 24576, H100.peak_flops, 1.0) == approx(17.36, rel=1e-3)
    assert budget.training_days(total, 24576, H100.peak_flops, 0.40) == approx(43.4, rel=1e-3)


def test_h100_cores_and_peak():
    # H100 SXM (NVIDIA's Hopper architecture whitepaper): 128 CUDA cores x 132 SMs = 16,896; 4 tensor
    # cores x 132 = 528; a [16x4].[4x8] product = 1,024 FLOPs per cycle; at the 1.83 GHz boost clock
    # that is the 989 TFLOP/s peak.
    assert specs.tensor_core_peak_flops(132, 4, 1024, 1.83e9) == approx(H100.peak_flops, rel=1e-3)


def test_gpu_table():
    # Vendor data sheets: BF16 TFLOP/s, memory, bandwidth. B200's "~5,000" is the sparse figure; the
    # dense bf16 peak is 2,250 (HGX B200 data sheet).
    table = specs.ACCELERATORS
    assert (table["V100"].bf16_tflops, table["V100"].hbm_gb, table["V100"].hbm_gb_per_s) == (125, 32, 900)
    assert (table["A100-80GB"].bf16_tflops, table["A100-80GB"].hbm_gb_per_s) == (312, 2039)
    assert (H100.bf16_tflops, H100.hbm_gb, H100.hbm_gb_per_s) == (989, 80, 3352)
    assert (table["B200"].hbm_gb, table["B200"].hbm_gb_per_s, table["B200"].bf16_tflops) == (192, 8000, 2250)
    # Google Cloud: TPU v5p 459 TFLOP/s bf16.
    assert specs.accelerator("tpu v5p").bf16_tflops == 459


def test_roofline():
    # Roofline (Williams et al. 2009): matmul 4096^3 in bf16: 2 x 4096^3 / (2 x 4096^2 x 2) = 2048 FLOPs/byte; ReLU 0.5;
    # H100 ridge 989,000 / 3,352 = 295.
    assert flops.matmul_intensity(4096, 4096, 4096) == approx(2048)
    assert flops.ridge_point(H100.peak_flops, H100.hbm_gb_per_s * 1e9) == approx(295, rel=1e-2)
    assert H100.ridge_flops_per_byte == approx(295, rel=1e-2)
    # ReLU, N operations over 2N bytes: memory-bound at 0.5 x 3,352 GB/s.
    assert flops.attainable_flops(0.5, H100.peak_flops, 3352e9) == approx(1676e9)
    assert flops.attainable_flops(2048, H100.peak_flops, 3352e9) == H100.peak_flops


def test_bandwidth_hierarchy():
    # NVLink 900 / HBM 3,352 = 0.27; InfiniBand 50 / 3,352 = 0.015; the often-quoted "18x drop"
    # 900 / 50. The 900 GB/s counts both directions and the 50 GB/s one: like for like it is 9x.
    dgx = specs.cluster("dgx-h100")
    assert H100.link_gb_per_s / H100.hbm_gb_per_s == approx(0.27, rel=2e-2)
    assert dgx.inter_node_gb_per_s / H100.hbm_gb_per_s == approx(0.015, rel=2e-2)
    assert H100.link_gb_per_s / dgx.inter_node_gb_per_s == 18
    assert dgx.intra_node_gb_per_s / dgx.inter_node_gb_per_s == 9


def test_grand_teton_cluster():
    # Llama 3 paper (Dubey et al. 2024), sec. 3.3.1: server = 8 H100 (640 GB); rack = 2 servers
    # (1.28 TB); pod = 192 racks = 3,072 GPUs (245.76 TB, "245 TB"); cluster = 8 pods = 24,576 GPUs,
    # 1.97 PB, 24.3 EFLOP/s.
    dgx = specs.cluster("dgx-h100")
    assert specs.cluster_totals(dgx, 8).memory_bytes == approx(640 * GB)
    assert specs.cluster_totals(dgx, 16).memory_bytes == approx(1.28 * TB)
    assert dgx.nodes_per_pod * dgx.gpus_per_node == 3072
    assert specs.cluster_totals(dgx, 3072).memory_bytes == approx(245.76 * TB)
    totals = specs.cluster_totals(dgx, 24576)
    assert (totals.num_nodes, totals.num_pods) == (3072, 8)
    assert totals.memory_bytes == approx(1.97e15, rel=1e-2)
    assert totals.peak_flops == approx(24.3e18, rel=1e-2)


def test_ring_vs_naive():
    # Naive all-reduce sends 2(N-1)M through GPU 0; the ring (Patarasuk & Yuan 2009) sends
    # 2(N-1)M/N per GPU (~2M whatever N).
    m, n = 1 * GB, 1024
    assert comm.ring_all_reduce_bytes(m, n) == approx(2 * (n - 1) * m / n)
    assert comm.ring_all_reduce_bytes(m, n) < 2 * m < 2 * (n - 1) * m


def test_zero_stages_405b_1024():
    # 12-byte (no master copy) convention: stage 3 on 1,024 GPUs 4.86 TB / 1024 = 4.75 GB;
    # stage 1: 810 + 810 GB + sharded optimizer 8 x 405e9 / 1024 = 3.16 GB.
    no_master = StateBytes.no_master()
    assert model_state_bytes(405e9, 3, 1024, no_master).total == approx(4.75 * GB, rel=1e-3)
    s1 = model_state_bytes(405e9, 1, 1024, no_master)
    assert (s1.weights, s1.gradients, s1.optimizer) == approx((810 * GB, 810 * GB, 3.164 * GB), rel=1e-3)
    # gridtrain's (ZeRO paper) 16 bytes/param: stage 3 6.33 GB; stage 1 1,624.7 GB. Either way
    # "for 405B, Stage 3 is mandatory".
    assert model_state_bytes(405e9, 3, 1024).total == approx(6.328 * GB, rel=1e-3)
    assert model_state_bytes(405e9, 1, 1024).total == approx(1624.7 * GB, rel=1e-4)
    # FSDP is often said to cost "3x DP" traffic: that counts DP's all-reduce as 1 model size; on the
    # wire an all-reduce is 2 (reduce-scatter + all-gather), so ZeRO-3 is 1.5x (ZeRO paper).
    assert comm.dp_bytes_per_step(810 * GB, 1024, 3) / comm.dp_bytes_per_step(810 * GB, 1024, 0) == approx(1.5)


def test_hsdp_llama3():
    # HSDP: 24,576 GPUs as 3,072 groups of 8. Per GPU and step (fp16 405B = 810 GB): inside the
    # node 3 x 7/8 x 810 = 2,126 GB over NVLink; across nodes each GPU all-reduces only its 1/8
    # gradient shard: 2 x 3071/3072 x 101 GB = 202 GB. The quoted "3x vs 1x the model size" counts
    # model sizes per group; per GPU the slow link carries 10.5x less than the fast one.
    vol = comm.hsdp_bytes_per_step(810 * GB, shard=8, replicate=3072)
    assert vol["dp_shard"] == approx(2126.25 * GB)
    assert vol["dp_replicate"] == approx(202.43 * GB, rel=1e-4)
    assert vol["dp_shard"] / vol["dp_replicate"] == approx(10.5, rel=1e-3)


def test_3d_layout_llama3():
    # Llama 3 405B's TP=8 x PP=16 (Dubey et al. 2024, sec. 3.3.2) on 24,576 GPUs -> DP = 24,576 /
    # 128 = 192; ~8 of 126 layers per stage: 7.875 on average; with one layer fewer on the edge
    # stages (embedding and head), 7 on the first and last and 8 on the 14 in between
    # (7 + 14 x 8 + 7 = 126).
    units = budget.step_units(24576, 8, tp=8, pp=16, num_layers=126, micro_batch=1, seq_len=8192,
                              accumulation=1, total_tokens=15e12)
    assert (units.model_parallel_gpus, units.replicas) == (128, 192)
    assert units.layers_per_stage == approx(7.9, rel=1e-2)
    assert stage_layer_counts(126, 16, fewer_edge_layers=1) == [7] + [8] * 14 + [7]


def test_bubbles():
    # GPipe (Huang et al. 2019): (P-1)/(P-1+M): P4 M8 27.3%; P4 M32 8.6%; P16 M8 65.2%; P16 M64 19.0%.
    cases = {(4, 8): 0.273, (4, 32): 0.086, (16, 8): 0.652, (16, 64): 0.190}
    for (p, m), want in cases.items():
        assert pipeline.bubble_fraction(p, m, schedule="gpipe") == approx(want, abs=5e-4)
        ops = pipeline.simulate("gpipe", p, m)
        assert pipeline.simulated_bubble_fraction(ops, p) == approx(want, abs=5e-4)
    # A 75.0% bubble at 4 stages is the naive pipeline, one micro-batch.
    assert pipeline.bubble_fraction(4, 1) == approx(0.75)


def test_recompute_cost():
    # Full recomputation, "~33% more forward passes": one extra forward on top of forward + backward (2x),
    # (1 + 1 + 2) / (1 + 2) = 4/3. For 405B, full recomputation adds 2 N_blocks + 4 L H Q T to
    # 6 N + 12 L H Q T; the head (2.1B of 404B matmul parameters) is not recomputed, so the
    # ratio is just under 4/3.
    s405 = shape.from_args(llama3_405b())
    ratio = flops.hardware_flops_per_token(s405, 8192, "full") / flops.flops_per_token(s405, 8192)
    assert ratio == approx(4 / 3, rel=2e-3) and ratio < 4 / 3


def test_tp_communication_worked_example():
    # Worked example: h = 16,384, batch x seq = 4M tokens, 2 bytes: 16,384 x 4Mi x 2 = 128 GiB per all-reduce;
    # 126 blocks x 4 x 128 GiB = 64,512 GiB ("64 TB"; in TB it is 69.3), 77 s at 900 GB/s (a
    # quoted 71 s divides 64e12 by 900e9, mixing TiB and TB). That figure also counts every token
    # of the global batch on one TP group, every layer on one stage, and no ring factor. Per GPU:
    # its replica's share (4Mi / DP 192 tokens), its stage's 8 layers, 4 all-reduces per layer of
    # 2 x 7/8 of the payload: 40 GB per step, 89 ms at 450 GB/s.
    tokens = 4 * 2**20 / 192
    per_gpu = 8 * comm.tp_bytes_per_layer(tokens, 16384, 8)
    assert per_gpu / GB == approx(40.1, rel=1e-2)
    assert per_gpu / (450 * GB) == approx(0.089, rel=1e-2)


def test_pure_dp_7b_on_8():
    # "7B, 8 GPUs: pure DP, each GPU stores ~84 GB": 12 bytes/param (no master copy); 16
    # bytes/param (ZeRO) makes it 112 GB. FSDP over 8 fixes it: 14 GB.
    assert model_state_bytes(7e9, 0, 8, StateBytes.no_master()).total == approx(84 * GB)
    assert model_state_bytes(7e9, 0, 8).total == approx(112 * GB)
    assert model_state_bytes(7e9, 3, 8).total == approx(14 * GB)
