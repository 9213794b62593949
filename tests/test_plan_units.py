"""The planner's functions against hand-derived numbers and against each other: parameter and
FLOP counts equal the model's own, Korthikanti's closed forms equal the tensor census, the
pipeline simulator equals the bubble formulas, TOML hardware descriptions parse."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gridtrain.model.args import llama3_8b, llama3_70b, llama3_405b, small, tiny
from gridtrain.model.stats import build_meta, count_parameters
from gridtrain.model.stats import flops_per_token as model_flops_per_token
from gridtrain.plan import comm, flops, memory, pipeline, reliability, shape, specs, state
from gridtrain.plan.layout import Layout
from gridtrain.plan.state import StateBytes

approx = pytest.approx


# ---- shapes and FLOPs equal gridtrain.model.stats ----

@pytest.mark.parametrize("preset", [tiny, small, llama3_8b])
@pytest.mark.parametrize("tie", [False, True])
def test_counts_match_model(preset, tie):
    args = replace(preset(), tie_embeddings=tie)
    counts = count_parameters(build_meta(args))
    got = shape.param_counts(shape.from_args(args))
    assert (got.embedding, got.attention, got.mlp, got.norms, got.output) == (
        counts.embedding, counts.attention, counts.mlp, counts.norms, counts.output)
    assert flops.flops_per_token(shape.from_args(args), 512) == model_flops_per_token(args, 512, counts)


def test_hfu_adds_recomputed_forward():
    s = shape.from_args(llama3_8b())
    model = flops.flops_per_token(s, 8192)
    attn_fwd = 4 * 32 * 32 * 128 * 8192
    # Korthikanti et al.'s attention-core recomputation repeats the core's forward; gridtrain's
    # selective saves matmul and attention outputs and recomputes only elementwise work.
    assert flops.hardware_flops_per_token(s, 8192, "attention") == model + attn_fwd
    assert flops.hardware_flops_per_token(s, 8192, "selective") == model
    blocks = 32 * (shape.attention_params(s) + shape.mlp_params(s))
    assert flops.hardware_flops_per_token(s, 8192, "full") == model + 2 * blocks + attn_fwd
    # MFU and throughput are inverses; HFU > MFU with recomputation.
    tps = flops.tokens_per_s(0.4, model, 64, 989e12)
    assert flops.utilization(tps, model, 64, 989e12) == approx(0.4)
    assert flops.utilization(tps, flops.hardware_flops_per_token(s, 8192, "full"), 64, 989e12) > 0.5


# ---- activations ----

@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "attention"])
def test_census_equals_korthikanti_for_gpt(tp, sp, recompute):
    # The tensor census for a GPT block, eager attention, 16-bit, reproduces Table 2 of
    # Korthikanti et al.: 34, 10 + 24/t, /t with SP, 5as/h dropped by their selective
    # recomputation of the attention core (the planner's "attention").
    g = shape.gpt(4096, 1, 32)
    s, b = 2048, 2
    census = memory.layer_activation_bytes(g, s, b, tp, sp and tp > 1, recompute=recompute, flash=False)
    closed = memory.korthikanti_layer_bytes(s, b, 4096, 32, tp, sp and tp > 1,
                                            "selective" if recompute == "attention" else recompute)
    assert census == approx(closed)


def test_llama_constants():
    # Llama block, eager attention, 16-bit, no TP: s b h (12 + 4k/a + 8F/h) + 2 a s^2 b; for
    # Llama 3 70B (k/a = 1/8, F/h = 3.5) that is 40.5 s b h.
    s70 = shape.from_args(llama3_70b())
    s, b, h, a, kv, f = 4096, 1, 8192, 64, 1024, 28672
    eager = memory.layer_activation_bytes(s70, s, b, flash=False)
    assert eager == s * b * h * 40.5 + 2 * a * s * s * b
    # Fused attention: gridtrain's measured census (activations.py), bf16: 10h replicated,
    # 16h + 8 split by SP, 4h + 4kv + 8F + 4a split by TP, per token.
    flash = memory.layer_activation_bytes(s70, s, b, flash=True)
    assert flash == s * b * (30 * h + 4 * kv + 8 * f + 4 * a + 8)
    tp8 = memory.layer_activation_bytes(s70, s, b, tp=8)
    assert tp8 == approx(s * b * (26 * h + 8 + (4 * h + 4 * kv + 8 * f + 4 * a) / 8))
    sp8 = memory.layer_activation_bytes(s70, s, b, tp=8, sequence_parallel=True)
    assert sp8 == approx(s * b * (10 * h + (16 * h + 8) / 8 + (4 * h + 4 * kv + 8 * f + 4 * a) / 8))
    # fp32 (4-byte activations): 32h + 8kv + 16F + 4a + 8.
    assert memory.layer_activation_bytes(s70, s, b, act_bytes=4) == s * b * (32 * h + 8 * kv + 16 * f + 4 * a + 8)
    # CP divides the sequence; full recomputation keeps the (fp32) block input, split by SP.
    assert memory.layer_activation_bytes(s70, s, b, cp=2) == approx(memory.layer_activation_bytes(s70, s // 2, b))
    assert memory.layer_activation_bytes(s70, s, b, recompute="full") == 4 * s * b * h
    assert memory.layer_activation_bytes(s70, s, b, tp=8, sequence_parallel=True, recompute="full") == s * b * h / 2
    # gridtrain's selective keeps every matmul's and attention's output and the block input:
    # bf16 4h + 4h + 4h + 4kv + 4F + 4a.
    assert memory.layer_activation_bytes(s70, s, b, recompute="selective") == s * b * (12 * h + 4 * kv + 4 * f + 4 * a)


def test_in_flight_matches_simulator():
    for schedule, p, m, v in [("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1), ("1f1b", 8, 3, 1),
                              ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 12, 4),
                              ("interleaved-1f1b", 4, 4, 2)]:
        ops = pipeline.simulate(schedule, p, m, v)
        simulated = pipeline.peak_in_flight(ops, p, v)
        assert simulated == [approx(memory.in_flight(schedule, p, r, m, v)) for r in range(p)], schedule
    # First rank of the interleaved schedule: p (1 + (p-1)/(p v)) (Korthikanti et al. 2022).
    assert memory.in_flight("interleaved-1f1b", 4, 0, 12, 4) == approx(4 * (1 + 3 / 16))


def test_rank_memory_405b_names_peak():
    s = shape.from_args(llama3_405b())
    layout = Layout(tp=8, pp=16, dp_shard=128, zero_stage=1, micro_batch=1, seq_len=8192,
                    num_microbatches=16, sequence_parallel=True, recompute="full", fewer_edge_layers=1)
    ranks = memory.rank_memory(s, layout)
    assert [r.layers for r in ranks] == [7] + [8] * 14 + [7]
    # fp16 weights and gradients on a middle rank: 8 x 398.5M params x 2 bytes each.
    assert ranks[5].weights == approx(8 * 398.49e6 * 2, rel=1e-4)
    assert ranks[5].optimizer == approx(ranks[5].weights * 6 / 128)
    peak = memory.peak_rank(ranks)
    assert peak.rank == 1  # 8 layers and 15 micro-batches in flight beat rank 0's 7 and 16
    line = memory.describe_peak(ranks, 80e9)
    assert line.startswith("pipeline rank 1 (8 layers)") and line.endswith("fits in 74.5 GiB")
    # Without recomputation it does not fit.
    heavy = memory.rank_memory(s, replace(layout, recompute="none"))
    assert memory.peak_rank(heavy).total > 80e9 and "does not fit" in memory.describe_peak(heavy, 80e9)


def test_rank_memory_sums_to_model():
    # Without TP and ZeRO, the pipeline ranks' weights add up to the whole model (untied).
    s = shape.from_args(llama3_8b())
    layout = Layout(pp=4, zero_stage=0, fewer_edge_layers=1)
    ranks = memory.rank_memory(s, layout, StateBytes.fp32())
    assert sum(r.weights for r in ranks) == 4 * shape.param_counts(s).total
    # The tied embedding is held twice when pp > 1 (first and last stage), once otherwise.
    tied = replace(s, tie_embeddings=True)
    one = memory.rank_memory(tied, Layout(zero_stage=0))[0].weights
    assert one == 2 * shape.param_counts(tied).total
    two = sum(r.weights for r in memory.rank_memory(tied, Layout(pp=2, zero_stage=0)))
    assert two == 2 * (shape.param_counts(tied).total + 128_256 * 4096)


def test_hsdp_and_zero_shard_degree():
    assert Layout(dp_replicate=4, dp_shard=8, zero_stage=3).zero_shard_degree == 8
    assert Layout(dp_replicate=4, dp_shard=8, zero_stage=1).zero_shard_degree == 32
    assert Layout(dp_replicate=4, zero_stage=0).zero_shard_degree == 1
    assert state.model_state_bytes(1e9, 2, 8, StateBytes.mixed(fp32_grads=True)).gradients == 0.5e9


# ---- pipeline ----

@pytest.mark.parametrize("p,m,v", [(2, 1, 1), (2, 5, 1), (4, 4, 1), (8, 3, 1), (8, 32, 1),
                                   (2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)])
def test_simulator_matches_formula(p, m, v):
    schedules = ["interleaved-1f1b"] if v > 1 else ["gpipe", "1f1b"]
    for schedule in schedules:
        ops = pipeline.simulate(schedule, p, m, v)
        assert len(ops) == 2 * p * m * v
        assert pipeline.makespan(ops) == approx(pipeline.expected_makespan(p, m, v))
        assert pipeline.simulated_bubble_fraction(ops, p) == approx(pipeline.bubble_fraction(p, m, v, schedule))


def test_render():
    # 1F1B, p = 2, m = 2, F = 1, B = 2: makespan (m + p - 1)(F + B) = 9.
    chart = pipeline.render(pipeline.simulate("1f1b", 2, 2), 2)
    assert chart.splitlines()[:2] == ["rank  0 |01..aa.bb|", "rank  1 |.0aa1bb..|"]


def test_zero_bubble():
    # ZB-H1 with F = B = W: bubble (p-1)(F + B - W) = a third of 1F1B's (p-1)(F + B + W).
    p, m = 8, 16
    zb = pipeline.bubble_fraction(p, m, schedule="zb-h1")
    assert zb / (1 - zb) == approx(pipeline.bubble_ratio(p, m) / 3)
    assert pipeline.bubble_fraction(p, m, schedule="zbv") == 0.0
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        pipeline.bubble_fraction(p, m, schedule="bogus")


def test_schedule_costs_as_measured():
    """The planner's schedule model, by hand from the measured per-layer costs (bench/bench_schedules.py,
    two runs at PP 2 and 4: forward 1, fused backward 1.95, input pass 1.27, weight pass 0.95). A
    constant that moves by 5% fails here."""
    assert (pipeline.BACKWARD, pipeline.SPLIT_INPUT, pipeline.SPLIT_WEIGHT) == approx((1.95, 1.27, 0.95), rel=0.05)
    # 1F1B is Narayanan's (p-1)/(m + p-1): p 4, m 8: 3/11.
    assert pipeline.schedule_bubble("1f1b", 4, 8) == approx(3 / 11)
    assert pipeline.split_cost("1f1b") == 1.0
    assert pipeline.split_cost("zbv") == approx(3.22 / 2.95)
    # Under full recomputation each pass recomputes the block (a forward, 1): 5.22 / 3.95.
    assert pipeline.split_cost("zbv", "full") == approx(5.22 / 3.95)
    assert pipeline.split_cost("interleaved-1f1b", "full") == 1.0
    # The zero-bubble orders fill most of interleaved 1F1B's idle time with weight passes, not all.
    for name in ("interleaved-zb", "zbv", "dualpipev"):
        assert 0 < pipeline.schedule_bubble(name, 4, 8, 2) < pipeline.schedule_bubble("interleaved-1f1b", 4, 8, 2) / 2
    # ZB-H1 (not in the runtime) keeps Qi et al.'s (p-1)(F + I - W): 1.32 / 2.95 of 1F1B's unit.
    assert pipeline.bubble_scale("zb-h1") == approx(1.32 / 2.95)
    assert pipeline.schedule_bubble("zbv", 1, 8, 2) == 0.0
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        pipeline.schedule_bubble("bogus", 4, 8)


def test_search_pays_for_the_split_backward():
    """A zero-bubble layout's step holds its micro-batches at split_cost x the fused time: the same
    layout under ZB-V and under interleaved 1F1B (v 2) has the same layers per rank, so their
    per-micro-batch times differ by exactly the split's cost."""
    from gridtrain.plan import shape, specs, steptime
    from gridtrain.plan.layout import Layout
    from gridtrain.model.args import llama3_8b

    s = shape.from_args(llama3_8b())
    cluster = specs.cluster("dgx-h100")
    kw = dict(tp=2, pp=4, dp_replicate=1, micro_batch=1, seq_len=4096, num_microbatches=16, pp_virtual_stages=2)
    zbv = steptime.pipeline_time(s, Layout(pp_schedule="zbv", **kw), cluster, steptime.CALIBRATED)
    il = steptime.pipeline_time(s, Layout(pp_schedule="interleaved-1f1b", **kw), cluster, steptime.CALIBRATED)
    assert zbv.layers == il.layers == 8
    assert zbv.micro_s == approx(il.micro_s * 3.22 / 2.95)


