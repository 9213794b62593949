"""The order in which each pipeline rank runs its compute actions, as torch's schedules run them.

An action is (kind, stage, micro-batch): 'F' forward, 'B' fused backward, 'I' and 'W' the
input-gradient and weight-gradient halves of a split backward (Qi et al. 2023). DualPipeV's
overlapped pairs are listed as their forward then their backward, which is how a rank without a
second stream runs them. The generators follow torch 2.13's `torch.distributed.pipelining`:
GPipe's and 1F1B's `_step_microbatches` (the runtime, not their drawing), the
`_calculate_single_rank_operations` of the multi-stage schedules; tests/test_pipeline_order.py
holds them equal to torch's own for every schedule at pp 2 and 4. `refusal` says which (pp, v, m)
torch refuses, in its words. Nothing here imports torch: the planner replays these orders
(plan/replay.py) for any pp, v and m, where the closed forms hold only for m >= pp.
"""

from __future__ import annotations

import functools

from gridtrain.layout.schedules import schedule as row_of

Action = tuple[str, int, int]
"""(kind, stage, micro-batch): kind 'F', 'B', 'I' or 'W'."""


def refusal(name: str, pp: int, v: int, m: int) -> str:
    """Why torch's schedule refuses m micro-batches over pp ranks with v stages each ('' if it
    runs them)."""
    row = row_of(name)
    stages = pp * row.virtual(v)
    if row.min_microbatches_are_stages and m < stages:
        return f"{name} needs at least as many micro-batches as stages ({stages}), not {m}"
    if row.rounds_of_pp and m % max(1, m // pp):
        return (f"{name} runs micro-batches in rounds of {m // max(1, m // pp)}: {m} is not a multiple of "
                f"the {max(1, m // pp)} rounds (m // pp)")
    return ""


@functools.lru_cache(maxsize=4096)
def rank_order(name: str, pp: int, v: int, m: int, rank: int) -> tuple[Action, ...]:
    """The compute actions pipeline rank `rank` runs in one step, in order."""
    if refusal(name, pp, v, m):
        raise ValueError(refusal(name, pp, v, m))
    row = row_of(name)
    if row.stages_per_rank == 1:
        return tuple(_gpipe(m, rank) if row.all_forwards_first else _one_f_one_b(pp, m, rank))
    builders = {"looped-bfs": _looped_bfs, "interleaved-1f1b": _interleaved, "interleaved-zb": _interleaved_zb,
                "zbv": _zbv, "dualpipev": _dualpipev}
    if name not in builders:
        raise ValueError(f"{name} has no runtime order (torch does not run it)")
    return tuple(builders[name](pp, row.virtual(v), m, rank))


def _gpipe(m: int, rank: int) -> list[Action]:
    return [("F", rank, j) for j in range(m)] + [("B", rank, j) for j in range(m)]


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    """torch's Schedule1F1B: min(m, pp - rank) forwards of warm-up (the last stage one), then a
    backward and a forward in turn, then the remaining backwards."""
    warmup = min(m, pp - rank)
    out = [("F", rank, j) for j in range(warmup)]
    forward, backward = warmup, 0
    while True:
        out.append(("B", rank, backward))
        backward += 1
        if forward == m:
            break
        out.append(("F", rank, forward))
        forward += 1
    return out + [("B", rank, j) for j in range(backward, m)]


def _looped_bfs(pp: int, v: int, m: int, rank: int) -> list[Action]:
    stages = range(rank, pp * v, pp)
    return ([("F", s, j) for s in stages for j in range(m)]
            + [("B", s, j) for s in reversed(stages) for j in reversed(range(m))])


def _rounds(pp: int, m: int) -> int:
    return m // max(1, m // pp)


def _warmup(rank: int, v: int, per_round: int, pp: int, m: int, factor: int) -> int:
    return min((v - 1) * per_round + factor * (pp - 1 - rank), m * v)


def _interleaved(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B as torch runs it (depth first, rounds of m // (m // pp))."""
    per_round = _rounds(pp, m)
    warmup = _warmup(rank, v, per_round, pp, m, 2)
    return _one_f_one_b_ops(pp, v, m, rank, per_round, warmup, zero_bubble=False)


def _interleaved_zb(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """Interleaved zero bubble: the interleaved order with each backward split, a rank's weight
    passes deferred by `rank` steps (torch's ScheduleInterleavedZeroBubble)."""
    per_round = _rounds(pp, m)
    warmup = _warmup(rank, v, per_round, pp, m, 1)
    return _one_f_one_b_ops(pp, v, m, rank, per_round, warmup, zero_bubble=True)


def _one_f_one_b_ops(pp: int, v: int, m: int, rank: int, per_round: int, warmup: int,
                     zero_bubble: bool) -> list[Action]:
    """torch's _get_1f1b_rank_ops: warm-up forwards, then a forward and a backward per step, then
    the remaining backwards; chunks taken per round of micro-batches."""
    total = v * m
    backward_kind = "I" if zero_bubble else "B"
    forwards, backwards, weights_done = [0] * (pp * v), [0] * (pp * v), [0] * (pp * v)
    out: list[Action] = []
    backward_stages: list[int] = []
    weights = 0
    for step in range(total + warmup):  # warm-up, steady (total - warmup), cool-down (warmup)
        if step < total:
            stage = (step // per_round) % v * pp + rank
            out.append(("F", stage, forwards[stage]))
            forwards[stage] += 1
        if step >= warmup:
            stage = (v - 1 - (step - warmup) // per_round % v) * pp + rank
            out.append((backward_kind, stage, backwards[stage]))
            backwards[stage] += 1
            backward_stages.append(stage)
            if zero_bubble and step - warmup >= rank:
                stage = backward_stages[weights]
                out.append(("W", stage, weights_done[stage]))
                weights_done[stage] += 1
                weights += 1
    while zero_bubble and weights < len(backward_stages):
        stage = backward_stages[weights]
        out.append(("W", stage, weights_done[stage]))
        weights_done[stage] += 1
        weights += 1
    return out


def _zbv(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """torch's ScheduleZBVZeroBubble (Qi et al. 2023's ZB-V): stages rank and 2pp - 1 - rank,
    laid out for max(2pp - 1, m) micro-batches, the ones past m dropped."""
    n = max(2 * pp - 1, m)
    first, second = rank, 2 * pp - 1 - rank
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        out.append(("F", first, f0))
        f0 += 1
    for _ in range(rank):
        out += [("F", second, f1), ("F", first, f0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(pp - rank):
        out += [("F", second, f1), ("I", second, b1), ("W", second, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(("F", first, f0))
            f0 += 1
        out += [("I", first, b0), ("W", first, b0), ("F", second, f1), ("I", second, b1), ("W", second, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out += [("I", first, b0), ("I", second, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(pp - rank):
        out += [("I", first, b0), ("W", first, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [("W", second, j) for j in range(w1, b1)] + [("W", first, j) for j in range(w0, b0)]
    return [a for a in out if a[2] < m]


def _dualpipev(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """torch's ScheduleDualPipeV (DeepSeek-V3's DualPipe on a V): its eight steps, each overlapped
    forward-and-backward pair run as the forward, then the backward."""
    first, second = rank, 2 * pp - 1 - rank
    out: list[Action] = []
    count: dict[tuple[int, str], int] = {}
    weights: list[tuple[int, int]] = []

    def add(stage: int, kind: str) -> None:
        j = count.get((stage, "F" if kind == "F" else "I"), 0)
        out.append((kind, stage, j))
        count[(stage, "F" if kind == "F" else "I")] = j + 1
        if kind == "I":
            weights.append((stage, j))

    def weight() -> None:
        if weights:
            stage, j = weights.pop(0)
            out.append(("W", stage, j))

    for _ in range(2 * (pp - rank - 1)):
        add(first, "F")
    for _ in range(rank + 1):
        add(first, "F")
        add(second, "F")
    for _ in range(pp - rank - 1):
        add(second, "I")
        weight()
        add(second, "F")
    for _ in range(m - 2 * pp + rank + 1):
        add(first, "F")  # overlapped with the next backward, but for the last rank's first pair
        add(second, "B")
        add(second, "F")
        add(first, "B")
    for _ in range(pp - rank - 1):
        add(second, "B")
        add(second, "F")
        add(first, "B")
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add(second, "I" if split else "B")
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add(first, "I" if split else "B")
    for _ in range(pp - rank - 1):
        weight()
        add(first, "I" if split else "B")
    for _ in range(rank + 1):
        weight()
    return out


def held_at_first_backward(name: str, pp: int, v: int, m: int, rank: int) -> dict[int, int]:
    """Forwards each stage of the rank has run when its first backward (B or I) starts."""
    held: dict[int, int] = {}
    for kind, stage, _ in rank_order(name, pp, v, m, rank):
        if kind != "F":
            break
        held[stage] = held.get(stage, 0) + 1
    return held


def steady_from(name: str, pp: int, m: int) -> int | None:
    """A smaller micro-batch count whose step differs from m's only by steady-state work (the same
    warm-up and cool-down, so the same idle time and the same peak in flight), or None: 2 pp for
    m above 2 pp, where m keeps the schedule's rounds (a multiple of pp for the interleaved ones),
    unless every forward runs first (GPipe, looped-BFS: all m in flight). Held equal to the whole
    order by tests/test_plan_replay.py."""
    row = row_of(name)
    if m <= 2 * pp or row.all_forwards_first or (row.rounds_of_pp and m % pp):
        return None
    return 2 * pp


@functools.lru_cache(maxsize=4096)
def held_at_peak(name: str, pp: int, v: int, m: int, rank: int) -> dict[int, int]:
    """Micro-batches each stage of the rank holds at the moment it holds the most, each from its
    forward until the backward that frees it (B, or W under a split backward, which still reads
    the stage's inputs); the rank's stages are taken as equal here."""
    if steady_from(name, pp, m):
        return held_at_peak(name, pp, v, steady_from(name, pp, m), rank)
    split = row_of(name).split_backward
    held: dict[int, int] = {}
    total = best = 0
    peak: dict[int, int] = {}
    for kind, stage, _ in rank_order(name, pp, v, m, rank):
        if kind == "F":
            held[stage] = held.get(stage, 0) + 1
            total += 1
            if total > best:
                best, peak = total, dict(held)
        elif kind == "B" or (kind == "W" and split):
            held[stage] -= 1
            total -= 1
    return peak
