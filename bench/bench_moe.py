"""Mixture of experts on CPU: the grouped matmul against the expert loop, expert parallelism's
tokens/s against one process, and the all-to-all's share of an expert-parallel step.

    python bench/bench_moe.py [--steps 12] [--reps 20]

1. One MoE layer's experts (SwiGLU, forward and backward) through `torch._grouped_mm` and through
   a loop over `w.unbind(0)`, one thread, tokens routed uniformly at random: the tiny model's layer
   (8 experts, dim 64, ffn 32, 1,024 tokens, top-2) and a mid-size one (64 experts, dim 512, ffn 256,
   4,096 tokens, top-8). Median of --reps.
2. `gridtrain train` of small-moe, one thread per process, one micro-batch of 8 x 256 tokens per
   rank and step: one process, and EP 2 (beside FSDP 2) doing the same work per process (weak
   scaling: ideal is 2x the tokens/s). Median tokens/s after 2 steps.
3. The same EP 2 run in this script's own 2-process launch, with `dist.all_to_all_single` timed:
   the wall seconds the all-to-alls (counts, rows out, rows back, and their backward) take, as a
   share of the step's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.model.moe import experts_forward  # noqa: E402

LAYERS = {"tiny (8 experts, dim 64, ffn 32, 1,024 tokens, top-2)": (8, 64, 32, 1024, 2),
          "mid (64 experts, dim 512, ffn 256, 4,096 tokens, top-8)": (64, 512, 256, 4096, 8)}
MICRO, SEQ = 8, 256


def time_experts(experts: int, dim: int, ffn: int, tokens: int, k: int, grouped: bool, reps: int) -> float:
    gen = torch.Generator().manual_seed(0)
    rows = tokens * k
    counts = torch.bincount(torch.randint(0, experts, (rows,), generator=gen), minlength=experts)
    x = torch.randn(rows, dim, generator=gen, requires_grad=True)
    w1, w3 = (torch.randn(experts, ffn, dim, generator=gen).mul_(0.02).requires_grad_() for _ in range(2))
    w2 = torch.randn(experts, dim, ffn, generator=gen).mul_(0.02).requires_grad_()
    seconds = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        experts_forward(x, counts, w1, w2, w3, grouped).square().mean().backward()
        seconds.append(time.perf_counter() - start)
        for t in (x, w1, w2, w3):
            t.grad = None
    return statistics.median(seconds[2:])


def train(tmp: Path, name: str, nproc: int, extra: list[str], steps: int) -> float:
    run_dir = tmp / name
    cmd = [sys.executable, "-m", "gridtrain", "train", "--nproc", str(nproc), "--run_dir", str(run_dir),
           "--model.preset", "small-moe", "--data.seq_len", str(SEQ), "--train.micro_batch", str(MICRO),
           "--train.global_batch", str(MICRO * nproc), "--train.steps", str(steps), "--train.warmup_steps", "1",
           "--train.val_every", "0", "--train.threads", "1", "--train.sample_tokens", "0",
           "--checkpoint.interval", "0", "--checkpoint.final", "false", "--metrics.tensorboard", "false", *extra]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["throughput/tokens_per_s"] for r in records[2:] if "throughput/tokens_per_s" in r)


def all_to_all_share(steps: int) -> None:
    """Under torchrun: EP 2 steps with every all_to_all_single timed; rank 0 prints the share."""
    import torch.distributed as dist

    from gridtrain.config_load import load_config
    from gridtrain.train.trainer import Trainer

    spent = [0.0]
    plain = dist.all_to_all_single

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        work = plain(*args, **kwargs)
        spent[0] += time.perf_counter() - start
        return work

    dist.all_to_all_single = timed
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, {"model.preset": "small-moe", "run_dir": tmp, "parallel.ep": 2,
                                 "data.seq_len": SEQ, "train.micro_batch": MICRO, "train.global_batch": 2 * MICRO,
                                 "train.steps": steps, "train.warmup_steps": 1, "train.val_every": 0,
                                 "train.threads": 1, "metrics.tensorboard": False, "metrics.progress": False})
        trainer = Trainer(cfg)
        shares = []
        for step in range(steps):
            spent[0] = 0.0
            seconds = trainer.train_step()["time/step_s"]
            if step >= 2:
                shares.append(spent[0] / seconds)
        if trainer.world.rank == 0:
            print(f"all-to-all share of an EP 2 step: {statistics.median(shares):.1%} (median of {len(shares)} steps)")
        trainer.release()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--share-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.share_worker:
        return all_to_all_share(args.steps)
    torch.set_num_threads(1)
    print("experts forward + backward, one thread (median):")
    for name, shape in LAYERS.items():
        grouped, loop = (time_experts(*shape, g, args.reps) for g in (True, False))
        print(f"  {name}: grouped {grouped * 1e3:.2f} ms, loop {loop * 1e3:.2f} ms, loop / grouped {loop / grouped:.2f}x")
    with tempfile.TemporaryDirectory() as tmp:
        one = train(Path(tmp), "one", 1, [], args.steps)
        ep2 = train(Path(tmp), "ep2", 2, ["--parallel.ep", "2"], args.steps)
    print(f"small-moe, micro-batch {MICRO} x {SEQ} per rank, one thread each: 1 process {one:,.0f} tokens/s, "
          f"EP 2 x FSDP 2 {ep2:,.0f} tokens/s ({ep2 / one:.2f}x; weak-scaling efficiency {ep2 / (2 * one):.0%})")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    __file__, "--share-worker", "--steps", str(args.steps)], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
