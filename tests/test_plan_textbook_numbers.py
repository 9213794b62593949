"""Textbook worked numbers with gridtrain's planner functions: the units of one training step
(Llama 3 70B on 16,384 H100, an illustrative layout), how a ~4M-token global batch splits into
replicas and micro-batches, and the standard rules (bytes per parameter and ZeRO, the activation
estimate, collective identities, link latencies, bubbles, recomputation, Chinchilla)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gridtrain.model.args import llama3_70b
from gridtrain.plan import budget, comm, flops, memory, pipeline, shape, specs
from gridtrain.plan.app.inputs import batch_sequences
from gridtrain.plan.layout import Layout
from gridtrain.plan.state import StateBytes, model_state_bytes

GB = 1e9
approx = pytest.approx


def test_units_llama3_70b():
    # An illustrative layout (Meta has not published the 70B's): 16,384 H100, 8 per node, TP=8,
    # PP=4, micro-batch 4 x 8,192, accumulation 4.
    units = budget.step_units(16384, 8, tp=8, pp=4, num_layers=80, micro_batch=4, seq_len=8192,
                              accumulation=4, total_tokens=15e12)
    assert units.num_nodes == 2048
    assert units.tp_groups == 2048 and units.pipeline_stages == 2048  # summary table
    assert units.model_parallel_gpus == 32
    assert units.replicas == 512
    assert units.layers_per_stage == 20
    assert units.tokens_per_microbatch == 32_768
    assert units.global_batch_tokens == 67_108_864
    # "227 racks of ~9 nodes": 2048 / 9 = 227.6, so it takes 228 racks (a rack of 9 nodes as the
    # cluster's grouping above the node).
    racks = specs.cluster_totals(replace(specs.cluster("dgx-h100"), nodes_per_pod=9), 16384)
    assert (racks.num_nodes, racks.num_pods) == (2048, 228)
    # FFN matrices 8,192 x 28,672.
    s = shape.from_args(llama3_70b())
    assert (s.hidden, s.ffn) == (8192, 28672)


def test_steps_at_4m_tokens():
    # Llama 3's 15T tokens (Dubey et al. 2024): "15 trillion tokens / 4M tokens per step = 3.75
    # million optimizer steps". The ~4M batch fits this layout with one 8,192-token sequence per
    # replica and no accumulation: 512 x 8,192 = 4,194,304 tokens, so 15T takes 3.58 million steps.
    units = budget.step_units(16384, 8, tp=8, pp=4, num_layers=80, micro_batch=1, seq_len=8192,
                              accumulation=1, total_tokens=15e12)
    assert units.global_batch_tokens == 4_194_304
    assert units.optimizer_steps == approx(3.576e6, rel=1e-3)


def test_batch_split_4m_tokens():
    # ~4M tokens = ~500 sequences of 8,192 (488.3 at 4e6, 512 at 4Mi); 8 replicas ->
    # ~500K tokens each (524,288); a micro-batch of 4 x 8,192 = ~32K tokens; 16 accumulation steps.
    seqs, note = batch_sequences("4M", 8192)
    assert seqs == 512 and "488.281 sequences" in note
    assert budget.accumulation_steps(seqs, 4, 8) == 16
    layout = Layout(dp_replicate=8, micro_batch=4, seq_len=8192, num_microbatches=16)
    assert layout.tokens_per_microbatch == 32_768
    assert layout.global_batch_seqs == 512 and layout.global_batch_tokens == 4 * 2**20
    assert layout.global_batch_tokens / layout.dp == approx(500_000, rel=5e-2)


def test_bytes_per_param_and_zero():
    # Mixed-precision AdamW = 2 weight + 2 grad + 12 optimizer/master = 16 bytes/param (ZeRO paper,
    # Rajbhandari et al. 2020, sec. 3.1).
    assert StateBytes.mixed().total == 16
    # Stage 1 "roughly 4x" and stage 2 "roughly 8x" (the large-N limits of 16/(4 + 12/N) and
    # 16/(2 + 14/N)); stage 3 over 64 GPUs: 64x.
    full = model_state_bytes(1e9, 0, 1).total
    assert full / model_state_bytes(1e9, 1, 10**6).total == approx(4, rel=1e-4)
    assert full / model_state_bytes(1e9, 2, 10**6).total == approx(8, rel=1e-4)
    assert full / model_state_bytes(1e9, 3, 64).total == approx(64)
    # "Stage 3 ... about 1.5x the communication of plain DP" (ZeRO paper, sec. 7).
    assert comm.dp_bytes_per_step(2 * GB, 64, 3) / comm.dp_bytes_per_step(2 * GB, 64, 0) == approx(1.5)


def test_activation_estimate():
    # Megatron's per-layer estimate s b h (34 + 5 a s / h) bytes (Korthikanti et al. 2022).
    s, b, h, a = 2048, 1, 4096, 32
    assert memory.korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


def test_collective_identities():
    # A reduce-scatter followed by an all-gather is an all-reduce (same bytes and time).
    link = comm.Link(100 * GB, 5e-6)
    rs_ag = comm.reduce_scatter_time(GB, 8, link) + comm.all_gather_time(GB, 8, link)
    assert rs_ag == approx(comm.ring_all_reduce_time(GB, 8, link))


def test_measured_link_latencies():
    # Hugging Face's Smol Training Playbook (2025): latency ~13 us inside a node, ~55 us across two.
    dgx = specs.cluster("dgx-h100")
    assert (dgx.intra_node_latency_s, dgx.inter_node_latency_s) == (13e-6, 55e-6)


def test_bubble_fraction_examples():
    # GPipe (Huang et al. 2019): (p-1)/(m+p-1): p=4, m=4 -> 3/7 = 43%; p=8, m=32 -> 7/39 = 18%.
    assert pipeline.bubble_fraction(4, 4) == approx(3 / 7)
    assert pipeline.bubble_fraction(8, 32) == approx(7 / 39)


def test_recompute_costs_a_third():
    # Activation checkpointing costs "roughly one extra forward pass (~33% more FLOPs)".
    # Hardware FLOPs with full recomputation over model FLOPs, GPT-3 175B at 2,048 tokens: the
    # logit layer is not recomputed, so a little under 4/3.
    gpt3 = shape.gpt(12288, 96, 96)
    ratio = flops.hardware_flops_per_token(gpt3, 2048, "full") / flops.flops_per_token(gpt3, 2048)
    assert ratio == approx(4 / 3, rel=5e-3) and ratio < 4 / 3


def test_chinchilla_tokens():
    # Compute-optimal is roughly 20 tokens per parameter (Hoffmann et al. 2022).
    assert budget.chinchilla_tokens(70e9) == approx(1.4e12)
