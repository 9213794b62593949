"""Pipeline bubbles: closed forms per schedule, and a small simulator that lays out the timeline.

Two conventions are in use for the same bubble, and textbooks and course notes mix them:
- fraction of total time (GPipe paper, Huang et al. 2019):
  (p-1) / (m + p-1);
- ratio of bubble time to ideal compute time (Narayanan et al. 2021, eq. 1):
  (p-1) / m, and (p-1) / (v m) for the interleaved schedule.
Both hold for GPipe and 1F1B alike: 1F1B changes the memory (at most p micro-batches in flight),
not the bubble (Narayanan et al. 2021, sec. 2.2.1). The common claim that (p-1)/(p-1+m) is the
GPipe formula and (p-1)/m the 1F1B one mistakes the two conventions for two schedules. gridtrain
reports the fraction of total time (`bubble_fraction`) and names the ratio (`bubble_ratio`) for
figures quoted in Narayanan et al.'s convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gridtrain.layout.schedules import BACKWARD, DEFAULT_SCHEDULE, SPLIT_INPUT, SPLIT_WEIGHT, schedule as row_of
from gridtrain.plan.replay import step_bubble


def bubble_ratio(pp: int, num_microbatches: int, virtual: int = 1) -> float:
    """Bubble time / ideal compute time, Narayanan et al.: (p-1) / (v m)."""
    return (pp - 1) / (virtual * num_microbatches)


def bubble_fraction(pp: int, num_microbatches: int, virtual: int = 1, schedule: str = DEFAULT_SCHEDULE) -> float:
    """Bubble time / total step time.

    gpipe, 1f1b: (p-1) / (m + p-1). interleaved-1f1b and looped-bfs (breadth-first, Lamy-Poirier
    2023): the bubble shrinks by v, (p-1)/v / (m + (p-1)/v) = (p-1) / (v m + p-1). Zero-bubble schedules (Qi et al. 2023) split
    backward into input-gradient B and weight-gradient W and fill the bubble with W: with
    F = B = W, ZB-H1's bubble is (p-1)(F + B - W) = 1/3 of 1F1B's (p-1)(F + B + W), at 1F1B's
    memory; ZB-V (two chunks per rank in a V) brings it to about 0.
    """
    bubble = (pp - 1) / virtual * row_of(schedule).bubble_share
    return bubble / (num_microbatches + bubble)


def min_microbatches(pp: int, target: float, virtual: int = 1, ratio: bool = True,
                     strict: bool = True) -> int:
    """Fewest micro-batches whose bubble is below `target` (at most `target` with strict=False).

    Ratio convention: (p-1)/(v m) < target <=> m > (p-1)/(v target). Fraction convention:
    (p-1)/(v m + p-1) < target <=> m > (p-1)(1 - target)/(v target).
    Worked example: pp 8, 5%: m = 140 gives exactly 5%, so 141 is the first strictly below."""
    bound = (pp - 1) / (virtual * target)
    if not ratio:
        bound *= 1 - target
    m = math.ceil(bound - 1e-9)
    if strict and abs(m - bound) < 1e-9:
        m += 1
    return max(m, 1)


# ---- simulator ----

@dataclass(frozen=True)
class Op:
    stage: int
    """Pipeline rank that runs it."""
    microbatch: int
    kind: str
    """'F' forward or 'B' backward."""
    start: float
    end: float
    chunk: int = 0
    """Virtual stage index on this rank (interleaved schedules)."""


def _order_gpipe(pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]


def _order_1f1b(pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    warmup = min(pp - rank - 1, m)
    order = [("F", j, 0) for j in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k, 0), ("B", k, 0)]
    return order + [("B", j, 0) for j in range(m - warmup, m)]


def _order_interleaved(pp: int, m: int, rank: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B: micro-batches go through chunk 0 in groups of pp, then
    chunk 1, ...; warm-up of (pp - rank - 1) x 2 + (v - 1) x pp forward chunk steps."""
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", (k // (pp * v)) * pp + k % pp, (k // pp) % v)

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", (k // (pp * v)) * pp + k % pp, v - 1 - (k // pp) % v)

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    return order + [bwd(k) for k in range(total - warmup, total)]


