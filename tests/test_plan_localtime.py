"""The step-time prediction of `gridtrain plan --check` on the calibrated local machine
(gridtrain/plan/localtime.py), against values derived by hand."""

from __future__ import annotations

import math

import pytest

from gridtrain.config_load import load_config
from gridtrain.model.args import model_args
from gridtrain.layout.dims import ParallelDims
from gridtrain.plan.localtime import CPU_MATMUL, LocalMachine, collective_seconds, local_step, microbatch_seconds

MACHINE = LocalMachine(matmul_flops=1e11, attention_flops=5e10, memory_bytes_per_s=1e10, gloo_bytes_per_s=1e9,
                       cores=2)


def config(**train):
    return load_config(None, {"data.seq_len": 64, "train.micro_batch": 2, "train.global_batch": 8,
                              **{f"train.{k}": v for k, v in train.items()}})


def dims(**degrees):
    base = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    base.update(degrees)
    return ParallelDims(**base, world_size=math.prod(base.values()))


def test_microbatch_seconds_small_model_by_hand():
    """small: dim 256, 4 layers, 8 heads (head_dim 32), 4 KV heads (width 128), FFN 768, vocab
    320; 2 x 64 = 128 tokens. Matmul parameters per block 256 (512 + 256) + 3 x 256 x 768 =
    786,432; 4 blocks and the head's 320 x 256: 3,227,648; x 6 x 128 = 2,478,833,664 FLOPs at
    0.85 x 1e11. Attention 3 x 4 x 128 x 64 x 256 x 4 = 100,663,296 FLOPs at 5e10. 1 MB of saved
    activations passed 4 times at 1e10 B/s."""
    args = model_args("small")
    expected = 2_478_833_664 / (1e11 * CPU_MATMUL) + 100_663_296 / 5e10 + 4e6 / 1e10
    got = microbatch_seconds(args, dims(), config(), MACHINE, layers=4, last=True, activation_bytes=1e6)
    assert got == pytest.approx(expected, rel=1e-12)
    # Full recomputation: matmuls 8/6, attention 4/3; TP 2 halves both.
    full = microbatch_seconds(args, dims(tp=2), config(recompute="full"), MACHINE, 4, True, 1e6)
    assert full == pytest.approx(2_478_833_664 * 8 / 6 / 2 / (1e11 * CPU_MATMUL) + 100_663_296 * 4 / 3 / 2 / 5e10
                                 + 4e6 / 1e10, rel=1e-12)


def test_a_calibration_by_shape_sets_the_kernels_rates_for_the_runs_model():
    """The same micro-batch with a calibration by shape (the small model: head size 32, width 256,
    at sequence 64): attention at 20 GFLOP/s (calibrated at head 32 and sequence 64), the linear
    layers at 30 of the 100 GFLOP/s peak at width 256 (0.3), elementwise work at a fifth of the
    bandwidth, and the framework's time per layer (selective recomputation's on top)."""
    entry = {"peak_flops": {"bf16": 1e11}, "memory_bytes_per_s": 1e10, "gloo_bytes_per_s": 1e9,
             "attention_flops_by_shape": {"bf16": {"32": {"64": 2e10, "128": 4e10}}},
             "matmul_flops_by_dim": {"bf16": {"256": 3e10}}, "elementwise_share": {"bf16": 0.2},
             "layer_overhead_s": 4e-4, "recompute_overhead_s": {"selective": 1e-3}}
    machine = LocalMachine.from_calibration(entry, "bf16", 2, model_args("small"), 64)
    got = microbatch_seconds(model_args("small"), dims(), config(), machine, layers=4, last=True, activation_bytes=1e6)
    kernels = 2_478_833_664 / 3e10 + 100_663_296 / 2e10 + 4e6 / (1e10 * 0.2)
    assert got == pytest.approx(kernels + 4 * 4e-4, rel=1e-12)  # and the framework's 0.4 ms per layer
    selective = microbatch_seconds(model_args("small"), dims(), config(recompute="selective"), machine, 4, True, 1e6)
    assert selective == pytest.approx(kernels + 4 * (4e-4 + 1e-3), rel=1e-12)


def test_collective_seconds_ring_shares():
    """A ring all-reduce over N moves 2(N-1)/N of its payload, an all-gather (N-1)/N, a send all."""
    d = dims(dp_shard=4)
    got = collective_seconds({"dp_shard/all_reduce_bytes": 1e9, "dp_shard/all_gather_bytes": 2e9}, d, MACHINE)
    assert got == pytest.approx(1.5 + 1.5)
    assert collective_seconds({"pp/send_bytes": 5e8}, dims(pp=2), MACHINE) == pytest.approx(0.5)
    assert collective_seconds({}, dims(), MACHINE) == 0.0  # one process: nothing to send
    assert collective_seconds({}, d, MACHINE) != collective_seconds({}, d, MACHINE)  # not modelled: NaN


