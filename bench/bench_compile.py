"""gridtrain's training step with `train.compile` on and off, on this machine (CPU: inductor's C++
backend; CUDA where present): tokens/s of each (median over steps, the two alternating in rounds so
drift in the machine affects both alike), their ratio, and what compiling cost before the first
step.

    python bench/bench_compile.py                  # the shapes below
    python bench/bench_compile.py --shape m26 --rounds 5

`train.compile` compiles each transformer block (gridtrain.parallel.parallelize.apply_compile,
fullgraph); it stays off by default where this bench shows it does not pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.config_load import load_config  # noqa: E402
from gridtrain.train.trainer import Trainer  # noqa: E402

# name: (model preset, seq_len, micro-batch, precision, recompute)
SHAPES = {
    "small": ("small", 256, 8, "fp32", "none"),
    "6l": ("bench-6l", 512, 2, "fp32", "none"),
    "m26": ("m26", 512, 8, "bf16", "none"),
    "m26-selective": ("m26", 512, 8, "bf16", "selective"),
}


def trainer(name: str, compiled: bool) -> Trainer:
    preset, seq, batch, precision, recompute = SHAPES[name]
    return Trainer(load_config(None, {
        "model.preset": preset, "data.seq_len": seq, "train.micro_batch": batch, "train.global_batch": batch,
        "train.precision": precision, "train.recompute": recompute, "train.compile": compiled,
        "train.steps": 10**6, "train.warmup_steps": 10, "train.val_every": 0,
        "checkpoint.interval": 0, "checkpoint.final": False,
        "run_dir": f"/tmp/gridtrain-bench-compile-{name}-{int(compiled)}"}))


def bench_shape(name: str, rounds: int, steps: int, warmup: int) -> dict[str, float]:
    sides = {}
    for compiled in (False, True):
        t = trainer(name, compiled)
        start = time.perf_counter()
        t.train_step()  # compiles here when on
        first = time.perf_counter() - start
        for _ in range(warmup):
            t.train_step()
        sides[compiled] = (t, first, [])
    for _ in range(rounds):
        for compiled, (t, _, times) in sides.items():
            times.extend(t.train_step()["time/step_s"] for _ in range(steps))
    _, seq, batch, precision, recompute = SHAPES[name]
    tps = {c: batch * seq / statistics.median(times) for c, (_, _, times) in sides.items()}
    return {"shape": name, "precision": precision, "recompute": recompute, "tokens": batch * seq,
            "eager_tokens_per_s": tps[False], "compiled_tokens_per_s": tps[True],
            "ratio": tps[True] / tps[False], "first_step_eager_s": sides[False][1],
            "first_step_compiled_s": sides[True][1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per side per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    names = list(SHAPES) if args.shape == "all" else [args.shape]
    results = [bench_shape(n, args.rounds, args.steps, args.warmup) for n in names]
    print(f"{'shape':<14} {'prec':<5} {'recompute':<10} {'eager tok/s':>12} {'compiled tok/s':>15} {'ratio':>6} "
          f"{'first step eager':>17} {'compiled':>9}")
    for r in results:
        print(f"{r['shape']:<14} {r['precision']:<5} {r['recompute']:<10} {r['eager_tokens_per_s']:>12,.0f} "
              f"{r['compiled_tokens_per_s']:>15,.0f} {r['ratio']:>6.2f} {r['first_step_eager_s']:>16.1f}s "
              f"{r['first_step_compiled_s']:>8.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
