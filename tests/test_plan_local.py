"""`gridtrain plan --gpu local`: this machine's calibrated CPU ranks as a cluster. The search ranks
layouts for N local processes and prints a `gridtrain train --nproc N` command that validates; the
step time follows from the calibration by hand; without a calibration the plan says how to take it."""

from __future__ import annotations

import contextlib
import math
import io
import json
import shlex

import pytest

from gridtrain.cli import main
from gridtrain.config_load import load_config, parse_overrides
from gridtrain.plan import local, shape, steptime
from gridtrain.plan.layout import Layout
from gridtrain.plan.machine import calibration_path, machine_key
from gridtrain.plan.shape import param_counts
from gridtrain.validate import validate

ENTRY = {"peak_flops": {"fp32": 60e9, "bf16": 40e9, "fp16": 20e9},
         "attention_flops": {"fp32": 15e9, "bf16": 10e9, "fp16": 5e9},
         "memory_bytes_per_s": 5e9, "gloo_bytes_per_s": 1e9, "gloo_latency_s": 100e-6, "layer_overhead_s": 4e-4}


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("GRIDTRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    calibration_path().write_text(json.dumps({machine_key(1): ENTRY}))


def plan(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", "--model", "tiny", "--gpu", "local", "--seq-len", "256", "--global-batch", "8",
                     "--tokens", "1M", *argv])
    return code, out.getvalue(), err.getvalue()


