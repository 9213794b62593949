"""torchft replica groups on loopback: a lighthouse and 2 replica groups, each its own `gridtrain
train --nproc 2` job of FSDP 2 (HSDP 2 x 2 over 4 processes), on the tiny model.

`run_groups` runs the scenario; bench/bench_ft_rejoin.py runs it in full (20 steps, group 1 killed
at step 5, restarted by torchrun, rejoining from group 0's state: about 50 s here, too long for CI).
The test runs the cheap part: group 1 dies at step 3 of 6 and is not restarted. Each step's loss
equals the one-process run's (the global batch split between the live groups, the gradients summed
across them through torchft's managed process group, the step group 1 died in run again by group 0
alone), and so do group 0's final weights.
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

pytestmark = [pytest.mark.dist, pytest.mark.alone]  # torchft's heartbeats every second (tests/workers.py)

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
               *group1: str, restarts: int = 1) -> Outcome:
    """Both groups to `steps`; with `kill_at`, group 1 kills a rank at the start of that step and
    torchrun restarts it `restarts` times (0: group 1 ends there) while group 0, pausing `pause_s`
    a step from the step after, trains on alone. `group1`: more flags for group 1."""
    lighthouse, address = start_lighthouse(tmp)
    pace = ["--fault.pause_s", str(pause_s), "--fault.at_step", str(kill_at + 1)] if kill_at else []
    kill = ["--max-restarts", str(restarts), "--fault.kill_rank", "0", "--fault.at_step", str(kill_at), *group1] \
        if kill_at else list(group1)
    procs = [start_group(corpus, tmp, steps, 0, address, *pace), start_group(corpus, tmp, steps, 1, address, *kill)]
    try:
        for i, proc in enumerate(procs):
            failed = i == 1 and kill_at and not restarts
            assert (proc.wait(timeout=240) != 0) == failed, (tmp / f"g{i}.log").read_text()[-4000:]
    finally:
        for proc in [*procs, lighthouse]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    losses = [{r["step"]: r["loss/train"] for r in records(tmp / f"g{i}") if "loss/train" in r} for i in (0, 1)]
    return Outcome(losses, [(tmp / f"g{i}.log").read_text() for i in (0, 1)])


def one_process(tmp: Path, corpus: Path, steps: int) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The same run in this process: its loss per step, and its weights after the last."""
    from gridtrain.config_load import load_config
    from gridtrain.train.trainer import Trainer

    argv = flags(corpus, tmp, "one", steps)
    trainer = Trainer(load_config(None, {a.removeprefix("--"): b for a, b in zip(argv[::2], argv[1::2])}))
    losses = {step: trainer.train_step()["loss/train"] for step in range(1, steps + 1)}
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def final_weights(run_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run_dir / "checkpoints" / f"step-{steps:07d}", run_dir / "final.pt")
    state = torch.load(run_dir / "final.pt", weights_only=False)
    model = state.get("model", state)
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def check(tmp: Path, corpus: Path, out: Outcome, steps: int) -> None:
    """Every step of either group has the one-process run's loss; equal final weights."""
    reference, _ = one_process(tmp, corpus, steps)
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


def test_a_replica_group_dies_and_the_other_trains_on_as_one_process(tmp_path, corpus_dir):
    """Group 1 dies at the start of step 3 of 6 (no restart): group 0 runs steps 3-6 alone, reading
    the whole global batch. Every step of group 0, and steps 1-2 of group 1, have the one-process
    run's loss, and group 0's final weights are the one-process run's."""
    pytest.importorskip("torchft")
    steps, kill_at = 6, 3
    out = run_groups(tmp_path, corpus_dir, steps, kill_at, restarts=0)
    assert sorted(out.losses[0]) == list(range(1, steps + 1))  # none lost, none run twice
    assert sorted(out.losses[1]) == list(range(1, kill_at))
    assert short_steps(out.logs[0]) == f"{kill_at}-{steps}"
    assert f"1 of 2 replica groups live from step {kill_at}" in out.logs[0]
    reference, weights = one_process(tmp_path, corpus_dir, steps)
    for losses in out.losses:
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step
    final = final_weights(tmp_path / "g0", steps)
    assert final.keys() == weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)
