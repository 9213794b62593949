"""bench/bench_local_plan.py's quiet-machine test: the share of the cores a run could use that its
processes got (below QUIET_SHARE the bench gives no verdict)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _bench():
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_local_plan.py"
    spec = importlib.util.spec_from_file_location("bench_local_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_quiet_run_gets_all_the_cores_its_ranks_could_use():
    """2 ranks of one thread busy for all of a 10 s run: 20 CPU seconds. On 16 cores they could use
    2 (the launcher and torchrun's agent wait): share 20 / (10 x 2) = 1.0, a verdict; counting the
    launcher as a third core gave 20 / 30 = 0.67, below the 0.8 of a quiet machine, so the bench never
    gave a verdict on a machine with more cores than ranks. 4 ranks on 2 cores: 20 / (10 x 2) = 1.0;
    a run beside a busy process, 12 CPU seconds of 20: 0.6, no verdict."""
    bench = _bench()
    assert bench.cpu_share(20.0, 10.0, 2, 16) == pytest.approx(1.0) and bench.QUIET_SHARE <= 1.0
    assert bench.cpu_share(20.0, 10.0, 4, 2) == pytest.approx(1.0)
    assert bench.cpu_share(12.0, 10.0, 2, 2) == pytest.approx(0.6) and 0.6 < bench.QUIET_SHARE
