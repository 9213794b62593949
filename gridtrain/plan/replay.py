"""One pipeline step laid out in time: each rank runs its actions in its schedule's order
(layout/pipeline_order.py, torch's), each as soon as the rank is free and its inputs exist.

Inputs: a forward of stage s needs stage s-1's forward of the same micro-batch; a backward (fused
B, or the input-gradient half I) needs its own forward and stage s+1's backward; a weight pass W
needs its I. Communication is free. Costs are per layer, relative to a forward (schedules.py
measured them on gridtrain's runtime: B 1.95, I 1.27, W 0.95), times the stage's layers; the first
stage's split backward is all weight pass (`_cost`).

What comes out is what the closed forms approximate and where they do not hold (m < pp, m not a
multiple of pp, a V or zero-bubble order whose W passes do not fill the gaps): the step's span,
each rank's idle share, and the activations each rank holds at its peak (a micro-batch's stage
from its forward until the backward that frees them: B, or W under a split backward, which
still reads the stage's inputs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gridtrain.layout.dims import stage_layer_counts
from gridtrain.layout.pipeline_order import rank_order
from gridtrain.layout.schedules import BACKWARD, SPLIT_INPUT, SPLIT_WEIGHT, schedule as row_of, stage_ranks

COSTS = {"F": 1.0, "B": BACKWARD, "I": SPLIT_INPUT, "W": SPLIT_WEIGHT}
"""Seconds of an action per layer, in forwards (schedules.py's measured ratios)."""


@dataclass(frozen=True)
class Timed:
    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Replay:
    actions: tuple[Timed, ...]
    span: float
    """From the first action's start to the last one's end."""
    busy: tuple[float, ...]
    """Per rank, the time it computes."""
    peak_held: tuple[float, ...]
    """Per rank, the most activations it holds at once, in micro-batches of its whole layer set."""

    @property
    def bubble(self) -> float:
        """The ranks' idle share of the step: 1 - busy / (pp x span)."""
        return 1 - sum(self.busy) / (len(self.busy) * self.span)


def _cost(kind: str, stage: int) -> float:
    """An action's cost per layer. The first stage's input is token ids, which have no gradient:
    torch's input pass there computes nothing and its weight pass all of the backward (measured:
    0.0 ms and 18-20 ms where later stages take 13-17 and 8-10)."""
    if stage == 0 and kind in ("I", "W"):
        return 0.0 if kind == "I" else COSTS["I"] + COSTS["W"]
    return COSTS[kind]


def _ready(kind: str, stage: int, j: int, last: int, done: dict[tuple[str, int, int], float]) -> float | None:
    """When the action's inputs exist (None: not yet)."""
    if kind == "F":
        deps = [("F", stage - 1, j)] if stage > 0 else []
    elif kind == "W":
        deps = [("I", stage, j)]
    else:  # B or I: its forward, and the gradient of its output from the next stage's B or I
        nxt = [] if stage == last else [("B", stage + 1, j) if ("B", stage + 1, j) in done else ("I", stage + 1, j)]
        deps = [("F", stage, j)] + nxt
    times = [done.get(d) for d in deps]
    return None if any(t is None for t in times) else max(times, default=0.0)


@functools.lru_cache(maxsize=2048)
def replay(schedule: str, pp: int, virtual: int, m: int, n_layers: int = 0, fewer_edge_layers: int = 0) -> Replay:
    """The step of `schedule` over pp ranks (virtual stages each where it takes them) and m
    micro-batches. A rank's layer set costs 1 forward when n_layers is 0 (each stage 1/v of it),
    else each stage costs its layers (stage_layer_counts' split)."""
    v = row_of(schedule).virtual(virtual)
    stages = pp * v
    counts = stage_layer_counts(n_layers, stages, fewer_edge_layers) if n_layers else [1 / v] * stages
    orders = [rank_order(schedule, pp, v, m, r) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    free, cursor, timed = [0.0] * pp, [0] * pp, []
    while any(cursor[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while cursor[r] < len(orders[r]):
                kind, stage, j = orders[r][cursor[r]]
                ready = _ready(kind, stage, j, stages - 1, done)
                if ready is None:
                    break
                start = max(free[r], ready)
                end = start + _cost(kind, stage) * counts[stage]
                done[(kind, stage, j)] = free[r] = end
                timed.append(Timed(r, kind, stage, j, start, end))
                cursor[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} deadlocks at pp={pp}, v={v}, m={m}")
    span = max(t.end for t in timed) - min(t.start for t in timed)
    busy = tuple(sum(t.end - t.start for t in timed if t.rank == r) for r in range(pp))
    return Replay(tuple(timed), span, busy, _peaks(timed, pp, counts, schedule, v))


def _peaks(timed: list[Timed], pp: int, counts: list[float], schedule: str, v: int) -> tuple[float, ...]:
    """Per rank, the most activations held at once (a stage's share of the rank's layers per
    micro-batch), each from its forward's start until its freeing backward ends."""
    owners = stage_ranks(pp, v, schedule)
    freeing = "W" if row_of(schedule).split_backward else "B"
    peaks = []
    for r in range(pp):
        layers = sum(c for s, c in enumerate(counts) if owners[s] == r) or 1
        events = []
        for t in timed:
            if t.rank != r:
                continue
            share = counts[t.stage] / layers
            if t.kind == "F":
                events.append((t.start, 1, share))
            elif t.kind == freeing or t.kind == "B":
                events.append((t.end, 0, -share))
        held = best = 0.0
        for _, _, delta in sorted(events):
            held += delta
            best = max(best, held)
        peaks.append(best)
    return tuple(peaks)


@functools.lru_cache(maxsize=8192)
def step_bubble(schedule: str, pp: int, virtual: int, m: int) -> float:
    """The idle share of the step (Replay.bubble) for uniform stages. From 2 pp micro-batches on,
    more micro-batches add steady-state work and no idle time (for m a multiple of pp under the
    interleaved schedules, whose rounds change with m otherwise), and the work grows by the same
    amount per micro-batch (DualPipeV's steady state runs fused backwards, its ends split ones):
    such steps are replayed at 2 pp and 3 pp, their idle time kept and their work extended
    (tests/test_plan_replay.py holds both ways equal), so that a search over thousands of layouts
    replays small steps only."""
    row = row_of(schedule)
    if m <= 3 * pp or (row.rounds_of_pp and m % pp):
        return replay(schedule, pp, virtual, m).bubble
    two, three = replay(schedule, pp, virtual, 2 * pp), replay(schedule, pp, virtual, 3 * pp)
    idle = len(two.busy) * two.span - sum(two.busy)
    work = sum(two.busy) + (sum(three.busy) - sum(two.busy)) * (m - 2 * pp) / pp
    return idle / (idle + work)
