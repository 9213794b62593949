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

import functools
import math
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "interleaved-zb", "zbv",
             "dualpipev")
"""gridtrain's schedules (gridtrain.parallel.dims.PP_SCHEDULES) plus ZB-H1."""


def bubble_ratio(pp: int, num_microbatches: int, virtual: int = 1) -> float:
    """Bubble time / ideal compute time, Narayanan et al.: (p-1) / (v m)."""
    return (pp - 1) / (virtual * num_microbatches)


def bubble_fraction(pp: int, num_microbatches: int, virtual: int = 1, schedule: str = "1f1b") -> float:
    """Bubble time / total step time.

    gpipe, 1f1b: (p-1) / (m + p-1). interleaved-1f1b and looped-bfs (breadth-first, Lamy-Poirier
    2023): the bubble shrinks by v, (p-1)/v / (m + (p-1)/v) = (p-1) / (v m + p-1). Zero-bubble schedules (Qi et al. 2023) split
    backward into input-gradient B and weight-gradient W and fill the bubble with W: with
    F = B = W, ZB-H1's bubble is (p-1)(F + B - W) = 1/3 of 1F1B's (p-1)(F + B + W), at 1F1B's
    memory; ZB-V (two chunks per rank in a V) brings it to about 0.
    """
    bubble = (pp - 1) / virtual
    if schedule in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"):
        return bubble / (num_microbatches + bubble)
    if schedule in ("zb-h1", "interleaved-zb"):
        bubble /= 3
        return bubble / (num_microbatches + bubble)
    if schedule in ("zbv", "dualpipev"):
        return 0.0
    raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")


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
    if schedule == "interleaved-1f1b":
        if num_microbatches % pp:
            raise ValueError(f"interleaved-1f1b needs micro-batches ({num_microbatches}) divisible by pp ({pp})")
        orders = [_order_interleaved(pp, num_microbatches, r, virtual) for r in range(pp)]
    elif schedule in ("gpipe", "1f1b"):
        virtual = 1
        build = _order_gpipe if schedule == "gpipe" else _order_1f1b
        orders = [build(pp, num_microbatches, r) for r in range(pp)]
    else:
        raise ValueError(f"the simulator lays out gpipe, 1f1b and interleaved-1f1b, not {schedule!r}")
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


# ---- what each rank holds: torch 2.13's schedules, measured ----