def test_local_plan_prints_a_command_that_runs_here(calibrated):
    code, out, _ = plan("--num-gpus", "2", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["ranked"] and all(c["refused"] == "" for c in report["ranked"])
    words = shlex.split(report["train_command"])
    assert words[:4] == ["gridtrain", "train", "--nproc", "2"]
    dims = validate(load_config(None, parse_overrides(words[4:])), world=2)
    chosen = report["chosen"]["layout"]
    assert (dims.tp, dims.pp, dims.cp, dims.dp_shard, dims.dp_replicate) == (
        chosen["tp"], chosen["pp"], chosen["cp"], chosen["dp_shard"], chosen["dp_replicate"])


def test_local_step_time_by_hand():
    """DDP over 2 ranks of 1 thread on 2 cores: compute at the calibrated rates, the gradient
    all-reduce at gloo's bandwidth plus its per-call latency per layer, none of it overlapped."""
    m = local.local_machine(2, "bf16", entry=ENTRY, cores=2, ram=16e9)
    assert m.contention == 1.0 and m.cluster.accelerator.hbm_gb == 8.0
    s = shape.from_args(load_config(None, {"model.preset": "tiny"}).model.args())
    lay = Layout(dp_replicate=2, micro_batch=4, seq_len=256, num_microbatches=1, zero_stage=0)
    st = steptime.step_time(s, lay, m.cluster, m.eff, steptime.StateBytes.gridtrain(), act_bytes=2)
    grads = param_counts(s).total * steptime.StateBytes.gridtrain().gradients
    one_call = 2 * (2 - 1) * 100e-6 / 2  # 2(n-1) ring steps at half a measured small all-reduce
    expected = grads * 2 * (2 - 1) / 2 / 1e9 + one_call  # 0.5 MB of gradients: DDP's first bucket
    assert st.dp_total_s == pytest.approx(expected)
    assert st.dp_s == pytest.approx(st.dp_total_s)  # gloo never hides behind compute
    attention = steptime.layer_attention_flops_per_token(s, 256, "none") * 4 * 256
    hw = steptime.layer_hardware_flops_per_token(s, 256, "none") * 4 * 256
    layer = (hw - attention) / (40e9 * local.CPU_MATMUL) + attention / 10e9
    assert st.layout == lay and m.eff.attention == pytest.approx(10 / 40)
    assert steptime.layer_cost(s, m.cluster, m.eff, 256, 4, 1, 1, False, "none", True).matmul_s == \
        pytest.approx(layer)


def test_ranks_beyond_the_cores_share_them():
    two = local.local_machine(2, "bf16", entry=ENTRY, cores=2, ram=16e9)
    four = local.local_machine(4, "bf16", entry=ENTRY, cores=2, ram=16e9)
    assert four.contention == 2.0
    assert four.cluster.accelerator.peak_flops == pytest.approx(two.cluster.accelerator.peak_flops / 2)
    assert four.cluster.accelerator.hbm_gb == 4.0
    # the framework's time per layer too: the calibrated 0.4 ms, twice over with two ranks a core
    assert (two.eff.layer_overhead_s, four.eff.layer_overhead_s) == pytest.approx((4e-4, 8e-4))


def test_without_a_calibration_the_plan_says_how_to_take_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GRIDTRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code, out, err = plan("--num-gpus", "2")
    assert code == 2 and out == ""
    assert "gridtrain calibrate --threads 1" in err


def test_attention_at_the_models_head_size_and_recomputations_own_time():
    """Attention at the calibrated rate of the model's head size, interpolated in log head size
    (40 and 80 GFLOP/s at 32 and 64: 40 + log2(48/32) x 40 = 63.4 at 48), the nearest beyond the
    grid, the single older rate without one; recomputation's checkpoint machinery per layer on top."""
    entry = {**ENTRY, "attention_flops_by_head_dim": {"bf16": {"32": 40e9, "64": 80e9, "128": 120e9}},
             "recompute_overhead_s": {"selective": 1e-3, "full": 2e-3}}
    assert local.attention_rate(entry, "bf16", 48) == pytest.approx(40e9 + 0.5849625 * 40e9)
    assert local.attention_rate(entry, "bf16", 16) == 40e9 and local.attention_rate(entry, "bf16", 256) == 120e9
    assert local.attention_rate(ENTRY, "bf16", 32) == 10e9
    m = local.local_machine(2, "bf16", entry=entry, cores=2, ram=16e9, head_dim=64)
    assert m.eff.attention == pytest.approx(80e9 / 40e9)
    s = shape.from_args(load_config(None, {"model.preset": "tiny"}).model.args())
    costs = {mode: steptime.layer_cost(s, m.cluster, m.eff, 256, 4, 1, 1, False, mode, True).overhead_s
             for mode in ("none", "selective", "full")}
    assert costs == pytest.approx({"none": 4e-4, "selective": 1.4e-3, "full": 2.4e-3})


def test_kernels_at_the_models_width_and_sequence():
    """A newer calibration times attention by head size and sequence, a block's linear layers by
    width, and a real block's elementwise work (train/calibrate_kernels.py). Attention at head 32
    and sequence 256 lies halfway (in log sequence) between 10 and 30 GFLOP/s at 128 and 512: 20;
    at head 64, 40; past the grid, its edge. Linear layers of width 128, halfway between 20 and 36
    GFLOP/s at 64 and 256: 28, 0.7 of the 40 GFLOP/s peak. Elementwise work at a quarter of the
    bandwidth charges the memory-bound traffic four times over."""
    entry = {**ENTRY, "attention_flops_by_shape": {"bf16": {"32": {"128": 10e9, "512": 30e9},
                                                            "64": {"128": 20e9, "512": 60e9}}},
             "matmul_flops_by_dim": {"bf16": {"64": 20e9, "256": 36e9}}, "elementwise_share": {"bf16": 0.25}}
    assert local.attention_rate(entry, "bf16", 32, 256) == pytest.approx(20e9)
    assert local.attention_rate(entry, "bf16", 64, 256) == pytest.approx(40e9)
    assert local.attention_rate(entry, "bf16", 128, 4096) == pytest.approx(60e9)
    assert local.attention_rate(entry, "bf16", 32, None) == ENTRY["attention_flops"]["bf16"]  # no sequence: the old rate
    assert local.matmul_share(entry, "bf16", 128) == pytest.approx(0.7)
    assert local.matmul_share(entry, "bf16", 4096) == pytest.approx(0.9)
    assert local.matmul_share(ENTRY, "bf16", 128) == local.CPU_MATMUL  # an older calibration
    m = local.local_machine(2, "bf16", entry=entry, cores=2, ram=16e9, head_dim=32, seq_len=256, dim=128)
    assert (m.eff.matmul, m.eff.hbm, m.eff.attention) == pytest.approx((0.7, 0.25, 0.5))
    s = shape.from_args(load_config(None, {"model.preset": "tiny"}).model.args())
    old = local.local_machine(2, "bf16", entry=ENTRY, cores=2, ram=16e9, head_dim=32, seq_len=256, dim=128)
    new_cost, old_cost = (steptime.layer_cost(s, x.cluster, x.eff, 256, 4, 1, 1, False, "none", True) for x in (m, old))
    assert new_cost.memory_bound_s == pytest.approx(4 * old_cost.memory_bound_s)
    attention = steptime.layer_attention_flops_per_token(s, 256, "none") * 4 * 256
    hw = steptime.layer_hardware_flops_per_token(s, 256, "none") * 4 * 256
    assert new_cost.matmul_s == pytest.approx((hw - attention) / (40e9 * 0.7) + attention / 20e9)


def test_fsdp_host_time_per_call_by_hand():
    """FSDP's host time per collective call (train/calibrate_gloo.py), times the calls a step
    issues: the small model's 4 blocks and its embedding and head are 6 units; ZeRO-2 gathers and
    reduce-scatters each once per micro-batch (12 calls), HSDP all-reduces each too (18), ZeRO-3
    gathers blocks 0-2 in forward and backward, the last block, the head and the embedding in
    forward only (9) and reduce-scatters all 6 (15 per micro-batch); DDP and ZeRO-1 issue none."""
    from gridtrain.plan.dptime import fsdp_calls

    one = {"dp_shard": 2, "micro_batch": 8, "seq_len": 256, "num_microbatches": 1}
    assert fsdp_calls(Layout(zero_stage=2, **one), 4) == 12
    assert fsdp_calls(Layout(zero_stage=3, **{**one, "num_microbatches": 2}), 4) == 30
    assert fsdp_calls(Layout(zero_stage=2, dp_replicate=2, **one), 4) == 18
    assert fsdp_calls(Layout(dp_replicate=2, micro_batch=8, seq_len=256, zero_stage=0), 4) == 0
    assert fsdp_calls(Layout(dp_replicate=2, micro_batch=8, seq_len=256, zero_stage=1), 4) == 0
    # 1F1B over 2 stages, 4 micro-batches, rank 0: block 0 gathered in each forward (4) and the
    # first backward (1), block 1 (the stage's last) once, the embedding in each forward (4), the
    # 3 units reduced once: 13
    assert fsdp_calls(Layout(zero_stage=3, pp=2, pp_schedule="1f1b", **{**one, "num_microbatches": 4}), 2) == 13

    entry = {**ENTRY, "fsdp_call_s": 2e-3}
    s = shape.from_args(load_config(None, {"model.preset": "small"}).model.args())
    lay = Layout(zero_stage=2, **one)
    for ranks, contention in ((2, 1), (4, 2)):
        with_host = local.local_machine(ranks, "bf16", entry=entry, cores=2, ram=16e9)
        without = local.local_machine(ranks, "bf16", entry=ENTRY, cores=2, ram=16e9)
        assert with_host.eff.fsdp_call_s == pytest.approx(2e-3 * contention)
        times = [steptime.step_time(s, lay, m.cluster, m.eff, steptime.StateBytes.gridtrain(), act_bytes=2)
                 for m in (with_host, without)]
        assert times[0].dp_s - times[1].dp_s == pytest.approx(12 * 2e-3 * contention)
        zero3 = [steptime.step_time(s, Layout(zero_stage=3, **one), m.cluster, m.eff, steptime.StateBytes.gridtrain(),
                                    act_bytes=2) for m in (with_host, without)]
        assert zero3[0].dp_s - zero3[1].dp_s == pytest.approx(15 * 2e-3 * contention)  # 9 gathers, 6 reductions


def test_fsdp_calls_as_dry_runs_counted_them():
    """fsdp_calls against the FSDP calls `gridtrain train --dry-run --model.preset tiny` counted
    (comm/dp_shard/all_gather_calls + reduce_scatter_calls + comm/dp_replicate/all_reduce_calls,
    data-parallel degree 2 unless said): 2 blocks, 2 micro-batches: ZeRO-3 10 + 8, tied 10 + 6,
    tied ZeRO-2 6 + 6; HSDP 2 x 2 ZeRO-3, 1 micro-batch: 5 + 4 + 4. Pipelines at 4 micro-batches
    (pp 2, --train.micro_batch 2): 4 blocks under 1F1B, rank 0 10 + 3, rank 1 7 + 3, and ZeRO-2
    3 + 3; 8 blocks over 2 virtual stages, interleaved 1F1B rank 0 16 + 5, rank 1 13 + 5, ZB-V
    rank 0 17 + 6; 4 blocks over pp 4 at 8 micro-batches, 1F1B: rank 0 9 + 2, rank 1 1 + 1, rank 3
    2 + 2."""
    from gridtrain.plan.dptime import fsdp_calls

    def lay(m: int, **kw: object) -> Layout:
        return Layout(**{"dp_shard": 2, "micro_batch": 4, "seq_len": 256, "num_microbatches": m, **kw})

    assert fsdp_calls(lay(2, zero_stage=3), 2) == 18
    assert fsdp_calls(lay(2, zero_stage=3), 2, tied=True) == 16
    assert fsdp_calls(lay(2, zero_stage=2), 2, tied=True) == 12
    assert fsdp_calls(lay(1, zero_stage=3, dp_replicate=2), 2) == 13
    one_f = {"zero_stage": 3, "pp": 2, "pp_schedule": "1f1b"}
    assert [fsdp_calls(lay(4, **one_f), 2, rank) for rank in (0, 1)] == [13, 10]
    assert fsdp_calls(lay(4, **{**one_f, "zero_stage": 2}), 2) == 6
    inter = {"zero_stage": 3, "pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2}
    assert [fsdp_calls(lay(4, **inter), 4, rank) for rank in (0, 1)] == [21, 18]
    assert fsdp_calls(lay(4, **{**inter, "pp_schedule": "zbv"}), 4, 0) == 23
    four = {"zero_stage": 3, "pp": 4, "pp_schedule": "1f1b"}
    assert [fsdp_calls(lay(8, **four), 1, rank) for rank in (0, 1, 3)] == [11, 2, 4]


def test_fsdp_time_per_call_from_the_two_rank_runs():
    """calibrate_gloo.per_call_seconds by hand: 6 blocks more add 6 x (2 + 3) FSDP calls across
    ZeRO-2 and ZeRO-3 runs; DDP's own growth and what every run pays once fall out."""
    from gridtrain.train.calibrate_gloo import per_call_seconds

    ms = {("ddp", 2): 4, ("ddp", 8): 7, ("zero2", 2): 20, ("zero2", 8): 41, ("zero3", 2): 22, ("zero3", 8): 52}
    # ((41 - 7) - (20 - 4) + (52 - 7) - (22 - 4)) / 30 = 45 / 30 = 1.5 ms, less a 0.1 ms latency
    assert per_call_seconds({k: v / 1e3 for k, v in ms.items()}, 1e-4) == pytest.approx(1.4e-3)
    assert per_call_seconds({k: 0.01 for k in ms}, 1e-4) == 0.0  # never below nothing


def test_tensor_parallel_host_time_per_layer_by_hand():
    """calibrate_gloo.tp_block_seconds: TP's growth over 6 blocks against the model alone, per
    block, less 4 all-reduce latencies; the plan adds it per layer per micro-batch to TP's time."""
    from gridtrain.train.calibrate_gloo import tp_block_seconds

    ms = {("alone", 2): 3, ("alone", 8): 6, ("tp", 2): 20, ("tp", 8): 71}
    # ((71 - 6) - (20 - 3)) / 6 = 8 ms a block, less 4 x 0.1 ms
    assert tp_block_seconds({k: v / 1e3 for k, v in ms.items()}, 1e-4) == pytest.approx(7.6e-3)
    s = shape.from_args(load_config(None, {"model.preset": "small"}).model.args())
    cost = [steptime.layer_cost(s, m.cluster, m.eff, 256, 8, 2, 1, False, "none", True).tp_s
            for m in (local.local_machine(2, "bf16", entry={**ENTRY, "tp_block_s": 5e-3}, cores=2, ram=16e9),
                      local.local_machine(2, "bf16", entry=ENTRY, cores=2, ram=16e9))]
    assert cost[0] - cost[1] == pytest.approx(5e-3)


def test_ring_step_latency_by_ranks_as_measured():
    """Ranks beyond the cores wait for the scheduler at each ring step: the calibrated step over
    2 and 4 processes, in log ranks between them, in proportion beyond; without the table, half a
    two-thread all-reduce times the contention."""
    entry = {**ENTRY, "gloo_ring_step_s": {"2": 2e-4, "4": 8e-4}}
    assert local.ring_step_seconds(entry, 2, 1.0) == pytest.approx(2e-4)
    assert local.ring_step_seconds(entry, 4, 2.0) == pytest.approx(8e-4)
    assert local.ring_step_seconds(entry, 3, 1.5) == pytest.approx(2e-4 + (math.log(3) - math.log(2)) / math.log(2) * 6e-4)
    assert local.ring_step_seconds(entry, 8, 4.0) == pytest.approx(16e-4)
    assert local.ring_step_seconds(ENTRY, 4, 2.0) == pytest.approx(100e-6 / 2 * 2)
    four = local.local_machine(4, "bf16", entry=entry, cores=2, ram=16e9)
    assert four.cluster.gloo_step_s == pytest.approx(8e-4)