# ---- communication ----

def test_axis_volumes():
    gb = 1e9
    # ZeRO-2 reduce-scatters every micro-batch and all-gathers parameters once.
    assert comm.dp_bytes_per_step(gb, 4, 2, num_microbatches=3) == approx(3 / 4 * 4 * gb)
    assert comm.dp_bytes_per_step(gb, 4, 3, num_microbatches=2) == approx(3 / 4 * 6 * gb)
    assert comm.dp_bytes_per_step(gb, 1, 3) == 0
    # PP: each rank sends its chunks' activations forward and gradients back: 2 m v x size.
    assert comm.pp_bytes_per_step(4096, 8192, 8, virtual=2) == 2 * 8 * 2 * 4096 * 8192 * 2
    assert comm.pp_bytes_per_step(4096, 8192, 8, tp=8, sequence_parallel=True) == 2 * 8 * 4096 * 8192 * 2 / 8
    # CP: KV blocks (kv = 2 x 8192/4 x 1024 x 2 bytes) sent (cp - 1) times forward and again
    # backward, and the fp32 dK/dV accumulators (2 kv) cp times: 6 kv + 8 kv per layer.
    kv = 2 * 2048 * 1024 * 2
    assert comm.cp_bytes_per_layer(8192, 1024, 4) == 14 * kv == 112 * 2**20
    assert comm.cp_bytes_per_layer(8192, 1024, 4, recompute=True) == 17 * kv
    assert comm.ring_attention_payloads(8192, 1024, 4, rotate="allgather") == {"all_gather": 8 * kv,
                                                                              "all_to_all": 8 * kv}
    assert comm.cp_bytes_per_layer(8192, 1024, 1) == 0
    # EP: four all-to-alls of tokens x top_k x h, (ep-1)/ep of each sent.
    assert comm.ep_bytes_per_layer(4096, 4096, 2, 8) == 4 * 7 / 8 * 4096 * 2 * 4096 * 2
    # TP with full recomputation: 6 all-reduces per layer instead of 4.
    assert comm.tp_bytes_per_layer(1024, 1024, 2, recompute=True) == 1.5 * comm.tp_bytes_per_layer(1024, 1024, 2)


