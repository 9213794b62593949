"""How long the default run's steps wait for data: time/data_wait_s against time/step_s.

    python bench/bench_data_wait.py [--steps 40] [-- extra gridtrain train flags]

Runs `gridtrain train` (the README's default run, shortened to --steps, no checkpoints, no sample, in
a temporary run directory) and reads its metrics.jsonl: for the steps after the first, the median
and the largest share of a step spent reading its batch (the reader runs inside the training
process: every second it takes is a second the step waits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "gridtrain", "train", "--run_dir", str(run), "--train.steps", str(args.steps),
               "--checkpoint.interval", "0", "--checkpoint.final", "false", "--train.sample_tokens", "0",
               "--train.val_every", "0", "--metrics.tensorboard", "false", *extra]
        subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parents[1], capture_output=True)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > 1 and "time/data_wait_s" in r]
    shares = [r["time/data_wait_s"] / r["time/step_s"] for r in steps]
    waits = [r["time/data_wait_s"] * 1e3 for r in steps]
    print(f"{len(steps)} steps: data wait median {statistics.median(waits):.2f} ms of a median step of "
          f"{statistics.median(r['time/step_s'] for r in steps) * 1e3:.0f} ms; share of the step median "
          f"{100 * statistics.median(shares):.2f}%, largest {100 * max(shares):.2f}%")


if __name__ == "__main__":
    main()
