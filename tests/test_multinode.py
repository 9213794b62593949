"""Two nodes on loopback, as the README tells users to run them: two torchrun agents (c10d
rendezvous, `--nnodes 1:2`, `--max-restarts 3`), each starting 2 processes of one FSDP job
(world 4), in one job that lives through three failures of a real cluster:

1. a worker of node 1 is killed with kill -9 after step 5: both nodes restart, resume from the
   newest checkpoint and recompute the steps after it bit for bit; node 1 spends exactly one
   restart, node 0 at most one (none on the run-directory check: both restart with
   TORCHELASTIC_RESTART_COUNT 0 or 1 and continue their own job's run);
2. node 1's agent and its workers are SIGKILLed (a lost node) and the agent started again, which
   starts with restart count 0: the job continues on both nodes;
3. node 1 is killed for good: node 0 continues alone at world size 2 (FSDP 2, two micro-batches
   per rank), from the same sample offset.

Every step's loss equals the one-process run's within fp32 tolerance (any skipped or repeated
sample would change it). A relaunch of the finished run without --resume, as a new job (another
--rdzv-id), is refused on every node and changes nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.alone]  # rendezvous keep-alives every 2 s (tests/workers.py)

ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL_AFTER, AGENT_KILLED_AFTER, NODE_LOST_AFTER = 30, 5, 10, 18


def flags(corpus: Path, tmp: Path, *extra: str) -> list[str]:
    """The tiny model, 4 sequences of 32 tokens a step, one per rank at world 4, a checkpoint
    every 2 steps."""
    return ["--model.preset", "tiny", "--data.corpus", str(corpus), "--data.cache_dir", str(tmp / "cache"),
            "--data.seq_len", "32", "--train.global_batch", "4", "--train.micro_batch", "1",
            "--train.steps", str(STEPS), "--train.warmup_steps", "1", "--train.val_every", "0",
            "--train.threads", "1", "--train.collective_timeout_s", "30", "--checkpoint.interval", "2",
            # a node lost inside a save holds the others in the save group up to checkpoint.timeout_s
            # (1,800 s by default): once in a clean run, node 0 waited there past the test's 180 s
            "--checkpoint.timeout_s", "30",
            "--metrics.log_every", "1", "--metrics.tensorboard", "false", "--metrics.progress", "false",
            "--metrics.account_every", "0", "--run_dir", str(tmp / "run"), *extra]


class Node:
    """One torchrun agent on loopback, its output in a file."""

    def __init__(self, tmp: Path, name: str, node: int, job: str, port: int, train: list[str],
                 nnodes: str = "1:2", max_restarts: int = 3) -> None:
        self.log = tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job,
               # node 0 hosts the rendezvous; a lone node waits 10 s for the other, a silent one is
               # dropped after 3 missed keep-alives 2 s apart (torch's defaults: 30 s, 3 x 5 s)
               "--rdzv-conf", f"is_host={int(node == 0)},last_call_timeout=10,keep_alive_interval=2,"
               "keep_alive_max_attempt=3", "--max-restarts", str(max_restarts),
               "--monitor-interval", "0.2", "-m", "gridtrain", "train", *train]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text()

    def kill(self) -> None:
        """SIGKILL the agent, then its workers (torchrun starts them in sessions of their own)."""
        workers = children(self.proc.pid)
        self.proc.kill()
        self.proc.wait()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def wait_for_step(run_dir: Path, step: int, nodes: list[Node], attempt: int = 1, timeout: float = 120) -> None:
    """Until the job's `attempt`-th start (counted in rank 0's log) has trained `step`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = "".join(n.text() for n in nodes)
        if log.count("Units of one step") >= attempt and \
                any(r.get("step", 0) >= step and "loss/train" in r for r in records(run_dir)[-3:]):
            return
        if all(n.proc.poll() is not None for n in nodes):
            break
        time.sleep(0.1)
    raise AssertionError(f"the job never reached step {step}:\n" + "\n".join(n.text()[-3000:] for n in nodes))


