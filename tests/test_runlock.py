"""One writer per run directory: a second `train` (or `--resume`, or a `--nproc` launch) into a
directory a job is training in is refused at once naming the holder, the first finishes with
every step and checkpoint intact, and a lock left by kill -9 is taken over by the next --resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_recovery import _run_until_step as start_until

from gridtrain.runlock import LOCK_FILE, Holder, RunDirInUse, RunLock, holder
from gridtrain.checkpoint.store import list_checkpoints
from gridtrain.checkpoint.manifest import verify

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def train_cmd(tmp: Path, corpus: Path, run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "gridtrain", "train", "--model.preset", "tiny", "--data.corpus", str(corpus),
            "--data.cache_dir", str(tmp / "cache"), "--data.seq_len", "32", "--train.global_batch", "4",
            "--train.micro_batch", "2", "--train.warmup_steps", "1", "--train.val_every", "0",
            "--train.sample_tokens", "0", "--metrics.tensorboard", "false", "--metrics.progress", "false",
            "--metrics.account_every", "0", "--train.threads", "1", "--run_dir", str(run_dir), *args]


def steps_of(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss/train" in line]


@pytest.mark.dist
def test_a_second_job_is_refused_and_the_first_finishes_intact(tmp_path, corpus_dir):
    run_dir = tmp_path / "run"
    first = start_until(train_cmd(tmp_path, corpus_dir, run_dir, "--train.steps", "1200",
                                  "--checkpoint.interval", "300"), run_dir, 2)
    config = (run_dir / "config.json").read_bytes()
    for extra in ([], ["--resume"], ["--nproc", "2"], ["--resume", "--nproc", "2"]):
        second = subprocess.run(train_cmd(tmp_path, corpus_dir, run_dir, "--train.steps", "1200", *extra),
                                env=ENV, capture_output=True, text=True, timeout=120)
        assert first.poll() is None, "the first job ended before the second was refused: lengthen it"
        lines = second.stderr.splitlines()
        assert second.returncode == 2 and len(lines) == 1, (extra, second.stderr)
        assert f"{run_dir} is in use by another gridtrain job (host " in lines[0], lines[0]
        assert f"PID {first.pid}, started " in lines[0] and "launching" not in second.stderr
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert (run_dir / "config.json").read_bytes() == config
    assert steps_of(run_dir) == list(range(1, 1201))
    saved = list_checkpoints(run_dir / "checkpoints")
    assert [s for s, _ in saved] == [600, 900, 1200] and all(verify(p) is None for _, p in saved)
    assert holder(run_dir) is None and (run_dir / LOCK_FILE).read_text() == ""  # released cleanly


@pytest.mark.dist
def test_a_lock_left_by_kill_9_is_taken_over_by_the_next_resume(tmp_path, corpus_dir):
    run_dir = tmp_path / "run"
    job = start_until(train_cmd(tmp_path, corpus_dir, run_dir, "--train.steps", "100000",
                                "--checkpoint.interval", "5"), run_dir, 6)
    job.send_signal(signal.SIGKILL)
    job.communicate(timeout=60)
    left = Holder.parse((run_dir / LOCK_FILE).read_text())
    assert left is not None and left.pid == job.pid  # the killed job's name is still in the file
    assert holder(run_dir) is None  # but its lock went with it
    # the killed job may have run on past step 6 before the kill landed: resume beyond its last save
    last = max(step for step, _ in list_checkpoints(run_dir / "checkpoints"))
    end = last + 6
    resumed = subprocess.run(train_cmd(tmp_path, corpus_dir, run_dir, "--resume", "--train.steps", str(end)),
                             env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"the job that held it (host {left.host}, PID {job.pid}, started {left.started}) ended without " \
           "releasing it (killed?); taken over" in resumed.stderr
    assert steps_of(run_dir)[-1] == end


def hold_in_child(run_dir: Path) -> subprocess.Popen:
    code = ("import sys, time; from gridtrain.runlock import RunLock; lock = RunLock.acquire(sys.argv[1]); "
            "print('held', flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "held\n"
    return child


def test_the_lock_names_its_holder_and_outlives_nothing(tmp_path):
    """In one process: a held lock names host, PID and start; a second acquire waits its retry and
    is refused; the holder's death frees it, and the next holder is told whose it was."""
    run_dir = tmp_path / "run"
    child = hold_in_child(run_dir)
    try:
        found = holder(run_dir)
        assert found is not None and found.pid == child.pid and found.host == os.uname().nodename
        start = time.monotonic()
        with pytest.raises(RunDirInUse, match=f"in use by another gridtrain job \\(host .*, PID {child.pid}, started"):
            RunLock.acquire(run_dir, retry_s=0.3)
        assert time.monotonic() - start >= 0.3
    finally:
        child.kill()
        child.wait()
    lock = RunLock.acquire(run_dir, retry_s=0)
    assert lock.previous is not None and lock.previous.pid == child.pid
    assert holder(run_dir) is None  # this process's own lock is not another job's
    lock.release()
    assert (run_dir / LOCK_FILE).read_text() == ""
    again = RunLock.acquire(run_dir, retry_s=0)
    assert again.previous is None  # a clean release leaves no one behind
    again.release()


@pytest.mark.parametrize("shape", ["symlink", "fifo", "directory"])
def test_a_lock_file_that_is_not_a_file_is_refused_and_nothing_is_written(tmp_path, shape):
    """A link is never followed (it would have emptied the file it points to), a fifo never waited
    on (it hung `train`), a folder named as the lock never mistaken for one: one line, exit 2."""
    run_dir, victim = tmp_path / "run", tmp_path / "precious.txt"
    run_dir.mkdir()
    victim.write_text("precious\n")
    lock = run_dir / LOCK_FILE
    {"symlink": lambda: lock.symlink_to(victim), "fifo": lambda: os.mkfifo(lock), "directory": lock.mkdir}[shape]()
    for attempt in (lambda: holder(run_dir), lambda: RunLock.acquire(run_dir, retry_s=0)):
        with pytest.raises(RunDirInUse, match=f"its lock file {LOCK_FILE} (is not a regular file|cannot be opened)"):
            attempt()
    assert victim.read_text() == "precious\n"


def test_garbage_in_a_lock_file_is_no_holder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for text in ('{"host": "h", "pid": 1e999, "started": "x"}', "[" * 60000, "\xff\xfe", ""):
        (run_dir / LOCK_FILE).write_text(text)
        assert holder(run_dir) is None
        lock = RunLock.acquire(run_dir, retry_s=0)
        assert lock.previous is None
        lock.release()


def test_a_shared_checkpoint_directory_is_held_too(tmp_path, corpus_dir, capsys):
    """Two jobs in different run directories sharing a checkpoint.dir deleted each other's saves
    (one died at its fourth step): the second is refused, naming the first."""
    from conftest import cli_train

    shared = tmp_path / "shared-checkpoints"
    child = hold_in_child(shared)
    try:
        assert cli_train(tmp_path / "b", corpus_dir, "--checkpoint.dir", str(shared)) == 2
    finally:
        child.kill()
        child.wait()
    err = capsys.readouterr().err
    assert f"{shared} is in use by another gridtrain job (host " in err and f"PID {child.pid}" in err
    assert not (tmp_path / "b" / "config.json").exists()
