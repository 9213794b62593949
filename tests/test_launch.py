"""End to end through the command line: `gridtrain train --nproc N` starts torchrun, rank 0 prints
the units table, the writer rank logs metrics, each rank writes its accounting."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.dist
def test_train_nproc_launches_and_logs(tmp_path, corpus_dir):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gridtrain", "train", "--nproc", "4", "--parallel.pp", "2",
           "--parallel.tp", "2", "--model.preset", "tiny", "--model.n_kv_heads", "2",
           "--data.corpus", str(corpus_dir), "--data.cache_dir", str(tmp_path / "cache"),
           "--data.seq_len", "32", "--train.global_batch", "4", "--train.micro_batch", "2",
           "--train.steps", "3", "--train.warmup_steps", "1", "--train.val_every", "3",
           "--metrics.log_every", "1", "--metrics.tensorboard", "false", "--run_dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "launching 4 processes" in log
    assert "Units of one step:" in log
    assert re.search(r"Pipeline stage +2 +2 GPUs", log)
    assert "stage 1 (pp rank 1): layers 1-1" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss/train" in r]
    assert steps == [1, 2, 3]
    val = [r["loss/val"] for r in records if "loss/val" in r]
    assert len(val) == 2 and val[-1] < val[0]  # step 0 and step 3, through the pipeline
    ranks = sorted(p.name for p in (run_dir / "accounting").glob("rank*.jsonl"))
    assert ranks == [f"rank{r}.jsonl" for r in range(4)]


def test_torchrun_failure_is_one_line_naming_the_first_rank():
    """torchrun's ChildFailedError (a traceback and a 30-line summary) becomes one line: the rank
    that failed first and how, and how many stopped with it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from gridtrain.launch import failure_line

    killed = ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file="/nonexistent/error.json")
    stopped = ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file="/nonexistent/error.json")
    stopped.timestamp = killed.timestamp + 1
    assert failure_line(ChildFailedError("gridtrain", {0: stopped, 1: killed})) == (
        "gridtrain: rank 1 was killed by signal 9 (SIGKILL) first; 1 other rank stopped with it "
        "(its own message, if any, is above)")
    exited = ProcessFailure(local_rank=0, pid=12, exitcode=2, error_file="/nonexistent/error.json")
    assert failure_line(ChildFailedError("gridtrain", {3: exited})) == (
        "gridtrain: rank 3 exited with status 2 first (its own message, if any, is above)")


@pytest.mark.dist
def test_the_launcher_keeps_the_failed_ranks_exit_status(tmp_path):
    """Rank 1 exits 3 (bad input exits 2): the launch exits 3 too, with one line naming rank 1."""
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = subprocess.run([sys.executable, "-m", "gridtrain.launch", "--standalone", "--nproc-per-node=2",
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.splitlines()[-1] == ("gridtrain: rank 1 exited with status 3 first (its own message, "
                                            "if any, is above)")
    assert "Traceback" not in proc.stderr