def _interleaved_forwards(count: int, group: int, virtual: int) -> dict[int, int]:
    """Per chunk, how many of the first `count` forward steps of Megatron's interleaved order
    (groups of `group` micro-batches through chunk 0, then chunk 1, ...) it ran."""
    out = dict.fromkeys(range(virtual), 0)
    for k in range(count):
        out[(k // group) % virtual] += 1
    return out


@functools.lru_cache(maxsize=8192)
def forwards_held(schedule: str, pp: int, virtual: int, m: int, rank: int, peak: bool = False) -> dict[int, int]:
    """Micro-batch forwards whose activations pipeline rank `rank` holds, per stage index it runs:
    at its first backward (what the accounting measures), or at the step's peak. Counted on
    torch 2.13's schedules (every schedule at pp 2 and 4, m from pp to 4 pp); F, B and W are a
    chunk's forward, full (or input) backward and weight backward:
    - gpipe, looped-bfs: every forward first, m per stage;
    - 1f1b: pp - rank;
    - interleaved-1f1b: 2 (pp - rank - 1) + (v - 1) g + 1 forward steps in the interleaved order,
      g the micro-batches of a round (pp when pp divides m); the turn is the peak;
    - interleaved-zb: (v - 1) g + pp - rank steps at the turn; W passes deferred, pp per chunk at the peak;
    - zbv: 2 pp - 1 - rank on its first stage, rank + 1 on its second, the turn is the peak;
    - dualpipev: max(2 pp - 1 - rank, pp + 1) and rank + 1 at the turn, 2 pp - rank on the first at the peak.
    Every count is capped at m. (Cached: callers must not change the dict.)"""
    if pp == 1:
        return {0: 1}
    v = virtual if schedule not in ("gpipe", "1f1b") else 1
    stages = [s for s in range(pp * v) if _owner(s, pp, v, schedule) == rank]
    if schedule in ("gpipe", "looped-bfs"):
        counts = [m] * v
    elif schedule == "1f1b":
        counts = [pp - rank]
    elif schedule in ("interleaved-1f1b", "interleaved-zb"):
        group = m // max(1, m // pp)
        if schedule == "interleaved-1f1b":
            steps = 2 * (pp - rank - 1) + (v - 1) * group + 1
        else:
            steps = (v - 1) * group + pp - rank
        counts = [pp] * v if schedule == "interleaved-zb" and peak else list(
            _interleaved_forwards(min(steps, m * v), group, v).values())
    elif schedule == "zbv":
        counts = [2 * pp - 1 - rank, rank + 1]
    elif schedule == "dualpipev":
        counts = [2 * pp - rank if peak else max(2 * pp - 1 - rank, pp + 1), rank + 1]
    else:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    return {stage: min(count, m) for stage, count in zip(stages, counts)}


def _owner(stage: int, pp: int, virtual: int, schedule: str) -> int:
    """The pipeline rank that runs a stage (parallel.dims.stage_ranks, for one stage)."""
    if schedule in ("zbv", "dualpipev"):
        return stage if stage < pp else pp * virtual - 1 - stage
    return stage % pp



# ---- what a schedule costs on gridtrain's runtime: measured (bench/bench_schedules.py) ----

BACKWARD = 1.95
"""A fused backward over its forward: two matmuls for each of the forward's, measured 1.95 per
layer on the small model (bench/bench_schedules.py, 1.9-2.0 over 28 runs of its 7 schedules)."""
SPLIT_INPUT, SPLIT_WEIGHT = 1.27, 0.95
"""The zero-bubble schedules' split backward (Qi et al. 2023): the input-gradient pass I and the
weight-gradient pass W over the forward, measured per layer (I 1.22-1.30, W 0.91-1.07). Together
they cost 14% more than the fused backward (a micro-batch's F + I + W is 9% over F + B): torch's
stage walks the autograd graph twice and keeps the weight pass's inputs alive between the two."""
SPLIT_SCHEDULES = ("zb-h1", "interleaved-zb", "zbv", "dualpipev")

BUBBLE_SCALE = {"gpipe": 1.0, "1f1b": 1.0, "interleaved-1f1b": 1.12, "looped-bfs": 1.32,
                "zb-h1": (1 + SPLIT_INPUT - SPLIT_WEIGHT) / (1 + BACKWARD),
                "interleaved-zb": 0.82, "zbv": 0.77, "dualpipev": 0.67}
"""Each schedule's idle time in units of (p-1)/v x a rank's forward and fused backward (v = 1
for GPipe and 1F1B), over 1F1B's, whose idle time is that unit (Narayanan et al. 2021, sec.
2.2). Measured on torch 2.13's schedules: bench/bench_schedules.py replays each step's traced
actions on a core per rank; the mean over PP 2 and PP 4 with 8 micro-batches, two runs each
(spread about 0.1-0.2). The zero-bubble schedules keep most of 1F1B's bubble (Qi et al. 2023 find
ZB-V's near zero only when F = B = W and m is large against p); ZB-H1, which gridtrain's runtime
does not have, is Qi et al.'s (p-1)(F + I - W)."""


def bubble_scale(schedule: str) -> float:
    if schedule not in BUBBLE_SCALE:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    return BUBBLE_SCALE[schedule]


def split_cost(schedule: str) -> float:
    """A micro-batch's forward and backward under the schedule over the fused F + B: (F + I + W) /
    (F + B) for the split-backward schedules, 1 for the others."""
    if schedule in SPLIT_SCHEDULES:
        return (1 + SPLIT_INPUT + SPLIT_WEIGHT) / (1 + BACKWARD)
    return 1.0


def schedule_bubble(schedule: str, pp: int, num_microbatches: int, virtual: int = 1) -> float:
    """The idle share of a pipeline rank's step under the schedule, as measured: work m x (F + B)
    x split_cost, idle (p-1)/v x (F + B) x bubble_scale. For GPipe and 1F1B this is
    bubble_fraction; the zero-bubble schedules keep a bubble (a share of 1F1B's, measured) and pay
    the split backward's extra cost in every micro-batch."""
    if pp == 1:
        return 0.0
    v = 1 if schedule in ("gpipe", "1f1b") else virtual
    idle = (pp - 1) / v * bubble_scale(schedule)
    return idle / (num_microbatches * split_cost(schedule) + idle)
