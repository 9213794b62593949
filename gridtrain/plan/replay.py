"""One pipeline step laid out in time: each rank runs its actions in its schedule's order
(layout/pipeline_order.py, torch's), each as soon as the rank is free and its inputs exist.

Inputs: a forward of stage s needs stage s-1's forward of the same micro-batch; a backward (fused
B, or the input-gradient half I) needs its own forward and stage s+1's backward; a weight pass W
needs its I. Communication is free. Costs are per layer, relative to a forward (schedules.py
measured them on gridtrain's runtime: B 1.95, I 1.27, W 0.95), times the stage's layers; the first
stage's split backward is all weight pass (`_cost`).

What comes out is what the closed forms approximate and where they do not hold (m < pp, m not a
multiple of pp, a V or zero-bubble order whose W passes do not fill the gaps): the step's span and
each rank's idle share. (What a rank holds in flight needs no times: layout/pipeline_order.py
counts it on the order.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gridtrain.layout.dims import stage_layer_counts
from gridtrain.layout.pipeline_order import rank_order, steady_from
from gridtrain.layout.schedules import BACKWARD, SPLIT_INPUT, SPLIT_WEIGHT, schedule as row_of

COSTS = {"F": 1.0, "B": BACKWARD, "I": SPLIT_INPUT, "W": SPLIT_WEIGHT}
"""Seconds of an action per layer, in forwards (schedules.py's measured ratios)."""


Timed = tuple[int, str, int, int, float, float]
"""(rank, kind, stage, micro-batch, start, end) of one action."""


@dataclass(frozen=True)
class Replay:
    actions: tuple[Timed, ...]
    span: float
    """From the first action's start to the last one's end."""
    busy: tuple[float, ...]
    """Per rank, the time it computes."""

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


@functools.lru_cache(maxsize=2048)
def replay(schedule: str, pp: int, virtual: int, m: int, n_layers: int = 0, fewer_edge_layers: int = 0) -> Replay:
    """The step of `schedule` over pp ranks (virtual stages each where it takes them) and m
    micro-batches. A rank's layer set costs 1 forward when n_layers is 0 (each stage 1/v of it),
    else each stage costs its layers (stage_layer_counts' split)."""
    v = row_of(schedule).virtual(virtual)
    stages = pp * v
    counts = stage_layer_counts(n_layers, stages, fewer_edge_layers) if n_layers else [1 / v] * stages
    cost = {kind: [_cost(kind, s) * counts[s] for s in range(stages)] for kind in COSTS}
    orders = [rank_order(schedule, pp, v, m, r) for r in range(pp)]
    # When each (stage, micro-batch) finished its forward, its input gradient (B or I), its I.
    forward, gradient, input_pass = ([-1.0] * (stages * m) for _ in range(3))
    free, cursor, timed = [0.0] * pp, [0] * pp, []
    while any(cursor[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            order, i, t = orders[r], cursor[r], free[r]
            while i < len(order):
                kind, stage, j = order[i]
                at = stage * m + j
                if kind == "F":
                    ready = forward[at - m] if stage else 0.0
                elif kind == "W":
                    ready = input_pass[at]
                elif stage == stages - 1:  # B or I of the last stage: its forward
                    ready = forward[at]
                else:  # B or I: its forward, and the next stage's gradient of its output
                    f, g = forward[at], gradient[at + m]
                    ready = -1.0 if f < 0 or g < 0 else max(f, g)
                if ready < 0:
                    break
                start = t if t > ready else ready
                t = start + cost[kind][stage]
                timed.append((r, kind, stage, j, start, t))
                if kind == "F":
                    forward[at] = t
                else:
                    if kind != "W":
                        gradient[at] = t
                    if kind == "I":
                        input_pass[at] = t
                i += 1
            progressed |= i > cursor[r]
            cursor[r], free[r] = i, t
        if not progressed:
            raise RuntimeError(f"{schedule} deadlocks at pp={pp}, v={v}, m={m}")
    busy = [0.0] * pp
    for rank, _, _, _, start, end in timed:
        busy[rank] += end - start
    return Replay(tuple(timed), max(free) - min(a[4] for a in timed), tuple(busy))


@functools.lru_cache(maxsize=8192)
def step_bubble(schedule: str, pp: int, virtual: int, m: int) -> float:
    """The idle share of the step (Replay.bubble) for uniform stages. For the fused-backward
    schedules at m >= pp (GPipe and 1F1B at any m) the replay is the closed form
    (p-1)/v / (m + (p-1)/v), which is taken without replaying (tests/test_plan_replay.py holds the
    two equal). Where more micro-batches add only steady-state work (pipeline_order.steady_from),
    the idle time is replayed at 2 pp micro-batches and the work counted on the orders (DualPipeV's
    steady state runs fused backwards, its ends split ones), so that a search over thousands of
    layouts replays small steps only."""
    row = row_of(schedule)
    v = row.virtual(virtual)
    if not row.split_backward and (row.stages_per_rank == 1 or m >= pp):
        idle = (pp - 1) / v
        return idle / (m + idle)
    ref = steady_from(schedule, pp, m)
    if ref is None:
        return replay(schedule, pp, virtual, m).bubble
    r = replay(schedule, pp, virtual, ref)
    idle = len(r.busy) * r.span - sum(r.busy)
    at_ref, next_round = (_work(schedule, pp, v, n) for n in (ref, ref + pp))
    return idle / (idle + at_ref + (next_round - at_ref) * (m - ref) / pp)


def _work(schedule: str, pp: int, v: int, m: int) -> float:
    """The ranks' busy time in a step of m micro-batches (uniform stages, 1/v of a rank's layers):
    each stage runs each micro-batch's forward and its backward, fused or split; DualPipeV mixes
    the two, so its actions are counted."""
    if schedule == "dualpipev":
        return sum(_cost(kind, stage) / v for r in range(pp) for kind, stage, _ in rank_order(schedule, pp, v, m, r))
    backward = COSTS["I"] + COSTS["W"] if row_of(schedule).split_backward else COSTS["B"]
    return pp * m * (COSTS["F"] + backward)
