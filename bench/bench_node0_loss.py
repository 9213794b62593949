"""What losing node 0 does to a two-node job: the cases tests/test_multinode.py leaves out (they
end the job, so they cost a launch each and prove nothing the job could survive).

    python bench/bench_node0_loss.py node      # node 0's agent and its workers killed
    python bench/bench_node0_loss.py agent     # node 0's torchrun agent alone killed

Two torchrun agents on loopback as two nodes of 2 processes (the test's `Node`: c10d rendezvous,
node 0 hosting it, --max-restarts 3), the tiny model under FSDP 4; at step 8 the kill. Prints how
long node 1's torchrun took to end and the ranks' own lines (`gridtrain: ...`), from which the
README's multi-node table is written.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from conftest import write_corpus  # noqa: E402
from test_multinode import Node, children, flags, free_port, wait_for_step  # noqa: E402


def main(case: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="node0-loss-"))
    run_dir, port = tmp / "run", free_port()
    train = flags(write_corpus(tmp / "corpus"), tmp, "--train.steps", "100000", "--checkpoint.interval", "50")
    node0 = Node(tmp, "node0", 0, "job-1", port, train)
    node1 = Node(tmp, "node1", 1, "job-1", port, train)
    wait_for_step(run_dir, 8, [node0, node1])
    workers = children(node0.proc.pid)
    start = time.monotonic()
    if case == "node":
        node0.kill()
    else:
        node0.proc.kill()
    try:
        code = node1.proc.wait(timeout=120)
        print(f"node 1's torchrun exited {code} after {time.monotonic() - start:.1f} s")
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if node1.proc.poll() is None:
            node1.kill()
    for log in (node0.log, node1.log):
        for line in log.read_text().splitlines():
            if line.startswith("gridtrain:") or "RendezvousConnectionError:" in line:
                print(f"{log.stem}: {line[:400]}")
    print(f"logs in {tmp}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "node")