def test_local_step_adds_bubble_contention_and_optimizer():
    """PP 2 with 4 micro-batches: 4 + 1 micro-batch slots; 2 ranks x 2 threads on 2 cores run
    compute at half speed; AdamW streams 28 bytes per local parameter."""
    args, d, cfg = model_args("small"), dims(pp=2), config()
    t_mb = microbatch_seconds(args, d, cfg, MACHINE, layers=2, last=False, activation_bytes=1e6)
    step = local_step(args, d, cfg, MACHINE, pp_rank=0, activation_bytes=1e6, collectives={"pp/send_bytes": 1e6},
                      local_params=1e6, threads=2)
    assert step.compute_s == pytest.approx(4 * 2 * t_mb)
    assert step.bubble_s == pytest.approx(2 * t_mb)
    assert step.comm_s == pytest.approx(1e-3)
    assert step.optimizer_s == pytest.approx(2 * 28e6 / 1e10)
    # By hand: a first-stage rank holds 2 of small's 4 blocks and not the head, so t_mb is
    # 2 x 786,432 x 6 x 128 = 1,207,959,552 matmul FLOPs at 0.85 x 1e11, plus 3 x 4 x 128 x 64 x
    # 256 x 2 = 50,331,648 attention FLOPs at 5e10, plus 4e6 / 1e10 s of activations (0.0156 s);
    # the step is 2 x (4 + 1) x t_mb + 1e6 / 1e9 s of send + 2 x 28e6 / 1e10 s of AdamW (0.163 s).
    t_mb_by_hand = 1_207_959_552 / (1e11 * 0.85) + 50_331_648 / 5e10 + 4e6 / 1e10
    assert t_mb == pytest.approx(t_mb_by_hand, rel=1e-12)
    assert step.total_s == pytest.approx(2 * 5 * t_mb_by_hand + 1e-3 + 2 * 28e6 / 1e10, rel=1e-12)


def test_local_step_adds_fsdps_host_time_per_call():
    """ZeRO-2 over 2 ranks of the small model, 1 micro-batch: its 6 FSDP units each gather and
    reduce-scatter once, 12 calls at the calibrated 1 ms each beside the bytes; DDP pays none."""
    from dataclasses import replace

    args, machine = model_args("small"), replace(MACHINE, fsdp_call_s=1e-3)
    collectives = {"dp_shard/all_gather_bytes": 1e6, "dp_shard/reduce_scatter_bytes": 2e6}
    cfg = load_config(None, {"data.seq_len": 64, "train.micro_batch": 4, "train.global_batch": 8,
                             "parallel.zero_stage": 2, "parallel.dp_shard": 2})
    step = local_step(args, dims(dp_shard=2), cfg, machine, pp_rank=0, activation_bytes=1e6,
                      collectives=collectives, local_params=1e6, threads=1)
    wire = collective_seconds(collectives, dims(dp_shard=2), machine)
    assert step.comm_s == pytest.approx(wire + 12e-3)
    ddp = load_config(None, {"data.seq_len": 64, "train.micro_batch": 4, "train.global_batch": 8,
                             "parallel.dp_replicate": 2, "parallel.zero_stage": 0})
    step = local_step(args, dims(dp_replicate=2), ddp, machine, pp_rank=0, activation_bytes=1e6,
                      collectives={"dp_replicate/all_reduce_bytes": 1e6}, local_params=1e6, threads=1)
    assert step.comm_s == pytest.approx(collective_seconds({"dp_replicate/all_reduce_bytes": 1e6},
                                                           dims(dp_replicate=2), machine))


def test_tensor_parallel_host_time_per_layer_in_the_microbatch():
    """Under TP each of the rank's layers adds the calibrated host time once per micro-batch."""
    from dataclasses import replace

    args, cfg = model_args("small"), config()
    times = [microbatch_seconds(args, dims(tp=2), cfg, machine, layers=4, last=True, activation_bytes=1e6)
             for machine in (replace(MACHINE, tp_block_s=5e-3), MACHINE)]
    assert times[0] - times[1] == pytest.approx(4 * 5e-3)
    alone = [microbatch_seconds(args, dims(), cfg, machine, layers=4, last=True, activation_bytes=1e6)
             for machine in (replace(MACHINE, tp_block_s=5e-3), MACHINE)]
    assert alone[0] == alone[1]