def one_process_losses(tmp: Path, corpus: Path) -> dict[int, float]:
    from gridtrain.config_load import load_config
    from gridtrain.train.trainer import Trainer

    argv = flags(corpus, tmp, "--run_dir", str(tmp / "one"))
    cfg = load_config(None, {a.removeprefix("--"): b for a, b in zip(argv[::2], argv[1::2])})
    trainer = Trainer(cfg)
    return {step: trainer.train_step()["loss/train"] for step in range(1, STEPS + 1)}


def test_two_nodes_survive_a_killed_worker_a_lost_agent_and_a_lost_node(tmp_path, corpus_dir):
    run_dir, port = tmp_path / "run", free_port()
    train = flags(corpus_dir, tmp_path)
    # c10d numbers the nodes by agent PID on one host: node 0, started first, holds ranks 0 and 1
    node0 = Node(tmp_path, "node0", 0, "job-1", port, train)
    node1 = Node(tmp_path, "node1", 1, "job-1", port, train)  # waits for node 0's store
    try:
        # 1. kill -9 of a worker of node 1: both nodes restart once and resume
        wait_for_step(run_dir, KILL_AFTER, [node0, node1])
        os.kill(children(node1.proc.pid)[0], signal.SIGKILL)
        wait_for_step(run_dir, AGENT_KILLED_AFTER, [node0, node1], attempt=2)
        # 2. node 1's agent and workers killed, the agent started again (restart count 0)
        node1.kill()
        node1_again = Node(tmp_path, "node1-again", 1, "job-1", port, train)
        wait_for_step(run_dir, NODE_LOST_AFTER, [node0, node1_again], attempt=3)
        world_after_rejoin = json.loads((run_dir / "config.json").read_text())["world_size"]
        # 3. node 1 lost for good: node 0 goes on alone
        node1_again.kill()
        assert node0.proc.wait(timeout=180) == 0, node0.text()[-4000:]
    finally:
        for node in (node0, node1):
            if node.proc.poll() is None:
                node.kill()
    log0 = node0.text()
    spent = re.findall(r"torchrun restarts spent so far, by node: node 0: (\d+), node 1: (\d+)", log0)
    assert len(spent) >= 2, log0[-4000:]
    assert int(spent[0][1]) == 1 and int(spent[0][0]) <= 1, spent  # the kill: one restart on each node at most
    assert int(spent[1][1]) == 0, spent  # node 1 started again counts none, and continues the job's run
    assert world_after_rejoin == 4
    assert "already holds a run" not in log0 + node1.text() + node1_again.text()
    resumed = re.findall(r"resumed from \S+step-(\d+) at step (\d+) \(sample offset (\d+)\)", log0)
    assert len(resumed) >= 3 and all(int(c) == int(s) and int(s) * 4 == int(o) for c, s, o in resumed), resumed
    assert log0.count("torchrun restarted the run: resuming") >= 3
    assert json.loads((run_dir / "config.json").read_text())["world_size"] == 2

    # every step's loss is the one-process run's; a step recomputed at the same world size, the same bits
    seen: dict[int, list[float]] = {}
    for record in records(run_dir):
        if "loss/train" in record:
            seen.setdefault(record["step"], []).append(record["loss/train"])
    assert sorted(seen) == list(range(1, STEPS + 1))
    first_resume = int(resumed[0][1])
    for step in range(first_resume + 1, KILL_AFTER + 1):  # trained before the kill, again after it
        assert len(seen[step]) >= 2 and seen[step][0] == seen[step][1], (step, seen[step])
    reference = one_process_losses(tmp_path, corpus_dir)
    for step, values in seen.items():
        for value in values:
            assert value == pytest.approx(reference[step], rel=1e-5), (step, values, reference[step])

    # a new job into the finished run without --resume: refused on both nodes (in every attempt of
    # the job too: test_rundir's decision is the same whatever the restart count)
    before = (run_dir / "metrics.jsonl").read_bytes()
    port = free_port()
    again = [Node(tmp_path, f"relaunch{n}", n, "job-2", port, flags(corpus_dir, tmp_path), "2", 0) for n in (1, 0)]
    for node in again:
        assert node.proc.wait(timeout=180) != 0
        refusals = re.findall(r"gridtrain: rank \d: invalid configuration: run_dir \S+ already holds a run", node.text())
        assert len(refusals) == 2, node.text()[-4000:]  # each of the node's ranks
    assert (run_dir / "metrics.jsonl").read_bytes() == before
