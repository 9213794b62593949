"""torchft replica groups on loopback: a lighthouse and 2 replica groups, each its own `gridtrain
train --nproc 2` job of FSDP 2 (HSDP 2 x 2 over 4 processes), on the tiny model.

`run_groups` runs the scenario; bench/bench_ft_rejoin.py runs it in full (20 steps, group 1 killed
at step 5, restarted by torchrun, rejoining from group 0's state: about 50 s here, too long for CI).
The test runs the cheap part: 4 steps of both groups. Each step's loss equals the one-process run's
(the global batch split between the groups and the gradients summed across them through torchft's
managed process group), and the final checkpoints of the two groups hold equal weights.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from test_multinode import free_port, records

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]


def flags(corpus: Path, tmp: Path, run: str, steps: int, *extra: str) -> list[str]:
    """The tiny model, 4 sequences of 32 tokens a step, the final checkpoint only."""
    return ["--model.preset", "tiny", "--data.corpus", str(corpus), "--data.cache_dir", str(tmp / "cache"),
            "--data.seq_len", "32", "--train.global_batch", "4", "--train.micro_batch", "1",
            "--train.steps", str(steps), "--train.warmup_steps", "1", "--train.val_every", "0",
            "--train.threads", "1", "--train.collective_timeout_s", "20", "--checkpoint.interval", str(steps),
            "--checkpoint.signal_grace_s", "0", "--metrics.log_every", "1", "--metrics.tensorboard", "false",
            "--metrics.progress", "false", "--metrics.account_every", "0", "--run_dir", str(tmp / run), *extra]


def start_group(corpus: Path, tmp: Path, steps: int, index: int, lighthouse: str, *extra: str) -> subprocess.Popen:
    """Replica group `index` as its own 2-process job, its output in tmp/g<index>.log."""
    ft = ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--parallel.zero_stage", "3",
          "--fault_tolerance.enabled", "true", "--fault_tolerance.lighthouse", lighthouse,
          "--fault_tolerance.replica_group", str(index), "--fault_tolerance.timeout_s", "10"]
    cmd = [sys.executable, "-m", "gridtrain", "train", "--nproc", "2",
           *flags(corpus, tmp, f"g{index}", steps, *ft, *extra)]
    return subprocess.Popen(cmd, stdout=open(tmp / f"g{index}.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def start_lighthouse(tmp: Path) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse on loopback: a quorum of 1 is enough, a group silent for 1 s is dropped."""
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"127.0.0.1:{port}", "--min_replicas",
         "1", "--join_timeout_ms", "300", "--heartbeat_timeout_ms", "1000", "--quorum_tick_ms", "50"],
        stdout=open(tmp / "lighthouse.log", "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


@dataclass
class Outcome:
    losses: list[dict[int, float]]  # each group's logged loss per step
    logs: list[str]


def run_groups(tmp: Path, corpus: Path, steps: int, kill_at: int = 0, pause_s: float = 0.0,
               *group1: str) -> Outcome:
    """Both groups to `steps`; with `kill_at`, group 1 kills a rank at the start of that step and
    torchrun restarts it (`--max-restarts 1`) while group 0, pausing `pause_s` a step from the
    step after, trains on alone. `group1`: more flags for group 1."""
    lighthouse, address = start_lighthouse(tmp)
    pace = ["--fault.pause_s", str(pause_s), "--fault.at_step", str(kill_at + 1)] if kill_at else []
    kill = ["--max-restarts", "1", "--fault.kill_rank", "0", "--fault.at_step", str(kill_at), *group1] \
        if kill_at else list(group1)
    procs = [start_group(corpus, tmp, steps, 0, address, *pace), start_group(corpus, tmp, steps, 1, address, *kill)]
    try:
        for i, proc in enumerate(procs):
            assert proc.wait(timeout=240) == 0, (tmp / f"g{i}.log").read_text()[-4000:]
    finally:
        for proc in [*procs, lighthouse]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    losses = [{r["step"]: r["loss/train"] for r in records(tmp / f"g{i}") if "loss/train" in r} for i in (0, 1)]
    return Outcome(losses, [(tmp / f"g{i}.log").read_text() for i in (0, 1)])


def one_process_losses(tmp: Path, corpus: Path, steps: int) -> dict[int, float]:
    from gridtrain.config_load import load_config
    from gridtrain.train.trainer import Trainer

    argv = flags(corpus, tmp, "one", steps)
    trainer = Trainer(load_config(None, {a.removeprefix("--"): b for a, b in zip(argv[::2], argv[1::2])}))
    return {step: trainer.train_step()["loss/train"] for step in range(1, steps + 1)}


def final_weights(run_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run_dir / "checkpoints" / f"step-{steps:07d}", run_dir / "final.pt")
    state = torch.load(run_dir / "final.pt", weights_only=False)
    model = state.get("model", state)
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def check(tmp: Path, corpus: Path, out: Outcome, steps: int) -> None:
    """Every step of either group has the one-process run's loss; equal final weights."""
    reference = one_process_losses(tmp, corpus, steps)
    for losses in out.losses:
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step
    w0, w1 = final_weights(tmp / "g0", steps), final_weights(tmp / "g1", steps)
    assert w0.keys() == w1.keys() and w0
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name


def short_steps(log: str) -> str:
    """The steps group 0 ran with one replica group, as it logs them ('5-11')."""
    found = re.search(r"steps that ran with fewer than 2 replica groups: ([\d, -]+)", log)
    return found.group(1).strip() if found else ""


def test_two_replica_groups_train_as_one_process(tmp_path, corpus_dir):
    pytest.importorskip("torchft")
    steps = 4
    out = run_groups(tmp_path, corpus_dir, steps)
    for losses in out.losses:
        assert sorted(losses) == list(range(1, steps + 1))
    assert short_steps(out.logs[0]) == ""  # both groups took part in every step
    check(tmp_path, corpus_dir, out, steps)
