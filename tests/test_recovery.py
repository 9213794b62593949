"""Recovery from failures, end to end through `gridtrain train --nproc N`: a rank killed with
SIGKILL and restarted by torchrun finishes bit-identical to an uninterrupted run; a checkpoint
written under FSDP 4 continues under TP 2 x DP 2 and in one process; a stalled rank ends the run
within the collective timeout with an error naming it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist  # every test here starts several processes


ROOT = Path(__file__).resolve().parents[1]


def train(tmp: Path, corpus: Path, run: str, nproc: int, *args: str, check: bool = True,
          timeout: float = 600) -> subprocess.CompletedProcess:
    """`gridtrain train` on the tiny model: 8 steps of 4 sequences of 32 tokens, a checkpoint
    every 2 steps, metrics on every step."""
    cmd = [sys.executable, "-m", "gridtrain", "train", "--nproc", str(nproc), "--model.preset", "tiny",
           "--data.corpus", str(corpus), "--data.cache_dir", str(tmp / "cache"), "--data.seq_len", "32",
           "--train.global_batch", "4", "--train.micro_batch", "2", "--train.steps", "8",
           "--train.warmup_steps", "1", "--train.val_every", "0", "--checkpoint.interval", "2",
           "--metrics.log_every", "1", "--metrics.tensorboard", "false", "--metrics.progress", "false",
           "--metrics.account_every", "0", "--run_dir", str(tmp / run), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss; a resumed run's records replace the earlier attempt's."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss/train" in record:
            out[record["step"]] = record["loss/train"]
    return out


LAYOUTS = {"ddp2": ["--parallel.zero_stage", "0"], "fsdp2": [], "tp2": ["--parallel.tp", "2"],
           "pp2": ["--parallel.pp", "2"]}
# The FSDP 2 run saves in the background: a save is committed after the first step during which
# every rank finished writing it, so the kill at the start of step 7 finds step 4 committed and
# step 6 still pending (lost, as a crash loses it).
KILL = {"fsdp2": (7, ["--checkpoint.async_save", "true"])}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_killed_rank_restarts_and_finishes_bit_identical(tmp_path, corpus_dir, checkpoint_weights, name):
    """Rank 1 SIGKILLs itself at the start of step 5 (7); torchrun restarts both ranks, which
    resume from the step-4 checkpoint and finish step 8 with exactly the weights of a run never
    killed."""
    layout = LAYOUTS[name]
    at_step, extra = KILL.get(name, (5, []))
    train(tmp_path, corpus_dir, "clean", 2, *layout)
    proc = train(tmp_path, corpus_dir, "killed", 2, *layout, *extra, "--fault.kill_rank", "1",
                 "--fault.at_step", str(at_step), "--max-restarts", "1")
    log = proc.stdout + proc.stderr
    assert f"rank 1 kills itself (SIGKILL) at the start of step {at_step}" in log
    assert "torchrun restarted the run: resuming" in log
    assert re.search(r"resumed from \S+step-0000004 at step 4 \(sample offset 16\)", log), log[-3000:]
    clean = checkpoint_weights(tmp_path / "clean" / "checkpoints" / "step-0000008")
    killed = checkpoint_weights(tmp_path / "killed" / "checkpoints" / "step-0000008")
    assert clean.keys() == killed.keys()
    for key in clean:
        assert torch.equal(clean[key], killed[key]), key
    assert losses(tmp_path / "killed") == losses(tmp_path / "clean")


def test_fsdp4_checkpoint_continues_under_tp2_dp2_and_one_process(tmp_path, corpus_dir, make_config):
    """A checkpoint of step 4 written by FSDP over 4 ranks loads under TP 2 x DP 2 (4 ranks) and
    in one process. Steps 5-8 then read samples 16-31, the ones the uninterrupted FSDP 4 run read
    (any skipped or repeated sample would change the losses), and their losses match that run
    within fp32 tolerance (the layouts sum in different orders)."""
    one = ("--train.micro_batch", "1")  # 4 sequences over 4 data-parallel ranks
    train(tmp_path, corpus_dir, "fsdp4", 4, *one)
    reference = losses(tmp_path / "fsdp4")
    for run in ("tp2dp2", "one"):
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        shutil.copytree(tmp_path / "fsdp4" / "checkpoints" / "step-0000004",
                        tmp_path / run / "checkpoints" / "step-0000004")
    proc = train(tmp_path, corpus_dir, "tp2dp2", 4, *one, "--parallel.tp", "2", "--parallel.dp_shard", "2", "--resume")
    assert "at step 4 (sample offset 16)" in proc.stderr
    resumed = losses(tmp_path / "tp2dp2")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5), step

    from gridtrain.train.trainer import Trainer

    cfg = make_config(tmp_path, run_dir=str(tmp_path / "one"), **{"checkpoint.resume": True, "train.steps": 8,
                                                                   "data.cache_dir": str(tmp_path / "cache")})
    trainer = Trainer(cfg)
    assert trainer.step == 4
    for step in range(5, 9):
        assert trainer.train_step()["loss/train"] == pytest.approx(reference[step], rel=1e-5), step


@pytest.mark.alone  # a healthy collective must never take 5 s (tests/workers.py)
def test_stalled_rank_ends_the_run_within_the_timeout(tmp_path, corpus_dir):
    """Rank 1 stops responding at step 3; rank 0 gives up after train.collective_timeout_s (5 s),
    names rank 1, the collective and the step, and writes its last collectives; torchrun then
    stops the stalled rank. Without the timeout gloo would wait 30 minutes."""
    start = time.monotonic()
    proc = train(tmp_path, corpus_dir, "hang", 2, "--fault.hang_rank", "1", "--fault.at_step", "3",
                 "--train.collective_timeout_s", "5", check=False, timeout=300)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    log = proc.stderr
    assert "rank 1 stops responding at the start of step 3" in log
    message = re.search(r"gridtrain: rank 0 gave up on (\S+) over '(\w+)' .* at step 3 after 5 s \(train.collective_timeout_s\)", log)
    assert message, log[-4000:]
    assert "rank 1 never reached step 3 (last started: step 2)" in log
    record = json.loads((tmp_path / "hang" / "failures" / "rank0.json").read_text())
    assert record["step"] == 3 and record["ranks_last_step"] == {"0": 3, "1": 2}
    last = record["last_collectives"][-1]
    assert (last["kind"], last["axis"]) == message.groups()
    assert last["timeout_ms"] == 5000
    assert elapsed < 120, elapsed


def _run_until_step(cmd: list[str], run_dir: Path, step: int) -> subprocess.Popen:
    """Start `cmd` and return once its metrics show `step` trained."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and any(json.loads(line).get("step", 0) >= step
                                     for line in metrics.read_text().splitlines() if line.strip()):
            return proc
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the run never reached step {step}: {proc.communicate()[1][-3000:]}")


