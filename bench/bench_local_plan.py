"""The planner's ranking checked where it can be: on this machine. `gridtrain plan --gpu local`
ranks layouts for N local processes of the small model; each of its first rows runs through
`gridtrain train --nproc N` and its measured median step time is set beside the predicted one.

    python bench/bench_local_plan.py [--worlds 2 4] [--rows 5] [--others] [--steps 10] [--rounds 2] [--json FILE]

Needs this machine calibrated at one thread per rank (`gridtrain calibrate --threads 1`) and
nothing else busy. A row of the plan that collapses several layouts ('mb 1, 2, 4 alike') runs
its first. The measured step is the median of the steps after the first two, from the run's own
tokens/s, in the faster of --rounds runs, taken round after round over the rows (one layout ran
0.357 s and 0.446 s a step in two runs of 4 processes on 2 cores minutes apart, nothing else
busy). The verdict: the measured best among the predicted first two, and every predicted step
within 20% of its measured step, over the first --rows rows. With --others, the plan's best row
of each family the first rows leave out (FSDP, TP, PP, CP) runs too, shown beside them, not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.plan.layout import Layout  # noqa: E402
from gridtrain.plan.runnable import train_command  # noqa: E402

MODEL, SEQ, BATCH = "small", 256, 16
BUSY_SHARE = 0.1
"""Where other processes took more than this share of the machine's cores while a run ran, its step
time says nothing about the plan."""


def plan(world: int, rows: int) -> list[dict]:
    cmd = [sys.executable, "-m", "gridtrain", "plan", "--model", MODEL, "--gpu", "local", "--num-gpus", str(world),
           "--seq-len", str(SEQ), "--global-batch", str(BATCH), "--tokens", "1M", "--top", str(rows), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout)["ranked"][:rows]


def family(layout: dict) -> str:
    """The axis a layout is known by: TP, PP or CP where it has one, FSDP (ZeRO-2/3, HSDP), or DDP."""
    for axis in ("tp", "pp", "cp"):
        if layout[axis] > 1:
            return axis.upper()
    return "FSDP" if layout["zero_stage"] >= 2 and layout["dp_replicate"] * layout["dp_shard"] > 1 else "DDP"


def chosen_rows(ranked: list[dict], rows: int, others: bool) -> list[dict]:
    """The first `rows` of the plan, then (with `others`) the best-ranked row of each family they leave out."""
    ranked = [{**r, "place": i} for i, r in enumerate(ranked, 1)]
    judged = ranked[:rows]
    seen = {family(r["layout"]) for r in judged}
    extra = []
    for r in ranked[rows:] if others else []:
        if family(r["layout"]) not in seen:
            seen.add(family(r["layout"]))
            extra.append(r)
    return judged + extra


def label(layout: dict) -> str:
    parts = [f"{k} {layout[k]}" for k in ("tp", "pp", "cp") if layout[k] > 1]
    dp = layout["dp_replicate"] * layout["dp_shard"]
    if dp > 1:
        parts.append(f"dp {dp} ZeRO-{layout['zero_stage']}" + (f" (HSDP {layout['dp_replicate']} x "
                                                                f"{layout['dp_shard']})" if layout['dp_replicate'] > 1
                                                                and layout['zero_stage'] >= 2 else ""))
    if layout["pp"] > 1:
        parts.append(layout["pp_schedule"] + (f" v{layout['pp_virtual_stages']}" if layout["pp_virtual_stages"] > 1 else ""))
    parts.append(f"mb {layout['micro_batch']} x {layout['num_microbatches']}")
    if layout["recompute"] != "none":
        parts.append(f"recompute {layout['recompute']}")
    return ", ".join(parts)


def others_share(machine_busy_s: float, ours_s: float, wall_s: float, cores: int) -> float:
    """The share of the machine's cores that other processes took while a run ran: the machine's
    busy CPU seconds less the run's own, over wall seconds x cores. Measured from the others' side,
    since a quiet run's own processes do not fill their cores (start-up, gloo's waits)."""
    return max(0.0, (machine_busy_s - ours_s) / (wall_s * cores))


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (Linux's /proc/stat), NaN elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return float("nan")
    idle = sum(int(fields[i]) for i in (3, 4) if i < len(fields))  # idle, iowait
    return (sum(int(f) for f in fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measure(layout: dict, world: int, steps: int, tmp: Path) -> tuple[float, float]:
    """The run's median step in seconds, and the share of the machine's cores that other processes
    took while it ran (the machine's busy CPU time less the run's own, over wall time x cores)."""
    lay = Layout(**{k: v for k, v in layout.items() if k != "dp"})
    words = train_command((("model.preset", MODEL),), BATCH, "bf16", lay, world).split()
    run_dir = tmp / f"run{len(list(tmp.iterdir()))}"
    cmd = [sys.executable, "-m", "gridtrain", *words[1:], "--run_dir", str(run_dir), "--train.steps", str(steps),
           "--train.warmup_steps", "1", "--train.val_every", "0", "--metrics.account_every", "0",
           "--metrics.tensorboard", "false", "--checkpoint.interval", "0", "--checkpoint.final", "false"]
    ours, machine, start = resource.getrusage(resource.RUSAGE_CHILDREN), busy_cpu_seconds(), time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
    own = (after.ru_utime + after.ru_stime) - (ours.ru_utime + ours.ru_stime)
    if done.returncode:
        print(f"{' '.join(cmd)}\nexited {done.returncode}:\n{done.stderr[-3000:]}", file=sys.stderr)
        return float("nan"), 0.0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tput = [r["throughput/tokens_per_s"] for r in records if "throughput/tokens_per_s" in r][2:]
    return BATCH * SEQ / statistics.median(tput), others_share(busy_cpu_seconds() - machine, own, wall,
                                                                os.cpu_count() or 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rows", type=int, default=5, help="the first rows, judged")
    ap.add_argument("--others", action="store_true",
                    help="also run the plan's best row of each family (FSDP, TP, PP, CP) below them, shown, not judged")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each row, in turn; the faster counts")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    results, ok, busy = [], True, False
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            rows = chosen_rows(plan(world, 200), args.rows, args.others)
            # Round after round over the rows, so a slow spell of the machine falls on one round of
            # several rows, not on every round of one; each row's faster round counts.
            rounds = [[measure(r["layout"], world, args.steps, Path(tmp)) for r in rows] for _ in range(args.rounds)]
            measured = [min((run[i][0] for run in rounds), key=lambda m: m if m == m else float("inf"))
                        for i in range(len(rows))]
            shares = [max(run[i][1] for run in rounds) for i in range(len(rows))]
            busy |= max(shares) > BUSY_SHARE
            ok &= all(m == m for m in measured[:args.rows])  # a run that failed fails the verdict
            best = min(range(min(args.rows, len(rows))),
                       key=lambda i: measured[i] if measured[i] == measured[i] else float("inf"))
            print(f"\n{world} processes (`gridtrain plan --model {MODEL} --gpu local --num-gpus {world} --seq-len {SEQ} "
                  f"--global-batch {BATCH}`):")
            print("| # | layout | predicted s | measured s | measured/predicted | others' CPU |")
            print("|---|---|---|---|---|---|")
            for i, (r, m, c) in enumerate(zip(rows, measured, shares), 1):
                ratio = m / r["step_s"]
                ok &= i > args.rows or abs(ratio - 1) <= 0.20
                place = i if i <= args.rows else f"{r['place']} (best {family(r['layout'])}, not judged)"
                print(f"| {place} | {label(r['layout'])} | {r['step_s']:.3f} | {m:.3f} | {ratio:.2f} | {c:.0%} |")
                results.append({"world": world, "rank": i, "layout": r["layout"], "predicted_s": r["step_s"],
                                "measured_s": m, "others_cpu_share": c})
            ok &= best < 2
            print(f"measured best: #{best + 1}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if busy:
        print(f"\nverdict: none; other processes took more than {BUSY_SHARE:.0%} of the cores while a run ran: "
              "run the bench again on a quiet machine")
        return 1
    print("\nverdict:", "every prediction within 20%, measured best among the predicted first two" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
