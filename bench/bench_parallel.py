"""Bytes moved per step per rank against the theoretical minimum, and weak scaling, for DDP 2,
FSDP 2 and TP 2 on the small model (CPU, gloo).

    python bench/bench_parallel.py [--steps 12]

Each layout runs through `gridtrain train --nproc 2` with one thread per process, one micro-batch
per rank per step (no accumulation), and is compared with one process on one thread doing the
same per-process work (weak scaling: ideal is 2x the tokens/s). Bytes come from the run's own
accounting (accounting/rank0.jsonl: ring wire bytes per collective); the minimum is the textbook
volume of the algorithm, in fp32:
  DDP    ring all-reduce of the gradients: 2(N-1)/N x G
  FSDP   all-gather of the parameters in forward and again in backward, reduce-scatter of the
         gradients: (N-1)/N x (2P + G)
  TP     two all-reduces per block in forward and two in backward of B x T x dim activations,
         plus the embedding's forward and the head input's backward: (4L + 2) x 2(N-1)/N x BTh
         per micro-batch; with no data parallelism the global batch is N micro-batches
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.model.args import model_args  # noqa: E402
from gridtrain.model.stats import build_meta, count_parameters  # noqa: E402

MICRO, SEQ = 8, 256
LAYOUTS = {"DDP 2": ["--parallel.zero_stage", "0"], "FSDP 2": ["--parallel.zero_stage", "3"],
           "TP 2": ["--parallel.tp", "2"]}


def run(tmp: Path, name: str, nproc: int, extra: list[str], steps: int) -> tuple[float, dict]:
    run_dir = tmp / name.replace(" ", "_")
    cmd = [sys.executable, "-m", "gridtrain", "train", "--nproc", str(nproc), "--run_dir", str(run_dir),
           "--model.preset", "small", "--data.seq_len", str(SEQ), "--train.micro_batch", str(MICRO),
           "--train.global_batch", str(MICRO * nproc), "--train.steps", str(steps),
           "--train.warmup_steps", "1", "--train.val_every", "0", "--train.threads", "1",
           "--metrics.account_every", str(steps), "--metrics.tensorboard", "false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tput = statistics.median(r["throughput/tokens_per_s"] for r in records[2:] if "throughput/tokens_per_s" in r)
    accounting = {}
    acc = run_dir / "accounting" / "rank0.jsonl"
    if acc.exists():
        accounting = json.loads(acc.read_text().splitlines()[-1])  # a steady-state step
    return tput, accounting


def minimum_bytes(name: str, n: int) -> float:
    args = model_args("small")
    params = count_parameters(build_meta(args)).total * 4
    if name.startswith("DDP"):
        return 2 * (n - 1) / n * params
    if name.startswith("FSDP"):
        return (n - 1) / n * 3 * params
    # TP has no data parallelism here: the global batch of n micro-batches runs through each rank.
    activation = MICRO * SEQ * args.dim * 4
    return n * (4 * args.n_layers + 2) * 2 * (n - 1) / n * activation


def wire_bytes(accounting: dict) -> float:
    return sum(v for k, v in accounting.items() if k.startswith("comm/") and k.endswith("wire_bytes"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        single, _ = run(Path(tmp), "one", 1, [], args.steps)
        print(f"1 process x 1 thread: {single:,.0f} tokens/s (micro-batch {MICRO} x {SEQ} tokens)")
        print(f"{'layout':<8} {'bytes/step/rank':>16} {'minimum':>12} {'ratio':>6} {'tokens/s':>10} "
              f"{'vs 1 proc':>9} {'efficiency':>10}")
        for name, extra in LAYOUTS.items():
            tput, acc = run(Path(tmp), name, 2, extra, args.steps)
            moved, least = wire_bytes(acc), minimum_bytes(name, 2)
            print(f"{name:<8} {moved:>16,.0f} {least:>12,.0f} {moved / least:>6.2f} {tput:>10,.0f} "
                  f"{tput / single:>8.2f}x {100 * tput / (2 * single):>9.0f}%")


if __name__ == "__main__":
    main()