@pytest.mark.parametrize("nproc,sig", [(1, signal.SIGTERM), (1, signal.SIGUSR1), (2, signal.SIGTERM)])
def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(tmp_path, corpus_dir, nproc, sig):
    """What a scheduler sends before it stops a job: the run used to die at once with no checkpoint
    (exit 143, nothing kept with checkpoint.interval 1000). Now every rank finishes its step, one
    checkpoint of that step is saved and verifies, one line says how to resume, and the resumed
    run goes on from there. Under --nproc the launcher passes the signal on through torchrun."""
    from gridtrain.checkpoint.store import latest_valid_checkpoint

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gridtrain", "train", "--nproc", str(nproc), "--model.preset", "tiny",
           "--data.corpus", str(corpus_dir), "--data.cache_dir", str(tmp_path / "cache"), "--data.seq_len", "32",
           "--train.global_batch", "4", "--train.micro_batch", "2", "--train.steps", "100000",
           "--train.warmup_steps", "1", "--train.val_every", "0", "--checkpoint.interval", "1000",
           "--metrics.log_every", "1", "--metrics.tensorboard", "false", "--metrics.progress", "false",
           "--metrics.account_every", "0", "--run_dir", str(run_dir)]
    proc = _run_until_step(cmd, run_dir, 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    found = re.search(r"stopped by SIG\w+ after step (\d+); checkpoint (\S+) saved: continue with the same "
                      r"command and --resume", err)
    assert found, err[-3000:]
    assert proc.returncode != 0
    if nproc == 1:
        assert proc.returncode == 128 + sig and f"stopped by {sig.name}" in err
        assert "Traceback" not in err
    step = int(found.group(1))
    assert latest_valid_checkpoint(run_dir / "checkpoints")[0] == Path(found.group(2)) == \
        run_dir / "checkpoints" / f"step-{step:07d}"
    resumed = train(tmp_path, corpus_dir, "run", nproc, "--resume", "--train.steps", str(step + 2))
    assert f"resumed from {found.group(2)} at step {step}" in resumed.stdout + resumed.stderr


def _descendant_with_rank(pid: int, rank: int) -> int | None:
    """The process under `pid` (any depth) whose environment says RANK=`rank`."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    todo = list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            if f"RANK={rank}".encode() in (Path("/proc") / str(child) / "environ").read_bytes().split(b"\0"):
                return child
        except OSError:
            pass
        todo += parents.get(child, [])
    return None


@pytest.mark.alone  # the same 5 s, and named within 18 s (tests/workers.py)
def test_a_straggler_is_named_then_a_stopped_rank_within_the_timeout(tmp_path, corpus_dir):
    """Four processes (FSDP 4). Rank 2 computes at half speed (fault.slow_rank): after two windows
    of 3 steps the log names it as a straggler. Rank 3 is then stopped with SIGSTOP (alive, its
    sockets open, so no peer sees a connection drop): within train.collective_timeout_s (5 s) and
    the roll call, one line names rank 3, the collective and the step, and every live rank writes
    its flight recorder for torch's analyser."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gridtrain", "train", "--nproc", "4", "--model.preset", "tiny",
           "--data.corpus", str(corpus_dir), "--data.cache_dir", str(tmp_path / "cache"), "--data.seq_len", "32",
           "--train.global_batch", "4", "--train.micro_batch", "1", "--train.steps", "100000",
           "--train.warmup_steps", "1", "--train.val_every", "0", "--checkpoint.interval", "0",
           "--checkpoint.final", "false", "--metrics.tensorboard", "false", "--metrics.progress", "false",
           "--metrics.account_every", "0", "--metrics.straggler_every", "3", "--fault.slow_rank", "2",
           "--fault.at_step", "1", "--train.collective_timeout_s", "5", "--run_dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "log"
    stopped = None
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "straggler: rank" not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert re.search(r"straggler: rank 2 was the slowest in the last 2 windows of 3 steps, [\d.]+x the median",
                         log_path.read_text()), log_path.read_text()[-3000:]
        stopped = _descendant_with_rank(proc.pid, 3)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        named = None
        while named is None and time.monotonic() - start < 60:
            named = re.search(r"gridtrain: rank [012] gave up on (\S+) over '(\w+)' .* (?:at|after) step (\d+).* after 5 s "
                              r"\(train.collective_timeout_s\): rank 3 (started step (\d+) but went silent inside it|"
                              r"never reached step (\d+))", log_path.read_text())
            time.sleep(0.2)
        elapsed = time.monotonic() - start
    finally:
        if stopped:  # torchrun kills it once the others have exited
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
        proc.wait(timeout=120)
    log = log_path.read_text()
    assert named, "\n".join(line for line in log.splitlines() if line.startswith("gridtrain:")) + log[-3000:]
    assert named.group(3) == (named.group(5) or named.group(6))
    assert elapsed < 5 + 3 + 10, elapsed  # the timeout, the roll call, a loaded machine
    assert {p.name for p in (run_dir / "failures").glob("fr_trace_*")} >= {"fr_trace_0", "fr_trace_1", "fr_trace_2"}
