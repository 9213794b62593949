"""Goodput under failures, hand-derived: restarting the whole job from its checkpoint (Daly 2006)
against fault-tolerant replica groups that keep stepping while one recovers (torchft)."""

from __future__ import annotations

import math

import pytest

from gridtrain.plan.reliability import daly_interval, goodput_restarting, goodput_with_replicas


def test_restarting_goodput_is_solve_over_dalys_wall_time():
    # tau = 240 s, C = 3 s, M = 3 h = 10,800 s, R = 15 s:
    # wall per 240 s of work = 10,800 e^(15/10,800) (e^(243/10,800) - 1) = 246.10 s
    wall = 10_800 * math.exp(15 / 10_800) * (math.exp(243 / 10_800) - 1)
    assert wall == pytest.approx(246.10, abs=0.01)
    assert goodput_restarting(240, 3, 10_800, 15) == pytest.approx(240 / wall) == pytest.approx(0.9752, abs=1e-4)
    # no failures to speak of: only the checkpoints cost, tau / (tau + C)
    assert goodput_restarting(240, 3, 1e12, 15) == pytest.approx(240 / 243, rel=1e-6)


def test_replicas_lose_a_step_and_a_share_of_the_recovery_per_failure():
    # step 9 s + recovery 20 s / 8 groups = 11.5 s per failure, one failure per 10,800 s
    assert goodput_with_replicas(240, 3, 10_800, 9, 20, 8) == pytest.approx((1 - 11.5 / 10_800) * 240 / 243)
    # one replica group: the whole job waits for its recovery
    assert goodput_with_replicas(240, 3, 10_800, 9, 20, 1) == pytest.approx((1 - 29 / 10_800) * 240 / 243)


def test_llama3_405b_interruptions_favour_replicas():
    """466 interruptions in 54 days (Llama 3, sec. 3.3.4): M = 54 x 86,400 / 466 = 10,012 s. A
    2.8 s save at Daly's interval; a job restart of 12 s + 2.8 s against a replica group's 12 s +
    a 9.1 s step: replicas keep more of the run, since a restart redoes half an interval."""
    mtbf = 54 * 86_400 / 466
    assert mtbf == pytest.approx(10_012, abs=1)
    tau = daly_interval(2.8, mtbf)
    assert goodput_with_replicas(tau, 2.8, mtbf, 9.1, 12.1, 8) > goodput_restarting(tau, 2.8, mtbf, 14.8) + 0.01
