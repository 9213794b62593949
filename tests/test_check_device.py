"""plan --check of runs on a GPU: the step time from the device's published peak and the share of
it gridtrain's kernels reached there (plan/reference_gpu.py, fixed by the H100 runs committed
under bench/gpu/results), and the peak memory against the allocator's reserved peak."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from gridtrain.plan.check_device import check_device_memory, check_device_step_time
from gridtrain.plan.reference_gpu import ONE_GPU, RUNS
from gridtrain.plan.run_collectives import run_layout
from gridtrain.plan.shape import from_args
from gridtrain.plan.specs import accelerator_of_device, cluster
from gridtrain.plan.state import StateBytes
from gridtrain.plan.steptime import step_time
from gridtrain.rundir import RunRecord

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "results" / "2026-11-27-h100"


def run_dir(run) -> Path:  # noqa: ANN001 - a GpuRun
    part = "part1" if run.implementation == "eager" else "part2"
    return RESULTS / part / f"speed-gridtrain-{run.shape}-{run.implementation}"


def predicted_with(run_path: Path, matmul: float) -> float:
    record = RunRecord.load(run_path)
    cfg, args = record.config, record.config.model.args()
    impl = "compiled" if cfg.train.compile else "eager"
    node = dataclasses.replace(cluster("dgx-h100"), accelerator=accelerator_of_device(record.device))
    eff = dataclasses.replace(ONE_GPU[impl], matmul=matmul)
    return step_time(from_args(args), run_layout(args, record.dims, cfg), node, eff,
                     StateBytes.gridtrain(cfg.train.precision), 2).total_s


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r.shape}-{r.implementation}")
def test_each_runs_share_of_the_peak_predicts_its_measured_step(run):
    """The table is the runs': each row's share gives its measured median step (within 1%), and
    the run directory's own metrics agree with the row."""
    path = run_dir(run)
    row, _, _ = check_device_step_time(path)
    assert row.measured == pytest.approx(run.step_s, rel=1e-3)
    assert predicted_with(path, run.matmul) == pytest.approx(run.step_s, rel=0.01)


@pytest.mark.parametrize("implementation", ["eager", "compiled"])
def test_one_shapes_share_predicts_the_other_shape_within_5_percent(implementation):
    """Cross-validation: the share fitted on the 1B shape (seq 8192, no recomputation) predicts the
    3B shape (seq 4096, full recomputation) that did not fix it, and the other way round."""
    one, three = (r for r in RUNS if r.implementation == implementation)
    assert predicted_with(run_dir(three), one.matmul) == pytest.approx(three.step_s, rel=0.05)
    assert predicted_with(run_dir(one), three.matmul) == pytest.approx(one.step_s, rel=0.05)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r.shape}-{r.implementation}")
def test_plan_check_of_an_h100_run_is_within_10_percent_and_names_the_memory_beyond_the_buckets(run):
    proc = subprocess.run([sys.executable, "-m", "gridtrain", "plan", "--check", str(run_dir(run))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("step time"))
    assert "one GPU as gridtrain measured it" in line and "H100" in line
    assert 0.9 <= float(line.rsplit("measured/predicted ", 1)[1]) <= 1.1
    memory = check_device_memory(run_dir(run))
    assert f"reserved {run.peak_reserved_GiB:.2f} GiB" in memory[0]
    assert "caching allocator" in memory[1] and "CUDA context" in memory[1]
    assert memory[0] in proc.stdout


def test_the_3b_shapes_peak_is_planned_within_5_percent_of_what_the_allocator_reserved():
    """With full recomputation the buckets are the peak: planned within 5% of max_memory_reserved
    (the 1B shape without recomputation holds its fp32 logits beyond them: README, GPU section)."""
    for run in (r for r in RUNS if r.shape == "3b"):
        first = check_device_memory(run_dir(run))[0]
        ratio = float(first.rsplit("reserved/planned ", 1)[1])
        assert 0.95 <= ratio <= 1.05, first


def test_a_run_without_its_metrics_is_named_not_a_traceback(tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir(RUNS[0]), run)
    (run / "metrics.jsonl").unlink()
    assert "metrics.jsonl is missing" in check_device_memory(run)[0]
