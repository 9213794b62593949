"""The planner's pipeline bubble: torch's action order replayed with the measured action costs
(gridtrain/plan/replay.py), checked where it can be derived by hand: one micro-batch runs
serially whatever the schedule, the closed forms where they hold, and the shortcut that keeps a
search fast (from 2 pp micro-batches on, only work is added)."""

from __future__ import annotations

import pytest

from gridtrain.layout.pipeline_order import refusal
from gridtrain.layout.schedules import BACKWARD, SCHEDULES, in_flight
from gridtrain.plan.pipeline import bubble_fraction, schedule_bubble
from gridtrain.plan.replay import replay, step_bubble

RUN = [name for name, row in SCHEDULES.items() if row.runnable]


@pytest.mark.parametrize("name", [n for n in RUN if not refusal(n, 2, 8, 1)])
def test_one_micro_batch_through_a_pipeline_runs_serially(name):
    """With one micro-batch every stage waits for the one before it (and in backward, after it):
    at any moment one rank computes, so each of pp ranks idles (pp - 1)/pp of the step, whatever
    the interleaving. The planner once costed the 405B's interleaved pp 2, v 8, m 1 at the closed
    form's 1/(v m + 1) = 11%. A split backward runs a stage's weight pass beside the previous
    stage's input pass: less, but not the closed form's either."""
    for pp in (2, 4):
        v = SCHEDULES[name].virtual(8)
        if refusal(name, pp, v, 1):
            continue
        serial = (pp - 1) / pp
        if SCHEDULES[name].split_backward:
            assert bubble_fraction(pp, 1, v) < schedule_bubble(name, pp, 1, v) < serial
        else:
            assert schedule_bubble(name, pp, 1, v) == pytest.approx(serial)


def test_the_closed_forms_hold_where_they_were_derived():
    """GPipe and 1F1B: (p-1)/(m + p-1) for every m torch takes; interleaved 1F1B and
    looped-BFS: (p-1)/(v m + p-1) for m a multiple of p (Narayanan et al. 2021, eq. 1 and sec.
    2.2; their fused backward costing 1.95 forwards changes nothing: the bubble is whole
    micro-batch steps)."""
    for pp in (2, 4, 8):
        for m in (pp, 2 * pp, 3 * pp, 8 * pp):
            for name in ("gpipe", "1f1b"):
                assert schedule_bubble(name, pp, m) == pytest.approx(bubble_fraction(pp, m)), (name, pp, m)
            for name in ("interleaved-1f1b", "looped-bfs"):
                for v in (2, 4):
                    assert schedule_bubble(name, pp, m, v) == pytest.approx(bubble_fraction(pp, m, v)), (name, pp, m, v)
        assert schedule_bubble("gpipe", pp, 3) == pytest.approx(bubble_fraction(pp, 3))  # m < p too


def test_a_hand_laid_two_rank_1f1b_step():
    """1F1B over 2 ranks, 2 micro-batches, F = 1 and B = 1.95 per rank's layers: rank 0 runs F0
    [0, 1], F1 [1, 2]; rank 1 F0 [1, 2], B0 [2, 3.95], F1 [3.95, 4.95], B1 [4.95, 6.9]; rank 0
    B0 [3.95, 5.9], B1 [6.9, 8.85]. Span 8.85, each rank busy 5.9: idle 1 - 5.9/8.85 = 1/3."""
    r = replay("1f1b", 2, 1, 2)
    assert r.span == pytest.approx(3 + 3 * BACKWARD)
    assert r.busy == pytest.approx((2 + 2 * BACKWARD,) * 2)
    ends = {(rank, kind, mb): end for rank, kind, _, mb, _, end in r.actions}
    assert ends[(0, "B", 1)] == pytest.approx(3 + 3 * BACKWARD)
    assert r.bubble == pytest.approx(1 / 3)
    assert ends[(1, "F", 1)] == pytest.approx(3 + BACKWARD)


@pytest.mark.parametrize("name", RUN)
def test_past_two_pp_micro_batches_the_peak_in_flight_stays(name):
    """held_at_peak counts on 2 pp micro-batches where only steady-state work is added
    (steady_from): equal to counting on the whole order."""
    from gridtrain.layout.pipeline_order import held_at_peak, steady_from

    for pp in (2, 4, 8):
        v = SCHEDULES[name].virtual(2)
        for m in (2 * pp + 1, 3 * pp - 1, 3 * pp + 1, 4 * pp, 5 * pp, 9 * pp + 2):
            if refusal(name, pp, v, m) or steady_from(name, pp, m) is None:
                continue
            for rank in range(pp):
                held_at_peak.cache_clear()
                shortcut = held_at_peak(name, pp, v, m, rank)
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr("gridtrain.layout.pipeline_order.steady_from", lambda *a: None)
                    held_at_peak.cache_clear()
                    assert held_at_peak(name, pp, v, m, rank) == shortcut, (pp, m, rank)
    held_at_peak.cache_clear()


@pytest.mark.parametrize("name", RUN)
def test_past_two_pp_micro_batches_only_work_is_added(name):
    """step_bubble takes the closed form where it holds, else replays 2 pp micro-batches and counts
    the work on the order: equal to replaying all m, every m torch takes."""
    for pp in (2, 4):
        v = SCHEDULES[name].virtual(2)
        for m in (1, 2, 3, pp, 2 * pp + 1, 3 * pp, 5 * pp, 9 * pp + 2):
            if not refusal(name, pp, v, m):
                assert step_bubble(name, pp, v, m) == pytest.approx(replay(name, pp, v, m).bubble, rel=1e-12), m


def test_in_flight_is_counted_on_the_order_and_agrees_with_the_closed_forms():
    """At its peak 1F1B's rank r holds p - r micro-batches (Narayanan et al. 2021), interleaved
    1F1B's first rank p (1 + (p-1)/(p v)) (Korthikanti et al. 2022), GPipe all m; DualPipeV's
    ranks hold p + 1/2 (each rank's later stage one micro-batch more than ZB-V's p)."""
    for pp in (2, 4, 8):
        m = 4 * pp
        assert [in_flight("1f1b", pp, r, m) for r in range(pp)] == [pp - r for r in range(pp)]
        assert in_flight("gpipe", pp, pp - 1, m) == m
        assert in_flight("interleaved-1f1b", pp, 0, m, 4) == pytest.approx(pp * (1 + (pp - 1) / (pp * 4)))
        assert in_flight("zbv", pp, 0, m, 2) == pp
        assert in_flight("dualpipev", pp, pp - 1, m, 2) == pytest.approx(pp + 0.5)
