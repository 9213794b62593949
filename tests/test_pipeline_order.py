"""The pipeline orders the planner replays (gridtrain/layout/pipeline_order.py) are torch's own:
for every schedule torch runs with several stages per rank, at pp 2 and 4, v 1 and 2 where the
schedule takes them, and m in {1, 2, 3, pp, 2 pp}, each rank's compute actions in the order of the
schedule's `pipeline_order` (built here over stand-in stages: the order needs no model or
process group); torch's refusals are `refusal`'s. GPipe's and 1F1B's runtime is not an action
list in torch (their drawn orders are not what `_step_microbatches` runs): their orders are
checked against the runtime's loop by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from gridtrain.layout.pipeline_order import rank_order, refusal
from gridtrain.layout.schedules import SCHEDULES, stage_ranks

MULTI = [name for name, row in SCHEDULES.items() if row.runnable and row.stages_per_rank != 1]
CASES = [(name, pp, v, m) for name in MULTI for pp in (2, 4) for v in ((2,) if SCHEDULES[name].v_shape else (1, 2))
         for m in sorted({1, 2, 3, pp, 2 * pp})]


def torch_order(name: str, pp: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]] | str:
    """Each rank's compute actions in torch's schedule, or the error it refuses with."""
    cls = getattr(torch_schedules, SCHEDULES[name].torch_class)
    owners = stage_ranks(pp, v, name)
    stages = [SimpleNamespace(num_stages=pp * v, group_size=pp, group_rank=0, stage_index=s, is_first=s == 0,
                              is_last=s == pp * v - 1, submod=torch.nn.Linear(1, 1))
              for s, owner in enumerate(owners) if owner == 0]
    try:
        schedule = cls(stages, n_microbatches=m, loss_fn=lambda out, target: out)
    except ValueError as err:
        return str(err)
    orders: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in schedule.pipeline_order.items():
        flat = []
        for a in (a for a in actions if a is not None):
            for sub in a.sub_actions or (a,):
                kind = {"FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FORWARD": "F"}
                flat.append((kind[sub.computation_type.name], sub.stage_index, sub.microbatch_index))
        orders[rank] = flat
    return orders


@pytest.mark.parametrize("name,pp,v,m", CASES, ids=[f"{n}-pp{p}-v{v}-m{m}" for n, p, v, m in CASES])
def test_each_rank_runs_torchs_order(name, pp, v, m):
    expected = torch_order(name, pp, v, m)
    if isinstance(expected, str):
        assert refusal(name, pp, v, m), f"torch refuses: {expected}"
        return
    assert not refusal(name, pp, v, m)
    for rank in range(pp):
        assert list(rank_order(name, pp, v, m, rank)) == expected[rank], rank


def test_single_stage_orders_follow_the_runtime_loop():
    """1F1B (torch's _step_microbatches): rank r warms up with min(m, pp - r) forwards, then takes
    a backward and a forward in turn; GPipe: every forward, then every backward."""
    assert rank_order("1f1b", 4, 1, 6, 0) == (("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3), ("B", 0, 0),
                                               ("F", 0, 4), ("B", 0, 1), ("F", 0, 5), ("B", 0, 2), ("B", 0, 3),
                                               ("B", 0, 4), ("B", 0, 5))
    assert rank_order("1f1b", 4, 1, 6, 3) == tuple(a for j in range(6) for a in (("F", 3, j), ("B", 3, j)))
    assert rank_order("1f1b", 4, 1, 4, 1) == (("F", 1, 0), ("F", 1, 1), ("F", 1, 2), ("B", 1, 0), ("F", 1, 3),
                                               ("B", 1, 1), ("B", 1, 2), ("B", 1, 3))
    assert "at least as many micro-batches as stages (4)" in refusal("1f1b", 4, 1, 3)  # torch's Schedule1F1B
    assert rank_order("gpipe", 2, 1, 3, 1) == (("F", 1, 0), ("F", 1, 1), ("F", 1, 2), ("B", 1, 0), ("B", 1, 1),
                                                ("B", 1, 2))


def test_every_action_runs_once_on_its_stages_rank():
    for name, row in SCHEDULES.items():
        if not row.runnable:
            continue
        for pp, m in ((2, 4), (4, 8), (4, 12)):
            v = row.virtual(2)
            owners = stage_ranks(pp, v, name)
            seen = [a for r in range(pp) for a in rank_order(name, pp, v, m, r) if owners[a[1]] == r]
            assert len(seen) == sum(len(rank_order(name, pp, v, m, r)) for r in range(pp))
            kinds = {"F"} | ({"I", "W"} if row.split_backward else {"B"})
            for s in range(pp * v):
                for j in range(m):
                    done = {k for k, st, mb in seen if st == s and mb == j}
                    assert {"F"} <= done and ({"B"} <= done or {"I", "W"} <= done), (name, s, j, done, kinds)
