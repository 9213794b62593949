"""The pipeline schedules: one table that the runtime, the validation and the planner all read.

Each row says how torch runs the schedule (its class in `torch.distributed.pipelining.schedules`,
or none for ZB-H1, which the planner costs but the runtime does not have), how many stages a
rank holds and where, how many micro-batches it needs, and its bubble and memory rules. Nothing
else in gridtrain lists schedule names or tests a schedule by name: it reads these fields.

Bubbles (fraction of a rank's step spent idle) follow two conventions that are easy to mix up:
GPipe's (p-1)/(m + p-1) of total time (Huang et al. 2019) and Megatron-LM's (p-1)/m of ideal
compute time (Narayanan et al. 2021, eq. 1); both hold for GPipe and 1F1B alike, 1F1B changes the
memory (at most p micro-batches in flight), not the bubble (Narayanan et al. 2021, sec. 2.2.1).
The zero-bubble schedules split each backward into an input-gradient pass and a weight-gradient
pass and fill the bubble with the latter (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Literal, get_args

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "interleaved-zb", "zbv",
                       "dualpipev"]

BACKWARD = 1.95
"""A fused backward over its forward: two matmuls for each of the forward's, measured 1.95 per
layer on the small model (bench/bench_schedules.py, 1.9-2.0 over 28 runs of its 7 schedules)."""
SPLIT_INPUT, SPLIT_WEIGHT = 1.27, 0.95
"""The zero-bubble schedules' split backward: the input-gradient pass I and the weight-gradient
pass W over the forward, measured per layer (I 1.22-1.30, W 0.91-1.07). Together they cost 14%
more than the fused backward (a micro-batch's F + I + W is 9% over F + B): torch's stage walks
the autograd graph twice and keeps the weight pass's inputs alive between the two."""

Held = Callable[[int, int, int, int, bool], list[int]]
"""(pp, virtual, m, rank, peak) -> forwards held per stage the rank runs, in stage order."""


def _interleaved_forwards(count: int, group: int, virtual: int) -> list[int]:
    """Per chunk, how many of the first `count` forward steps of Megatron's interleaved order
    (groups of `group` micro-batches through chunk 0, then chunk 1, ...) it ran."""
    out = [0] * virtual
    for k in range(count):
        out[(k // group) % virtual] += 1
    return out


def _held_interleaved_1f1b(pp: int, v: int, m: int, rank: int, peak: bool) -> list[int]:
    group = m // max(1, m // pp)
    steps = 2 * (pp - rank - 1) + (v - 1) * group + 1
    return _interleaved_forwards(min(steps, m * v), group, v)


def _held_interleaved_zb(pp: int, v: int, m: int, rank: int, peak: bool) -> list[int]:
    if peak:
        return [pp] * v
    group = m // max(1, m // pp)
    return _interleaved_forwards(min((v - 1) * group + pp - rank, m * v), group, v)


@dataclass(frozen=True)
class Schedule:
    name: ScheduleName
    torch_class: str | None
    """Its class in torch.distributed.pipelining.schedules; None: planned, not run."""
    stages_per_rank: int | None
    """1 or 2 fixed, None: parallel.pp_virtual_stages (interleaved, 2 or more)."""
    v_shape: bool
    """Rank r holds stages r and 2pp-1-r (else stage s runs on rank s % pp)."""
    split_backward: bool
    """Each micro-batch's backward runs as an input-gradient and a weight-gradient pass."""
    all_forwards_first: bool
    """Every forward runs before any backward: all m micro-batches in flight."""
    rounds_of_pp: bool
    """Micro-batches run in rounds of pp, whose count must divide m (torch's interleaved schedules)."""
    min_microbatches_are_stages: bool
    """torch needs at least as many micro-batches as stages (else at least one)."""
    bubble_share: float
    """The closed-form bubble over 1F1B's (p-1)/v: 1, 1/3 (ZB-H1, F = B = W), or 0 (ZB-V)."""
    bubble_scale: float | None
    """For a schedule torch does not run (ZB-H1): its closed-form idle time in units of (p-1)/v x a
    rank's forward and fused backward, over 1F1B's (Qi et al.'s (p-1)(F + I - W)). The schedules
    torch runs are costed by replaying their action order (plan/replay.py): None. (Measured on
    gridtrain's runtime at pp 2 and 4, 8 micro-batches, their idle time over 1F1B's was 1.12 for
    interleaved 1F1B, 1.32 for looped-BFS, 0.82 for interleaved ZB, 0.77 for ZB-V and 0.67 for
    DualPipeV; the replayed orders, with communication free, give 1.00, 1.00, 0.45, 0.43, 0.40:
    bench/bench_schedules.py prints both.)"""
    in_flight: Callable[[int, int, int, int], float]
    """(pp, virtual, m, rank) -> micro-batches of the rank's whole layer set held at its peak, the
    closed form (a chunk of an interleaved rank counts 1/v), before the cap at m."""
    held: Held
    """Forwards held per stage at the rank's first backward (what the accounting measures) or its
    peak, as closed forms, counted on torch 2.13's schedules at pp 2 and 4, m from pp to 4 pp
    (interleaved ZB's peak at multiples of pp). forwards_held counts them on the action order
    instead wherever torch runs the schedule; these serve ZB-H1, which it does not."""
    searched: bool
    """The planner tries it unasked (GPipe and looped-BFS are dominated: 1F1B's or a larger bubble
    with every micro-batch in flight)."""

    def virtual(self, pp_virtual_stages: int) -> int:
        """Stages per pipeline rank under this schedule."""
        return self.stages_per_rank or pp_virtual_stages

    def min_microbatches(self, num_stages: int) -> int:
        return num_stages if self.min_microbatches_are_stages else 1

    @property
    def runnable(self) -> bool:
        return self.torch_class is not None


def _row(name: ScheduleName, torch_class: str | None, stages: int | None, *, bubble_share: float,
         bubble_scale: float | None, in_flight: Callable[[int, int, int, int], float], held: Held,
         v_shape: bool = False, split: bool = False, all_first: bool = False, rounds: bool = False,
         min_is_stages: bool = False, searched: bool = True) -> Schedule:
    return Schedule(name, torch_class, stages, v_shape, split, all_first, rounds, min_is_stages,
                    bubble_share, bubble_scale, in_flight, held, searched)


def _all_m(pp: int, v: int, m: int, rank: int) -> float:
    return float(m)


def _pp_minus_rank(pp: int, v: int, m: int, rank: int) -> float:
    return float(pp - rank)


def _interleaved(pp: int, v: int, m: int, rank: int) -> float:
    """((v+1)p - 2 rank - 1)/v, which on the first rank is p (1 + (p-1)/(p v)) (Korthikanti et
    al. 2022)."""
    return ((v + 1) * pp - 2 * rank - 1) / v


def _pp(pp: int, v: int, m: int, rank: int) -> float:
    """ZB-V keeps 1F1B's peak, balanced over the ranks."""
    return float(pp)


_ROWS = (
    _row("gpipe", "ScheduleGPipe", 1, bubble_share=1, bubble_scale=None, in_flight=_all_m, all_first=True,
         held=lambda pp, v, m, rank, peak: [m], searched=False),
    # "at most p" in flight (Narayanan et al. 2021); the p-1 sometimes quoted counts the warm-up forwards.
    _row("1f1b", "Schedule1F1B", 1, bubble_share=1, bubble_scale=None, in_flight=_pp_minus_rank,
         min_is_stages=True, held=lambda pp, v, m, rank, peak: [pp - rank]),
    # g micro-batches a round (pp when pp divides m); the turn from warm-up to steady state is the peak.
    _row("interleaved-1f1b", "ScheduleInterleaved1F1B", None, bubble_share=1, bubble_scale=None,
         in_flight=_interleaved, rounds=True, held=_held_interleaved_1f1b),
    # Breadth-first (Lamy-Poirier 2023): every chunk's forwards first.
    _row("looped-bfs", "ScheduleLoopedBFS", None, bubble_share=1, bubble_scale=None, in_flight=_all_m,
         all_first=True, held=lambda pp, v, m, rank, peak: [m] * v, searched=False),
    _row("zb-h1", None, 1, bubble_share=1 / 3, bubble_scale=(1 + SPLIT_INPUT - SPLIT_WEIGHT) / (1 + BACKWARD),
         in_flight=_pp_minus_rank, split=True, held=lambda pp, v, m, rank, peak: [pp - rank], searched=False),
    # Weight passes deferred: pp forwards per chunk at the peak.
    _row("interleaved-zb", "ScheduleInterleavedZeroBubble", None, bubble_share=1 / 3, bubble_scale=None,
         in_flight=_interleaved, split=True, rounds=True, held=_held_interleaved_zb),
    _row("zbv", "ScheduleZBVZeroBubble", 2, bubble_share=0, bubble_scale=None, in_flight=_pp, v_shape=True,
         split=True, held=lambda pp, v, m, rank, peak: [2 * pp - 1 - rank, rank + 1]),
    _row("dualpipev", "ScheduleDualPipeV", 2, bubble_share=0, bubble_scale=None, in_flight=_pp, v_shape=True,
         split=True, min_is_stages=True,
         held=lambda pp, v, m, rank, peak: [2 * pp - rank if peak else max(2 * pp - 1 - rank, pp + 1), rank + 1]),
)
SCHEDULES: dict[str, Schedule] = {row.name: row for row in _ROWS}
assert tuple(SCHEDULES) == get_args(ScheduleName)
DEFAULT_SCHEDULE: ScheduleName = "1f1b"
RUNTIME_SCHEDULES: tuple[str, ...] = tuple(name for name, s in SCHEDULES.items() if s.runnable)
"""What parallel.pp_schedule accepts: the schedules torch runs."""
RuntimeScheduleName = Literal[RUNTIME_SCHEDULES]  # type: ignore[valid-type]  # the same names, as a type


def schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def stage_ranks(pp: int, virtual: int, name: str) -> list[int]:
    """The pipeline rank that runs each stage: loop style (stage s on rank s % pp) for
    interleaved schedules, V style (rank r holds stages r and 2pp-1-r) for the V schedules."""
    num_stages = pp * virtual
    if schedule(name).v_shape:
        return [s if s < pp else num_stages - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


@functools.lru_cache(maxsize=8192)
def forwards_held(name: str, pp: int, virtual: int, m: int, rank: int, peak: bool = False) -> dict[int, int]:
    """Micro-batch forwards whose activations pipeline rank `rank` holds, per stage index it
    runs: at its first backward or at the step's peak. Counted on the schedule's action order
    (layout/pipeline_order.py, torch's) where torch runs it; otherwise (ZB-H1, or an m torch
    refuses) Schedule.held, capped at m. Cached: callers must not change the dict."""
    if pp == 1:
        return {0: 1}
    from gridtrain.layout.pipeline_order import held_at_first_backward, held_at_peak, refusal

    row = schedule(name)
    v = row.virtual(virtual)
    stages = [s for s, r in enumerate(stage_ranks(pp, v, name)) if r == rank]
    if row.runnable and not refusal(name, pp, v, m):
        counts = (held_at_peak if peak else held_at_first_backward)(name, pp, v, m, rank)
        return {stage: counts.get(stage, 0) for stage in stages}
    return {stage: min(count, m) for stage, count in zip(stages, row.held(pp, v, m, rank, peak))}


def in_flight(name: str, pp: int, rank: int, num_microbatches: int, virtual: int = 1) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of the
    rank's whole layer set (a stage counts 1/v): counted on the action order where torch runs
    the schedule (forwards_held), else Schedule.in_flight's closed form, capped at m."""
    if pp == 1:
        return 1.0
    row = schedule(name)
    v = row.virtual(virtual)
    if row.runnable:
        from gridtrain.layout.pipeline_order import refusal

        if not refusal(name, pp, v, num_microbatches):
            return sum(forwards_held(name, pp, v, num_microbatches, rank, peak=True).values()) / v
    return min(row.in_flight(pp, virtual, num_microbatches, rank), float(num_microbatches))
