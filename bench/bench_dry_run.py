"""Dry runs of full-size Llama 3 layouts on this CPU, one rank each, beside the plan.

    python bench/bench_dry_run.py                 # all of them, into /tmp/gridtrain-bench-dry-run
    python bench/bench_dry_run.py --only 8b --work DIR

Each row is `gridtrain train --dry-run --world N --rank R` in a fresh process (fake process group,
fake tensors: one training step of that rank and no other), timed, with its peak RSS (GNU time's
%M), and its bytes per memory bucket and per collective beside `gridtrain plan`'s prediction for the
same rank (the table `gridtrain plan --check` prints for a run directory).

The layouts: Llama 3 8B on 8 ranks (FSDP 8); 70B on 64 ranks (TP 8 with sequence parallelism,
PP 4, data parallel 2); 405B with the published layout (TP 8, PP 16 with one layer fewer on the
first and last stage, data parallel 128: 16,384 GPUs), its first and its last pipeline rank;
Mixtral 8x7B on 64 ranks (PP 8, FSDP 8 = EP 8: one expert of each layer per rank), routed by the
dry run's fixed balanced rule (train/dry_routing.py); Qwen3-30B-A3B (heads of 128 beside dim 2048,
QK-norm, 128 experts at top-8) on the same 64-rank layout, 16 experts of each layer per rank. All at
sequence length 8192, micro-batch 1, bf16, and global batches of 8, 16, 2048, 64 and 64 sequences.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMON = ["--data.seq_len=8192", "--train.micro_batch=1", "--train.precision=bf16"]
LAYOUTS = {
    "8b": (8, [0], ["--model.preset=llama3-8b", "--train.global_batch=8"]),
    "70b": (64, [0, 63], ["--model.preset=llama3-70b", "--train.global_batch=16", "--parallel.tp=8",
                          "--parallel.pp=4", "--parallel.sequence_parallel=true"]),
    "405b": (16384, [0, 16383], ["--model.preset=llama3-405b", "--train.global_batch=2048", "--parallel.tp=8",
                                 "--parallel.pp=16", "--parallel.pp_fewer_edge_layers=1",
                                 "--parallel.sequence_parallel=true"]),
    "mixtral": (64, [0, 63], ["--model.preset=mixtral-8x7b", "--train.global_batch=64", "--parallel.pp=8",
                              "--parallel.dp_shard=8", "--parallel.ep=8"]),
    "qwen3": (64, [0, 63], ["--model.preset=qwen3-30b-a3b", "--train.global_batch=64", "--parallel.pp=8",
                            "--parallel.dp_shard=8", "--parallel.ep=8"]),
}


def dry_run(name: str, world: int, rank: int, args: list[str], work: Path) -> str:
    run_dir = work / name
    cmd = ["/usr/bin/time", "-f", "peak RSS %M KiB, %e s wall", sys.executable, "-m", "gridtrain", "train",
           "--dry-run", f"--world={world}", f"--rank={rank}", *COMMON, *args, f"--run_dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rss = [line for line in proc.stderr.splitlines() if line.startswith("peak RSS")][-1]
    return f"== {name}, rank {rank} of {world} ({time.perf_counter() - start:.0f} s; {rss})\n{proc.stdout}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(LAYOUTS), action="append")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gridtrain-bench-dry-run"))
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    for name in args.only or LAYOUTS:
        world, ranks, extra = LAYOUTS[name]
        for rank in ranks:
            print(dry_run(name, world, rank, extra, args.work), flush=True)


if __name__ == "__main__":
    main()
