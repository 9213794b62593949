"""`gridtrain calibrate` on a busy machine: a peak measured while other processes take the CPU
is too low (it once made a run report 193% MFU), so it is not cached; and a cached peak that a
run beats is measured again rather than reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gridtrain.plan.machine import machine_key
from gridtrain.train import calibrate as hardware

REAL_CALIBRATE = hardware.calibrate


@pytest.mark.alone  # a busy process on every core (tests/workers.py)
def test_a_calibration_beside_busy_processes_is_not_cached_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GRIDTRAIN_CACHE", str(tmp_path))
    cores = os.cpu_count() or 1
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        entry, why = REAL_CALIBRATE(threads=cores, seconds=0.6, modes=("fp32",), local=False)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert entry["cpu_share"] < hardware.LOADED_SHARE, entry["cpu_share"]
    assert why.startswith("not cached: this process had") and "another process is busy" in why
    assert not (tmp_path / "calibration.json").exists()
    assert any("not cached" in r.getMessage() for r in caplog.records)


def test_an_idle_calibration_is_cached_as_the_best_of_its_rounds(tmp_path, monkeypatch):
    monkeypatch.setenv("GRIDTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(hardware, "LOADED_SHARE", 0.0)  # the stand-in measures nothing: no CPU share to judge
    rounds = []
    monkeypatch.setattr(hardware, "measure_peak", lambda dtype, seconds: rounds.append(seconds) or 1e9 * len(rounds))
    entry, why = REAL_CALIBRATE(threads=1, seconds=0.3, modes=("fp32",), local=False)
    assert why == "" and len(rounds) == hardware.ROUNDS and sum(rounds) == pytest.approx(0.3)
    cached = json.loads((tmp_path / "calibration.json").read_text())[machine_key(1)]
    assert cached["peak_flops"]["fp32"] == 1e9 * hardware.ROUNDS == entry["peak_flops"]["fp32"]


def test_a_run_faster_than_its_cached_peak_measures_the_peak_again(tmp_path, make_config, monkeypatch, caplog, on_cpu):
    """A cached peak of 1 MFLOP/s makes the tiny model's MFU far above 100%: the trainer measures
    the peak again once, and reports MFU against that. (A CPU's peak is measured; an accelerator's
    is its published one, never re-measured: so the trainer runs on the CPU here.) A process
    measures it once, whatever number of Trainers it builds."""
    from gridtrain.train.trainer import Trainer

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "calibration.json").write_text(json.dumps({machine_key(1): {"peak_flops": {"fp32": 1e6}}}))
    monkeypatch.setenv("GRIDTRAIN_CACHE", str(cache))
    calls = []

    def measured(threads, seconds, modes, local):
        calls.append(modes)
        return {"peak_flops": {"fp32": 1e15}}, ""

    monkeypatch.setattr(hardware, "calibrate", measured)
    trainer = Trainer(make_config(tmp_path, **{"train.steps": 3, "train.threads": 1}))
    mfus = [trainer.train_step()["mfu_pct"] for _ in range(3)]
    trainer.release()
    assert trainer.device == on_cpu
    assert calls == [("fp32",)]  # once, not every step
    assert all(m < 100 for m in mfus) and trainer.peak == 1e15
    assert any("measured low" in r.getMessage() for r in caplog.records)
    # A second Trainer of the process (a parity launch builds two a case) takes what it measured.
    again = Trainer(make_config(tmp_path / "again", **{"train.steps": 3, "train.threads": 1}))
    again.train_step()
    again.release()
    assert calls == [("fp32",)] and again.peak == 1e15


def test_the_elementwise_share_is_what_the_block_spends_beyond_its_kernels(monkeypatch):
    """A block of 100 ms whose matmuls take 40 and attention 30, with 1 ms of framework time, spends
    29 ms on elementwise work; the share is the planner's memory-bound seconds for that block (4
    passes over its saved activations at the measured bandwidth) over those 29 ms, at most 1."""
    import torch

    from gridtrain.plan import shape
    from gridtrain.plan.memory import layer_activation_bytes
    from gridtrain.train import calibrate_kernels as kernels

    monkeypatch.setattr(kernels, "block_parts", lambda dtype: {"block": 0.1, "matmul": 0.04, "attention": 0.03})
    b = kernels.BLOCK
    saved = layer_activation_bytes(shape.from_args(kernels.calibration_block_args()), b["seq"], b["batch"], act_bytes=2)
    assert saved > 0
    share = kernels.measure_elementwise_share(torch.bfloat16, 4e12, 1e-3)
    assert share == pytest.approx(4 * saved / 4e12 / 0.029)
    assert kernels.measure_elementwise_share(torch.bfloat16, 1e6, 1e-3) == 1.0  # never above the bandwidth
