"""The planner's FP8 arithmetic (gridtrain/plan/float8.py) against numbers derived by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gridtrain.model.args import model_args
from gridtrain.plan.float8 import block_linear_params, float8_step
from gridtrain.plan.specs import accelerator, accelerator_from_table

ARGS = model_args("llama3-8b")
TOKENS = 8192


def test_block_linears_of_llama3_8b():
    # q, o: 4096 x 4096; k, v: 4096 x (8 x 128); w1, w2, w3: 4096 x 14336.
    per_block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert per_block == 218_103_808 == block_linear_params(ARGS)


def test_the_block_linears_run_at_twice_the_peak_on_an_h100():
    linear_flops = 6 * 32 * 218_103_808 * TOKENS  # 3.4305e14
    h100 = accelerator("h100")
    assert h100.fp8_tflops == 1979 and h100.peak_flops == 989e12
    fp8 = float8_step(ARGS, h100, "tensorwise", fsdp=True, tokens=TOKENS, other_flops_per_token=0.0)
    bf16 = float8_step(ARGS, h100, "none", fsdp=True, tokens=TOKENS, other_flops_per_token=0.0)
    assert fp8.matmul_s == pytest.approx(linear_flops / 1979e12) == pytest.approx(0.173344, rel=1e-5)
    assert bf16.matmul_s == pytest.approx(linear_flops / 989e12) == pytest.approx(0.346863, rel=1e-5)
    # The attention core and the head stay at the 16-bit peak: 1e9 FLOPs a token more cost 8192e9 / 989e12 s.
    more = float8_step(ARGS, h100, "rowwise", fsdp=True, tokens=TOKENS, other_flops_per_token=1e9)
    assert more.matmul_s - fp8.matmul_s == pytest.approx(8192e9 / 989e12)


def test_no_speedup_without_an_fp8_matmul():
    a100 = accelerator("a100")
    assert a100.fp8_tflops == 0
    fp8 = float8_step(ARGS, a100, "tensorwise", fsdp=False, tokens=TOKENS, other_flops_per_token=0.0)
    assert fp8.matmul_s == pytest.approx(6 * 32 * 218_103_808 * TOKENS / 312e12)


@pytest.mark.parametrize("recipe, fsdp, gathered, scales", [
    ("tensorwise", True, 1.0, 4 * 7 * 32),  # FSDP's float8 all-gather; one fp32 scale per weight
    ("tensorwise", False, 2.0, 0), ("rowwise", True, 2.0, 0), ("none", True, 2.0, 0),
])
def test_fsdp_gathers_one_byte_a_parameter_with_tensorwise(recipe, fsdp, gathered, scales):
    step = float8_step(ARGS, accelerator("h100"), recipe, fsdp, TOKENS, 0.0)
    assert step.gather_bytes_per_param == gathered and step.scale_bytes == scales


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
