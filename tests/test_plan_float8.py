"""The planner's FP8 (plan --float8; gridtrain/plan/float8.py, steptime, memory, comm) against
numbers derived by hand for Llama 3 8B on H100s."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from gridtrain.model.args import model_args
from gridtrain.plan.comm import bytes_per_step
from gridtrain.plan.float8 import block_linear_params, gathered_bytes, matmul_peak, scale_bytes
from gridtrain.plan.layout import Layout
from gridtrain.plan.memory import buffer_bytes, rank_memory
from gridtrain.plan.shape import from_args
from gridtrain.plan.specs import accelerator, accelerator_from_table, cluster
from gridtrain.plan.state import StateBytes
from gridtrain.plan.steptime import IMPLEMENTATIONS, layer_cost

SHAPE = from_args(model_args("llama3-8b"))
LINEAR = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q, o; k, v (8 x 128); w1, w2, w3
STATE = StateBytes.gridtrain("bf16")


def test_block_linears_of_llama3_8b():
    assert LINEAR == 218_103_808 == block_linear_params(SHAPE)


def test_the_block_linears_run_at_the_fp8_peak_and_attention_stays_at_16_bits():
    """One layer, one micro-batch of 8,192 tokens, no recomputation: the linears' 6 x 218,103,808
    FLOPs a token at 1,979 TFLOP/s instead of 989 (x the eager share), the attention core's
    12 x 4096 x 8192 at 989 either way; nothing else in the layer changes."""
    h100 = accelerator("h100")
    assert h100.fp8_tflops == 1979 and matmul_peak(h100, "tensorwise") == 1979e12
    assert matmul_peak(h100, "none") == 989e12 == matmul_peak(accelerator("a100"), "rowwise") * 989 / 312
    node, eff = cluster("dgx-h100"), IMPLEMENTATIONS["eager"]
    bf16, fp8 = (layer_cost(SHAPE, node, eff, 8192, 1, 1, 1, False, "none", True, 2, f) for f in ("none", "rowwise"))
    linear = (6 * LINEAR + 6 * 2 * 4096) * 8192  # the block's two norm gains ride with the linears
    assert bf16.matmul_s - fp8.matmul_s == pytest.approx(linear / (989e12 * eff.matmul) - linear / (1979e12 * eff.matmul))
    assert (bf16.memory_bound_s, bf16.overhead_s) == (fp8.memory_bound_s, fp8.overhead_s)


def test_no_speedup_without_an_fp8_matmul():
    node, eff = cluster("selene-a100"), IMPLEMENTATIONS["eager"]
    assert node.accelerator.fp8_tflops == 0
    costs = [layer_cost(SHAPE, node, eff, 8192, 1, 1, 1, False, "none", True, 2, f) for f in ("none", "tensorwise")]
    assert costs[0] == costs[1]


def test_fsdp_gathers_the_block_linears_at_one_byte_with_tensorwise():
    """FSDP 8 of the whole model (32 layers, 8.03B parameters): the linears' 32 x 218,103,808 at
    1 byte, the rest (embedding, head, norms) at bf16's 2; rowwise and DDP gather nothing in float8."""
    params = 8_030_261_248
    linear = 32 * LINEAR
    assert gathered_bytes(SHAPE, params, 32, 1, 2.0, "tensorwise", 3, 8) == linear + 2 * (params - linear)
    for recipe, stage, shards in (("rowwise", 3, 8), ("tensorwise", 0, 8), ("tensorwise", 3, 1)):
        assert gathered_bytes(SHAPE, params, 32, 1, 2.0, recipe, stage, shards) == 2 * params
    assert scale_bytes(32, "tensorwise", 3, 8) == 4 * 7 * 32 and scale_bytes(32, "rowwise", 3, 8) == 0
    fsdp = Layout(dp_shard=8, zero_stage=3, seq_len=8192, num_microbatches=1)
    comm = [bytes_per_step(SHAPE, dataclasses.replace(fsdp, float8=f), 0, STATE)["dp_shard"] for f in ("none", "tensorwise")]
    # ZeRO-3 gathers twice a micro-batch (forward and backward): each gather 1 byte a linear parameter less.
    assert comm[0] - comm[1] == pytest.approx(2 * 7 / 8 * linear, rel=1e-9)


def test_fsdp_float8_holds_its_gathered_blocks_in_one_byte_and_counts_the_scales():
    fsdp = Layout(dp_shard=8, zero_stage=3, seq_len=8192, num_microbatches=1, recompute="selective")
    plain, fp8 = (dataclasses.replace(fsdp, float8=f) for f in ("none", "tensorwise"))
    block = LINEAR  # tp 1: the gathered block and the one prefetched, 2 bytes a parameter in bf16
    assert buffer_bytes(SHAPE, plain, STATE) - buffer_bytes(SHAPE, fp8, STATE) == 2 * block * (2 - 1)
    mem = [rank_memory(SHAPE, layout, STATE, 2, ranks=(0,))[0] for layout in (plain, fp8)]
    assert mem[0].buffers - mem[1].buffers == 2 * block - 4 * 7 * 32