def test_fsdp_prefetch_overlap():
    # All-gather shorter than compute: only the first block's all-gather is exposed.
    assert comm.exposed_before_compute([1.0] * 10, [3.0] * 10) == approx(1.0)
    # Longer: the first all-gather (4) is exposed whole, then each of the other 9 by 4 - 3.
    assert comm.exposed_before_compute([4.0] * 10, [3.0] * 10) == approx(4.0 + 9 * 1.0)
    # A link's hierarchy costs: rs/ar/ag over 8 GPUs with per-GPU NICs beats the leader scheme.
    intra, inter = comm.Link(450e9, 13e-6), comm.Link(50e9, 55e-6)
    fast = comm.hierarchical_all_reduce_time(8e9, 8, 16, intra, inter).total
    slow = comm.hierarchical_all_reduce_time(8e9, 8, 16, intra, inter, leader=True).total
    assert fast < slow


# ---- specs ----

@pytest.mark.parametrize("device, spec", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"), ("NVIDIA H200", "H200"), ("Tesla V100-SXM2-32GB", "V100"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA GeForce RTX 4090", None)])
def test_the_runtime_finds_its_device_in_the_planners_table(device, spec):
    """What MFU divides by at run time is the planner's peak for the same part (torch's names)."""
    found = specs.accelerator_of_device(device)
    assert (found.name if found else None) == spec


