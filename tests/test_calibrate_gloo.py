"""calibrate_gloo's failures: a launch whose later processes cannot start leaves none of the
earlier ones running, and a calibration whose processes fail keeps no figures an earlier one
measured between processes beside its own between threads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gridtrain.train import calibrate_gloo


def test_a_launch_that_fails_to_start_a_rank_leaves_no_process_behind(monkeypatch):
    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(cmd, **kwargs):  # noqa: ANN001, ANN202 - subprocess.Popen's own signature
        if started:
            raise OSError("no more processes")
        started.append(real([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
        return started[0]

    monkeypatch.setattr(calibrate_gloo.subprocess, "Popen", popen)
    with pytest.raises(OSError, match="no more processes"):
        calibrate_gloo._launch(2, 1, 1)
    alive = started[0].poll() is None
    if alive:
        started[0].kill()
        started[0].wait()
    assert not alive


def test_failed_processes_drop_an_earlier_calibrations_figures_between_processes(monkeypatch):
    def fail(world: int, threads: int, steps: int) -> dict[str, float]:
        raise OSError("gloo: connection refused")

    monkeypatch.setattr(calibrate_gloo, "_launch", fail)
    measured = calibrate_gloo.measure_processes(1, 2)
    assert measured == {}
    # An earlier calibration's entry, with this one's between-thread figures already put in.
    entry = {"gloo_bytes_per_s": 2e9, "gloo_latency_s": 1e-4, "gloo_ring_step_s": {"2": 1.8e-4, "4": 7.5e-4},
             "fsdp_call_s": 1.4e-3, "tp_block_s": 8e-3, "layer_overhead_s": 1e-3}
    calibrate_gloo.merge_processes(entry, measured)
    assert entry == {"gloo_bytes_per_s": 2e9, "gloo_latency_s": 1e-4, "layer_overhead_s": 1e-3}
    calibrate_gloo.merge_processes(entry, {"gloo_latency_s": 3e-4, "fsdp_call_s": 1e-3})
    assert entry == {"gloo_bytes_per_s": 2e9, "gloo_latency_s": 3e-4, "layer_overhead_s": 1e-3, "fsdp_call_s": 1e-3}


def test_the_latency_launches_stop_at_32_processes():
    """2, the cores' ranks and twice that, as measured on this 2-core machine (2 and 4); a 64-core
    machine at one thread a rank measures 2, 32 and 32, not 128 processes."""
    from gridtrain.train.calibrate_gloo import launch_sizes

    assert launch_sizes(2, 1) == [2, 4]
    assert launch_sizes(64, 1) == [2, 32]
    assert launch_sizes(8, 2) == [2, 4, 8]
    assert launch_sizes(1, 1) == [2]