def simulate(schedule: str, pp: int, num_microbatches: int, virtual: int = 1,
             t_forward: float = 1.0, t_backward: float = 2.0) -> list[Op]:
    """Lay out one step: each rank runs its ops in the schedule's order, each op as soon as its
    rank is free and its inputs exist (forward of virtual stage s needs s-1's forward of the same
    micro-batch; backward needs s+1's backward and its own forward). A chunk of an interleaved
    rank takes 1/v of the times. Communication is free."""
    row = row_of(schedule)
    if row.rounds_of_pp and not row.split_backward:  # interleaved 1F1B
        if num_microbatches % pp:
            raise ValueError(f"{schedule} needs micro-batches ({num_microbatches}) divisible by pp ({pp})")
        orders = [_order_interleaved(pp, num_microbatches, r, virtual) for r in range(pp)]
    elif row.stages_per_rank == 1 and not row.split_backward:  # GPipe or 1F1B
        virtual = 1
        build = _order_gpipe if row.all_forwards_first else _order_1f1b
        orders = [build(pp, num_microbatches, r) for r in range(pp)]
    else:
        raise ValueError(f"the simulator lays out GPipe, 1F1B and interleaved 1F1B, not {schedule!r}")
    num_stages = pp * virtual
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    cursor = [0] * pp
    ops: list[Op] = []
    while any(cursor[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while cursor[r] < len(orders[r]):
                kind, j, chunk = orders[r][cursor[r]]
                stage = chunk * pp + r
                if kind == "F":
                    deps = [("F", j, stage - 1)] if stage > 0 else []
                else:
                    deps = [("F", j, stage)] + ([("B", j, stage + 1)] if stage < num_stages - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + (t_forward if kind == "F" else t_backward) / virtual
                done[(kind, j, stage)] = free[r] = end
                ops.append(Op(r, j, kind, start, end, chunk))
                cursor[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks at pp={pp}, m={num_microbatches}")
    return ops


def makespan(ops: list[Op]) -> float:
    return max(op.end for op in ops) - min(op.start for op in ops)


def expected_makespan(pp: int, num_microbatches: int, virtual: int = 1,
                      t_forward: float = 1.0, t_backward: float = 2.0) -> float:
    """(m + (p-1)/v) (t_F + t_B): the ideal m (t_F + t_B) plus the bubble (p-1)/v (t_F + t_B)."""
    return (num_microbatches + (pp - 1) / virtual) * (t_forward + t_backward)


def simulated_bubble_fraction(ops: list[Op], pp: int) -> float:
    """Idle share of the ranks' time between the step's start and end."""
    busy = sum(op.end - op.start for op in ops)
    return 1 - busy / (pp * makespan(ops))


def peak_in_flight(ops: list[Op], pp: int, virtual: int = 1) -> list[float]:
    """Per rank, the most forward activations held at once (in micro-batches of the whole rank:
    a chunk counts 1/v), from forward start to its backward's end."""
    peaks = []
    for r in range(pp):
        events = sorted([(op.start, 1) if op.kind == "F" else (op.end, -1)
                         for op in ops if op.stage == r], key=lambda e: (e[0], e[1]))
        held = best = 0
        for _, delta in events:
            held += delta
            best = max(best, held)
        peaks.append(best / virtual)
    return peaks


def render(ops: list[Op], pp: int, virtual: int = 1) -> str:
    """A text chart, one row per pipeline rank, one column per 1/v time unit: forward of
    micro-batch j prints as j (mod 10), backward as a letter ('a' for 0), idle as '.'."""
    scale = virtual
    width = round(makespan(ops) * scale)
    rows = [["."] * width for _ in range(pp)]
    for op in ops:
        mark = str(op.microbatch % 10) if op.kind == "F" else chr(ord("a") + op.microbatch % 26)
        for col in range(round(op.start * scale), round(op.end * scale)):
            rows[op.stage][col] = mark
    lines = [f"rank {r:>2} |{''.join(row)}|" for r, row in enumerate(rows)]
    legend = "digits: forward of micro-batch j; letters: its backward (a = 0); '.': idle"
    return "\n".join(lines + [legend])


# ---- what a schedule costs on gridtrain's runtime (bench/bench_schedules.py measures it) ----

# The measured action costs (BACKWARD, SPLIT_INPUT, SPLIT_WEIGHT) live in the schedule table,
# gridtrain.layout.schedules; torch's action orders in gridtrain.layout.pipeline_order.


def bubble_scale(schedule: str) -> float | None:
    """ZB-H1's closed-form idle time over 1F1B's (None for the schedules torch runs: replayed)."""
    return row_of(schedule).bubble_scale


def split_cost(schedule: str, recompute: str = "none") -> float:
    """A micro-batch's forward and backward under the schedule over the fused F + B: (F + I + W) /
    (F + B) for the split-backward schedules, 1 for the others. Under full recomputation the block
    is recomputed before each of the two passes, one graph task each (parallel/pipeline_parallel.py,
    merged_param_groups: torch's own weight pass recomputed it once per weight), where a fused
    backward recomputes it once: (F + R + I + R + W) / (F + R + B), R a forward."""
    if not row_of(schedule).split_backward:
        return 1.0
    if recompute == "full":
        return (3 + SPLIT_INPUT + SPLIT_WEIGHT) / (2 + BACKWARD)
    return (1 + SPLIT_INPUT + SPLIT_WEIGHT) / (1 + BACKWARD)


def schedule_bubble(schedule: str, pp: int, num_microbatches: int, virtual: int = 1) -> float:
    """The idle share of a pipeline rank's step under the schedule: torch's own action order for
    (pp, v, m) replayed with the measured action costs (plan/replay.py). It is bubble_fraction
    wherever that holds (GPipe and 1F1B at any m, the interleaved schedules at m a multiple of pp)
    and the truth where it does not: one micro-batch through 2 ranks idles each half the step
    under every schedule (interleaving cannot help what runs serially; the closed form says
    1/(v + 1)). The zero-bubble schedules keep the idle time their order leaves and pay the split
    backward's extra cost in every micro-batch. ZB-H1, which torch does not run, by its closed
    form: idle (p-1)/v x (F + B) x bubble_scale over work m x (F + B) x split_cost."""
    if pp == 1:
        return 0.0
    row = row_of(schedule)
    v = row.virtual(virtual)
    if row.runnable:
        return step_bubble(schedule, pp, v, num_microbatches)
    idle = (pp - 1) / v * bubble_scale(schedule)
    return idle / (num_microbatches * split_cost(schedule) + idle)