def test_accelerator_lookup():
    assert specs.accelerator("h100") is specs.ACCELERATORS["H100-SXM"]
    assert specs.accelerator("H100 PCIe").bf16_tflops == 756
    assert specs.accelerator("a100_40gb").hbm_gb == 40
    with pytest.raises(specs.SpecError, match="did you mean H200"):
        specs.accelerator("H2000")
    with pytest.raises(specs.SpecError, match="unknown cluster"):
        specs.cluster("nope")


def test_hardware_toml(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text("""
[accelerator.mi300x]
bf16_tflops = 1307
hbm_gb = 192
hbm_gb_per_s = 5300
power_w = 750
link_gb_per_s = 896

[cluster.my-pod]
accelerator = "mi300x"
gpus_per_node = 8
intra_node_gb_per_s = 448
intra_node_latency_s = 15e-6
inter_node_gb_per_s = 50
inter_node_latency_s = 60e-6
price_per_gpu_hour = 3.5

[cluster.h100-pod]
accelerator = "h100"
gpus_per_node = 8
intra_node_gb_per_s = 450
intra_node_latency_s = 13e-6
inter_node_gb_per_s = 25
inter_node_latency_s = 55e-6
oversubscription = 2
""")
    hw = specs.load_hardware(path)
    assert hw.accelerators["mi300x"].peak_flops == 1307e12
    pod = hw.clusters["my-pod"]
    assert pod.accelerator.name == "mi300x" and pod.gpus_per_node == 8 and pod.price_per_gpu_hour == 3.5
    assert hw.clusters["h100-pod"].cross_pod_gb_per_s == 12.5
    assert specs.accelerator("MI300X", hw.accelerators).hbm_gb == 192
    with pytest.raises(specs.SpecError, match="did you mean 'hbm_gb'"):
        specs.parse_hardware({"accelerator": {"x": {"hbm_gbb": 1}}})
    with pytest.raises(specs.SpecError, match="lacks"):
        specs.parse_hardware({"cluster": {"c": {"accelerator": "h100"}}})


# ---- reliability ----

def test_daly_and_mtbf():
    c, m = 98.0, 24 * 3600.0
    young, daly = reliability.young_interval(c, m), reliability.daly_interval(c, m)
    # Daly's refinement: Young's interval, corrected by about sqrt(C/2M)/3, minus C.
    assert daly == approx(young * (1 + (c / (2 * m)) ** 0.5 / 3 + c / (2 * m) / 9) - c)
    assert young - c < daly < young
    assert reliability.daly_interval(3 * m, m) == m
    # Llama 3 paper: 419 unexpected interruptions in 54 days on 16,384 GPUs -> a cluster MTBF of
    # 54 x 24 / 419 = 3.09 hours, which a per-GPU MTBF of ~50,700 hours (5.8 years) explains:
    # 50,700 / 16,384 = 3.09 hours.
    assert reliability.cluster_mtbf(50_700, 16384) == approx(54 * 24 / 419, rel=1e-3)
    # Daly's expected wall time exceeds the work by about the waste fraction.
    wall = reliability.daly_wall_seconds(30 * 86400, daly, c, m)
    assert wall / (30 * 86400) - 1 == approx(reliability.waste_fraction(daly, c, m), rel=0.05)


def test_checkpoint_storage_cap():
    # 1000 writers x 5 GB/s = 5 TB/s, capped by the storage's 100 GB/s: 1 TB / 100 GB/s = 10 s.
    assert reliability.checkpoint_write_seconds(1e12, 5e9, 1000, aggregate_bytes_per_s=100e9) == 10.0


def test_bytes_per_step_by_axis():
    # Llama 3 8B, tp 2 x pp 2 x dp_shard 2 (ZeRO-3), 4 micro-batches of 2 x 1024 tokens.
    s = shape.from_args(llama3_8b())
    layout = Layout(tp=2, pp=2, dp_shard=2, zero_stage=3, micro_batch=2, seq_len=1024, num_microbatches=4)
    got = comm.bytes_per_step(s, layout, rank=0)
    params = memory.rank_params(s, layout, 0, 16)
    assert got["dp_shard"] == approx(1 / 2 * 4 * (2 * params * 2 + params * 2))
    assert got["tp"] == approx(16 * 4 * 4 * (1 / 2 * 2) * 2048 * 4096 * 2)
    assert got["pp"] == approx(2 * 4 * 2048 * 4096 * 2)
    assert set(got) == {"dp_shard", "tp", "pp"}
    # Under CP, FSDP shards over dp_shard x cp (4 ranks here) and HSDP all-reduces that shard.
    hsdp = comm.bytes_per_step(s, replace(layout, dp_replicate=3, tp=1, pp=1, cp=2))
    assert set(hsdp) == {"dp_shard_cp", "dp_replicate", "cp"}
    whole = memory.rank_params(s, replace(layout, tp=1, pp=1), 0, 32)
    assert hsdp["dp_shard_cp"] == approx(3 / 4 * 4 * (2 * whole * 2 + whole * 2))
    assert hsdp["dp_replicate"] == approx(2 * 2 / 3 * whole * 2 / 4)
    # and buffers the ring's keys and values, 2 kv, and the fp32 dK/dV accumulators, 2 x 2 kv:
    # kv = 2 x (2 x 1024 / 2) x 1024 x 2 bytes for the 8B's 8 KV heads of 128.
    kv = 2 * 1024 * 1024 * 2
    ring = replace(layout, tp=1, pp=1, cp=2, dp_shard=2, num_microbatches=1)
    assert memory.buffer_bytes(s, ring, StateBytes()) - memory.buffer_bytes(
        s, replace(ring, cp=1), StateBytes()) == approx(6 * kv)
    assert comm.bytes_per_step(s, Layout(dp_replicate=4, zero_stage=0))["dp"] == approx(
        2 * 3 / 4 * shape.param_counts(s).total * 2)
