"""Every pipeline schedule timed on the same layouts: measured bubble beside the planner's.

    python bench/bench_schedules.py [--steps 8] [--microbatches 8 ...] [--pp 2 4] [--seq-len 256]

The small model with 8 layers (so that PP 4 with 2 stages per rank gets a layer per stage) runs
`gridtrain train --nproc P` for P = 2 and 4 under every schedule (1 stage per rank for GPipe and
1F1B, 2 for the others) and every m given, micro-batches of 1 sequence, one intra-op thread per
process, with every pipeline action timed (schedule_trace.py). From the trace of each step after
the first two:

- measured bubble: 1 - (sum over ranks of the time spent in actions) / (P x the step's pipeline
  span, first action's start to last action's end). Only meaningful where every rank has its own
  core: the table marks a run whose ranks outnumber the machine's cores;
- replayed bubble: the same step laid out again with each action's measured CPU time on P
  dedicated workers, each rank keeping its recorded order and every action waiting for its inputs
  (forward after the previous stage's forward, backward after the next stage's backward and its
  own forward, weight gradients after input gradients), communication free. On a machine with
  fewer cores than P this is what the schedule's order costs;
- per action, the median CPU milliseconds of a forward F, a fused backward B, and the split
  backward's input part I and weight part W, per layer; the split's extra cost is (I + W) / B - 1;
- the planner's bubble: gridtrain.plan.pipeline.schedule_bubble for the same P, m and v: torch's
  action order (layout/pipeline_order.py) replayed with the planner's action costs. Every m torch
  takes is run (`--microbatches 1 2 3 4`: the m < pp cases where the closed forms fail).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gridtrain.layout.pipeline_order import refusal  # noqa: E402
from gridtrain.layout.schedules import RUNTIME_SCHEDULES, SCHEDULES  # noqa: E402
from gridtrain.plan.pipeline import schedule_bubble  # noqa: E402

LAYERS = 8


def traced_run(tmp: Path, name: str, pp: int, schedule: str, v: int, m: int, seq: int, steps: int) -> list[list]:
    """Run one schedule; every rank's action records."""
    out = tmp / f"{name}-trace"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
           str(ROOT / "bench" / "schedule_trace.py"), str(out), "train", "--run_dir", str(tmp / name),
           "--model.preset", "small", "--model.n_layers", str(LAYERS), "--data.seq_len", str(seq),
           "--train.micro_batch", "1", "--train.global_batch", str(m), "--train.steps", str(steps),
           "--train.warmup_steps", "1", "--train.val_every", "0", "--train.threads", "1",
           "--metrics.account_every", "0", "--metrics.tensorboard", "false", "--metrics.progress", "false",
           "--parallel.dp_shard", "1", "--parallel.pp", str(pp), "--parallel.pp_schedule", schedule,
           "--parallel.pp_virtual_stages", str(v)]
    subprocess.run(cmd, check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return [[r, *rec] for r in range(pp) for rec in json.loads((out / f"rank{r}.json").read_text())]


def replay(actions: list[list], pp: int) -> tuple[float, float]:
    """(makespan, busy) of one step's actions [rank, step, kind, stage, mb, t0, t1, cpu] replayed
    in each rank's recorded order with their CPU times on pp dedicated workers."""
    orders = [sorted((a for a in actions if a[0] == r), key=lambda a: a[5]) for r in range(pp)]
    last_stage = max(a[3] for a in actions)
    done: dict[tuple[str, int, int], float] = {}
    free, cursor = [0.0] * pp, [0] * pp
    while any(cursor[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while cursor[r] < len(orders[r]):
                _, _, kind, stage, mb, _, _, cpu = orders[r][cursor[r]]
                if kind == "F":
                    deps = [("F", stage - 1, mb)] if stage > 0 else []
                elif kind == "W":
                    deps = [("I", stage, mb)]
                else:
                    deps = [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < last_stage else [])
                if any(d not in done for d in deps):
                    break
                end = max([free[r]] + [done[d] for d in deps]) + cpu
                done[(kind, stage, mb)] = free[r] = end
                if kind in ("B", "I"):  # the input gradient the previous stage waits for
                    done[("G", stage, mb)] = end
                cursor[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded orders deadlock when replayed")
    return max(free), sum(a[7] for a in actions)


def summarize(records: list[list], pp: int) -> dict[str, float]:
    steps = sorted({rec[1] for rec in records})[2:]
    measured, replayed, span_ms, replay_ms, idle = [], [], [], [], []
    for step in steps:
        actions = [rec for rec in records if rec[1] == step]
        span = max(a[6] for a in actions) - min(a[5] for a in actions)
        busy = sum(a[6] - a[5] for a in actions)
        makespan, cpu = replay(actions, pp)
        measured.append(1 - busy / (pp * span))
        replayed.append(1 - cpu / (pp * makespan))
        idle.append((makespan - cpu / pp) * 1e3)
        span_ms.append(span * 1e3)
        replay_ms.append(makespan * 1e3)
    per_layer = {}
    for kind in "FBIW":
        times = [rec[7] for rec in records if rec[2] == kind and rec[1] in steps]
        stages = len({rec[3] for rec in records})
        per_layer[kind] = statistics.median(times) * 1e3 / (LAYERS / stages) if times else float("nan")
    return {"measured": statistics.median(measured), "replayed": statistics.median(replayed),
            "span_ms": statistics.median(span_ms), "replay_ms": statistics.median(replay_ms),
            "idle_ms": statistics.median(idle), **per_layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=list(RUNTIME_SCHEDULES))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(f"small model, {LAYERS} layers, seq {args.seq_len}, micro-batches of 1 sequence, 1 thread per process, "
          f"{cores} cores; per-layer CPU ms of F, B, I, W; planner: the action order replayed with the "
          "planner's action costs (plan/replay.py)")
    print(f"{'pp':>3} {'schedule':<17} {'v':>2} {'m':>3} {'span ms':>8} {'replay ms':>9} {'measured':>9} "
          f"{'replayed':>9} {'planner':>8} {'F':>6} {'B':>6} {'I':>6} {'W':>6}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pp in args.pp:
            for m in args.microbatches:
                for schedule in args.schedules:
                    v = SCHEDULES[schedule].stages_per_rank or 2
                    if refusal(schedule, pp, v, m):
                        continue
                    try:
                        records = traced_run(Path(tmp), f"pp{pp}-m{m}-{schedule}", pp, schedule, v, m,
                                             args.seq_len, args.steps)
                    except subprocess.CalledProcessError as err:
                        print(f"{pp:>3} {schedule:<17} {v:>2} {m:>3} failed: {err.stderr.strip().splitlines()[-1]}")
                        continue
                    s = summarize(records, pp)
                    planned = schedule_bubble(schedule, pp, m, v)
                    shared = "*" if pp > cores else " "
                    rows.append({"pp": pp, "schedule": schedule, "v": v, "m": m, **s, "planner": planned})
                    print(f"{pp:>3} {schedule:<17} {v:>2} {m:>3} {s['span_ms']:>8.1f} {s['replay_ms']:>9.1f} "
                          f"{s['measured']:>8.1%}{shared} {s['replayed']:>9.1%} {planned:>8.1%} "
                          f"{s['F']:>6.2f} {s['B']:>6.2f} {s['I']:>6.2f} {s['W']:>6.2f}", flush=True)
    if any(pp > cores for pp in args.pp):
        print(f"* {cores} cores for more ranks: the ranks share cores, so the measured bubble is not one; "
              "the replayed one is what the order costs on a core per rank")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
