"""bench/bench_local_plan.py's quiet-machine test: the share of the machine's cores that other
processes took while a run ran (above BUSY_SHARE the bench gives no verdict)."""

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


def test_the_bench_gives_no_verdict_where_other_processes_took_the_cores():
    """A 10 s run on 2 cores whose own processes used 14 CPU seconds (start-up and gloo's waits
    leave a quiet run's cores part idle): on a quiet machine the machine's busy time is about its
    own, others' share 0.0 (a verdict); beside one busy process, 10 more CPU seconds of the 20 the
    machine had: 0.5 (no verdict). Measured from the run's own side both would read 70%."""
    bench = _bench()
    quiet, busy = bench.others_share(14.5, 14.0, 10.0, 2), bench.others_share(24.0, 14.0, 10.0, 2)
    assert quiet == pytest.approx(0.025) and quiet < bench.BUSY_SHARE
    assert busy == pytest.approx(0.5) and busy > bench.BUSY_SHARE
    assert bench.others_share(13.0, 14.0, 10.0, 2) == 0.0  # clock granularity: never negative
    assert bench.busy_cpu_seconds() > 0 or not Path("/proc/stat").exists()