def test_zero2_holds_its_gathered_block_linears_at_one_byte_with_tensorwise():
    """gridtrain's ZeRO-2 (FSDP without resharding after forward) holds every gathered weight from
    forward to backward: under tensorwise the 32 x 218,103,808 block-linear parameters in float8,
    1 byte less each than bf16's 2, less the scales it adds."""
    zero2 = Layout(dp_shard=8, zero_stage=2, seq_len=8192, num_microbatches=1, recompute="selective")
    mem = [rank_memory(SHAPE, dataclasses.replace(zero2, float8=f), STATE, 2, ranks=(0,))[0] for f in ("none", "tensorwise")]
    assert mem[0].buffers - mem[1].buffers == 32 * LINEAR * (2 - 1) - 4 * 7 * 32


def test_plan_float8_prints_what_it_prices_and_refuses_it_beside_fp32():
    run = lambda *a: subprocess.run([sys.executable, "-m", "gridtrain", "plan", "--model", "llama3-8b", "--gpu", "h100",  # noqa: E731
                                     "--num-gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top", "1", *a],
                                    capture_output=True, text=True, timeout=120)
    out = run("--float8", "tensorwise")
    assert out.returncode == 0, out.stderr
    assert "FP8 peak (1,979 TFLOP/s" in out.stdout and "--train.float8 tensorwise" in out.stdout
    bf16 = run()
    step = lambda text: float(next(l for l in text.splitlines() if l.startswith(" 1 ")).split()[-3])  # noqa: E731
    assert step(out.stdout) < step(bf16.stdout)
    refused = run("--float8", "rowwise", "--precision", "fp32")
    assert refused.returncode == 2 and "give --precision bf16" in refused.stderr


@pytest.mark.parametrize("gpu, chosen", [("h100", "FP8 tensorwise chosen"), ("a100", "bf16 (A100-80GB has no FP8 matmul)")])
def test_plan_float8_auto_ranks_with_and_without_it_and_takes_the_faster(gpu, chosen):
    """On an H100 FP8 halves the linears' time, so its best layout is faster and is taken (its
    train command says so); an A100 has no FP8 matmul: bf16."""
    out = subprocess.run([sys.executable, "-m", "gridtrain", "plan", "--model", "llama3-8b", "--gpu", gpu,
                          "--num-gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top", "1",
                          "--float8", "auto"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"--float8 auto: {chosen}" in out.stdout
    assert ("--train.float8 tensorwise" in out.stdout) == (gpu == "h100")


def test_a_hardware_file_may_leave_fp8_out():
    spec = accelerator_from_table("x", {"bf16_tflops": 100, "hbm_gb": 80, "hbm_gb_per_s": 2000,
                                        "link_gb_per_s": 900})
    assert spec.fp8_tflops == 0
    assert accelerator_from_table("y", {"bf16_tflops": 100, "hbm_gb": 80, "hbm_gb_per_s": 2000,
                                        "link_gb_per_s": 900, "fp8_tflops": 200}).fp8_tflops == 200


def test_the_planners_float8_imports_no_torch():
    code = "import sys, gridtrain.plan.float8; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plan_check_predicts_fsdps_float8_gathers_and_the_scales_all_reduce():
    """FSDP 2 of `tiny` (2 blocks of 7 linears: 2 x (64 x 64 + 64 x 32 x 2 + 64 x 64 + 3 x 64 x 160)
    = 86,016 elements), one micro-batch: ZeRO-3 gathers block 0 twice and the last block once
    (kept gathered), so float8 moves 3 x 43,008 = 129,024 bytes less than bf16's 2 bytes an
    element; and all-reduces one fp32 scale per linear after the step, 14 x 4 = 56 bytes. (A real
    2-process run measured 211,840 and 509,324 bytes, each rank, which these predictions equal.)"""
    from gridtrain.config_load import load_config
    from gridtrain.plan.run_collectives import predict_collectives
    from gridtrain.validate import validate

    keys = {"model.preset": "tiny", "data.seq_len": 64, "train.global_batch": 2, "train.micro_batch": 1,
            "train.precision": "bf16", "parallel.zero_stage": 3, "parallel.dp_shard": 2}
    bf16, fp8 = (load_config(None, {**keys, "train.float8": f}) for f in ("none", "tensorwise"))
    dims = validate(bf16, 2)
    plain, f8 = (predict_collectives(cfg.model.args(), dims, cfg, 0) for cfg in (bf16, fp8))
    assert plain["dp_shard/all_gather_bytes"] - f8["dp_shard/all_gather_bytes"] == 3 * 43_008
    assert f8["dp_shard/all_reduce_bytes"] - plain["dp_shard/all_reduce_bytes"] == 14 * 4
    assert (f8["dp_shard/all_gather_bytes"], f8["dp_shard/all_reduce_bytes"]) == (211_840, 509_324)
