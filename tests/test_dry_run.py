"""Dry runs of full-width Llama 3 layouts (gridtrain/train/dry_run.py): one rank of a job of many,
on this CPU, under a fake process group and fake tensors, checked against the planner.

That a dry run measures what a real run of the same layout measures is tests/test_parallel.py's
(test_dry_run_measures_what_the_run_measured, every multi-rank layout there). Here: the full
Llama 3 8B on FSDP 8, and the 70B's width and layout (TP 8 with sequence parallelism, PP 4, data
parallel 2 over 64 ranks) with 8 of its 80 layers, so the suite stays fast; the full-depth runs
and the 405B are bench/bench_dry_run.py's, with their figures in the README.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gridtrain.compat import PIPELINE_STAGE_META
from gridtrain.plan.check_run import check_run

COMMON = ["--data.seq_len=8192", "--train.micro_batch=1", "--train.precision=bf16"]
LLAMA3_8B_FSDP8 = ["--model.preset=llama3-8b", "--train.global_batch=8"]
LLAMA3_70B_TP8_PP4_DP2 = ["--model.preset=llama3-70b", "--model.n_layers=8", "--train.global_batch=16",
                          "--parallel.tp=8", "--parallel.pp=4", "--parallel.sequence_parallel=true"]


def dry_run(run_dir: Path, world: int, rank: int, args: list[str]) -> str:
    cmd = [sys.executable, "-m", "gridtrain", "train", "--dry-run", f"--world={world}", f"--rank={rank}",
           *COMMON, *args, f"--run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def peak_rss_gib(stdout: str) -> float:
    return float(stdout.split("peak RSS ")[1].split(" GiB")[0])


def test_llama3_8b_on_fsdp8_one_rank_is_the_plan_to_the_byte(tmp_path):
    """Rank 3 of Llama 3 8B on 8 ranks (FSDP 8, seq 8192, bf16), dry-run in well under a GB of
    this machine's memory: its parameter, gradient and optimizer bytes, its saved activations and
    every collective's bytes are the planner's, to the byte. What it builds is its shard only (an
    eighth of 16 GB of fp32 weights, plus the RoPE table)."""
    out = dry_run(tmp_path / "run", 8, 3, LLAMA3_8B_FSDP8)
    assert peak_rss_gib(out) < 1.5
    rows = check_run(tmp_path / "run")
    assert {r.rank for r in rows} == {3}
    assert {r.bucket for r in rows} >= {"weights", "gradients", "optimizer", "activations",
                                        "dp_shard/all_gather_bytes", "dp_shard/reduce_scatter_bytes"}
    for row in rows:
        assert row.measured == row.predicted, (row.bucket, row.predicted, row.measured)
    record = json.loads((tmp_path / "run" / "accounting" / "rank3.jsonl").read_text())
    weights = record["memory/weights_bytes"]
    assert weights == pytest.approx(8.03e9 * 4 / 8, rel=0.01)
    assert weights <= record["memory/built_bytes"] <= weights + 8192 * 64 * 8  # + the complex64 RoPE table


def test_llama3_70b_layout_first_and_last_pipeline_rank_are_the_plan(tmp_path):
    """The 70B's width on its 64-rank layout (TP 8 + SP, PP 4, DP 2), first and last pipeline rank
    into one run directory: state, activations and every collective per axis as planned, to the
    byte; `gridtrain plan --check` lists both ranks and says there is no step time to check."""
    for rank in (0, 63):
        out = dry_run(tmp_path / "run", 64, rank, LLAMA3_70B_TP8_PP4_DP2)
        assert f"dry run of rank {rank} of 64" in out and peak_rss_gib(out) < 1.5
    rows = check_run(tmp_path / "run")
    assert {r.rank for r in rows} == {0, 63}
    for row in rows:
        if row.bucket == "dp_shard/all_gather_bytes" and not PIPELINE_STAGE_META:
            continue  # torch < 2.13's schedules unshard FSDP units other times (5% fewer bytes on rank 0 here)
        assert row.measured == pytest.approx(row.predicted, rel=1e-6, abs=8), (row.rank, row.bucket)
    assert {r.bucket for r in rows} >= {"tp/all_gather_bytes", "tp/reduce_scatter_bytes", "pp/send_bytes",
                                        "dp_shard/all_gather_bytes", "dp_shard/reduce_scatter_bytes"}
    proc = subprocess.run([sys.executable, "-m", "gridtrain", "plan", "--check", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "a dry run computes nothing" in proc.stdout and "  63  pp/send_bytes" in proc.stdout


def test_a_dry_run_does_not_mix_with_another_job(tmp_path):
    """Ranks of one job share a run directory; another job's dry run is refused there, and the
    directory keeps the first job's records."""
    dry_run(tmp_path / "run", 8, 0, LLAMA3_8B_FSDP8[:1] + ["--model.n_layers=2", "--train.global_batch=8"])
    before = (tmp_path / "run" / "config.json").read_text()
    cmd = [sys.executable, "-m", "gridtrain", "train", "--dry-run", "--world=16", *COMMON, "--model.preset=llama3-8b",
           "--model.n_layers=2", "--train.global_batch=16", f"--run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "holds the dry run of another job" in proc.stderr
    assert (tmp_path / "run" / "config.json").read_text() == before


def test_a_dry_run_hides_the_accelerators_from_itself_and_gives_them_back(tmp_path, monkeypatch, capsys):
    """A dry run computes on fake CPU tensors: torch's availability probes must not load a GPU
    driver into it; whatever this process runs after it sees the devices as before."""
    import os

    from gridtrain.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    seen = {}
    import gridtrain.train.dry_run as dry_run_module

    real = dry_run_module.dry_run

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.update({k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")})
        return real(*args, **kwargs)

    monkeypatch.setattr(dry_run_module, "dry_run", spy)
    code = main(["train", "--dry-run", "--world", "2", "--model.preset", "tiny", "--data.seq_len", "32",
                 "--train.global_batch", "2", "--train.micro_batch", "1", "--run_dir", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    assert seen == {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and "HIP_VISIBLE_DEVICES" not in os.environ


MIXTRAL_EP8 = ["--model.preset=mixtral-8x7b", "--model.n_layers=8", "--data.seq_len=4096", "--train.global_batch=16",
               "--parallel.pp=2", "--parallel.dp_shard=8", "--parallel.ep=8", "--train.recompute=none"]


def test_mixtral_expert_parallel_rank_is_the_plan(tmp_path):
    """Mixtral 8x7B's width (8 of its 32 layers) on PP 2 x FSDP 8 = EP 8, one expert per rank and
    layer: the dry run routes every token by a fixed balanced rule (train/dry_routing.py), so each
    bucket and each collective, the all-to-alls included, is the planner's expectation to the byte;
    and the planner's search (memory.rank_memory, what `gridtrain plan` ranks by) holds the same
    state bytes and, routing balanced, the same activations."""
    from gridtrain.model.args import model_args
    from gridtrain.plan import memory
    from gridtrain.plan.layout import Layout
    from gridtrain.plan.shape import from_args
    from gridtrain.plan.state import StateBytes

    out = dry_run(tmp_path / "run", 16, 0, MIXTRAL_EP8[:3] + ["--train.micro_batch=1"] + MIXTRAL_EP8[3:])
    assert peak_rss_gib(out) < 1.5
    rows = check_run(tmp_path / "run")
    assert {r.bucket for r in rows} >= {"activations", "dp_cp/all_to_all_bytes", "dp_shard/all_gather_bytes"}
    for row in rows:
        assert row.measured == row.predicted, (row.bucket, row.predicted, row.measured)
    record = json.loads((tmp_path / "run" / "accounting" / "rank0.jsonl").read_text())
    shape = from_args(model_args("mixtral-8x7b", n_layers=8))
    layout = Layout(pp=2, dp_shard=8, ep=8, zero_stage=3, micro_batch=1, seq_len=4096, num_microbatches=2)
    planned = memory.rank_memory(shape, layout, StateBytes.gridtrain("bf16"), 2, ranks=(0,))[0]
    for bucket in ("weights", "gradients", "optimizer"):
        assert getattr(planned, bucket) == record[f"memory/{bucket}_bytes"], bucket
    # The search plans routed rows at the imbalance allowance: above the balanced dry run's bytes.
    assert planned.activations > record["memory/activations_bytes"]


SMALL_PP2_FSDP2 = ["--model.preset=small", "--model.n_layers=8", "--data.seq_len=64", "--train.micro_batch=1",
                   "--train.global_batch=16", "--train.precision=bf16", "--parallel.pp=2", "--parallel.dp_shard=2",
                   "--parallel.zero_stage=3", "--parallel.pp_virtual_stages=2"]


@pytest.mark.parametrize("schedule,rank", [("interleaved-1f1b", 3), ("looped-bfs", 0), ("zbv", 3)])
def test_zero3_beside_a_multi_stage_schedule_is_exact(tmp_path, schedule, rank):
    """ZeRO-3 under PP 2 x FSDP 2 with two stages a rank (8 blocks, 8 micro-batches): every micro-
    batch's forward gathers the rank's blocks again but the last block of each of its stages (and
    the head), which stay gathered to their backward, and the first backward once more; the
    embedding once per micro-batch. plan --check's estimate said one gather each way (2.5x under
    the dry run's all-gather bytes), and under ZB-V one gather a step (5x under: the rule had been
    measured at one block a stage, where every block is its stage's last); each rank's row is now
    exact, as are the others."""
    cmd = [sys.executable, "-m", "gridtrain", "train", "--dry-run", "--world=4", f"--rank={rank}",
           *SMALL_PP2_FSDP2, f"--parallel.pp_schedule={schedule}", f"--run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = check_run(tmp_path / "run")
    assert "dp_shard/all_gather_bytes" in {r.bucket for r in rows}
    for row in rows:
        assert row.measured == row.predicted, (row.bucket, row.predicted, row.measured)
