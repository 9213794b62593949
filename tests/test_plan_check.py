"""`gridtrain plan` and `gridtrain plan --check` as one model of a rank, on runs of the small model
on 2 ranks: the plan of the run's layout (`plan --json`) and the check of the run predict the same
state bytes per bucket on every rank, those each rank measured; and the check predicts the
activations each rank saved, for every precision, recomputation mode and pipeline schedule."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from gridtrain.cli import main

pytestmark = pytest.mark.dist  # every test here starts several processes

STEADY = {"train.steps": 3}
"""DDP's first step also broadcasts the model and checks its shapes (its lazy start), its second
broadcasts the buckets it rebuilt: the step accounted is the third, as every later one."""
LAYOUTS = {  # run overrides, and the same layout for `gridtrain plan --layout`
    "ddp": ({"parallel.zero_stage": 0, **STEADY}, "tp=1,pp=1,dp=2,zero=0"),
    "zero1": ({"parallel.zero_stage": 1, **STEADY}, "tp=1,pp=1,dp=2,zero=1"),
    "zero2": ({"parallel.zero_stage": 2}, "tp=1,pp=1,dp=2,zero=2,dp_shard=2"),
    "fsdp": ({"parallel.zero_stage": 3}, "tp=1,pp=1,dp=2,zero=3,dp_shard=2"),
    "tp": ({"parallel.tp": 2}, "tp=2,pp=1,dp=1"),
    "tp_sp": ({"parallel.tp": 2, "parallel.sequence_parallel": True}, "tp=2,pp=1,dp=1"),
    "pp": ({"parallel.pp": 2}, "tp=1,pp=2,dp=1,schedule=1f1b,v=1"),
    "cp": ({"parallel.cp": 2}, "tp=1,pp=1,cp=2,dp=1,zero=3"),
}
SAME_RUN = {"fsdp": "acts-fsdp-{}-none", "tp": "acts-tp-{}-none", "tp_sp": "acts-tp_sp-{}-none",
            "pp": "acts-pp_1f1b-{}-none", "cp": "acts-cp-{}-none"}
"""Layouts whose state bytes are read from the activation run of the same layout (one run fewer)."""
PRECISIONS = ("fp32", "bf16")
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "looped-bfs": 2, "interleaved-zb": 2, "zbv": 2,
             "dualpipev": 2}
SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")  # refuse selective recomputation
ACTIVATION_LAYOUTS = {
    "fsdp": {"parallel.zero_stage": 3}, "tp": {"parallel.tp": 2},
    "tp_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "cp": {"parallel.cp": 2}, "cp_allgather": {"parallel.cp": 2, "parallel.cp_rotate": "allgather"},
    **{f"pp_{s}": {"parallel.pp": 2, "parallel.pp_schedule": s, "parallel.pp_virtual_stages": v}
       for s, v in SCHEDULES.items()},
}
FP32_RECOMPUTED = ("fsdp", "tp_sp")
"""Recomputation changes which tensors a rank saves and precision their dtype: every layout runs
each recomputation in bf16 (which saves bf16 copies beside fp32 masters) and none in fp32; these
two also recompute in fp32 (each pair of the three choices is covered, with 17 runs fewer)."""
ACTIVATION_CASES = [(name, prec, mode) for name in ACTIVATION_LAYOUTS for prec in PRECISIONS
                    for mode in ("none", "selective", "full")
                    if not (mode == "selective" and name[3:] in SPLIT_BACKWARD)
                    and (prec != "fp32" or mode == "none" or name in FP32_RECOMPUTED)]


def small_run(out: Path, corpus: Path) -> dict[str, object]:
    return {"model.preset": "small", "data.corpus": str(corpus), "data.cache_dir": str(out / "cache"),
            "data.seq_len": 64, "train.micro_batch": 2, "train.global_batch": 8, "train.steps": 2,
            "train.warmup_steps": 1, "train.val_every": 0, "metrics.tensorboard": False,
            "metrics.progress": False, "metrics.account_every": 1, "metrics.log_every": 1}


def launch_cases(work: Path, corpus: Path) -> dict[int, dict[str, dict[str, object]]]:
    """Every run, in the launch of 2 processes that the test modules share (tests/launches.py)."""
    base = small_run(work, corpus)
    spec = {f"{name}-{prec}": {**base, **overrides, "train.precision": prec}
            for name, (overrides, _) in LAYOUTS.items() for prec in PRECISIONS if name not in SAME_RUN}
    # One step but for pipelines: what a rank saves up to its first backward, and the state it
    # holds after its first step, are those of every later step; a pipeline's first step holds
    # more than its later ones (measured), so the check reads its second.
    spec.update({f"acts-{name}-{prec}-{mode}": {**base, **ACTIVATION_LAYOUTS[name], "train.precision": prec,
                                                "train.recompute": mode, "train.steps": 2 if name[:3] == "pp_" else 1}
                 for name, prec, mode in ACTIVATION_CASES})
    return {2: spec}


@pytest.fixture(scope="module")
def runs(launches) -> Path:  # noqa: ANN001 - tests/launches.py
    return launches.out(__name__, 2)


def plan_json(layout: str, precision: str) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["plan", "--model", "small", "--num-gpus", "2", "--seq-len", "64", "--global-batch", "8",
                     "--precision", precision, "--layout", f"{layout},mb=2", "--json"])
    assert code == 0
    return json.loads(buf.getvalue())


CASES = [(name, prec) for name in LAYOUTS for prec in PRECISIONS]


@pytest.mark.parametrize("name,precision", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_plan_and_check_predict_the_measured_state_bytes(runs, name, precision):
    from gridtrain.plan.check_run import check_run

    planned = {r["rank"]: r for r in plan_json(LAYOUTS[name][1], precision)["ranks"]}
    rows = check_run(runs / SAME_RUN.get(name, "{}-{{}}".format(name)).format(precision))
    assert len(planned) == 2
    for row in rows:
        if row.bucket not in ("weights", "gradients", "optimizer"):
            continue
        plan_bucket = row.bucket
        assert planned[row.rank][plan_bucket] == row.predicted == row.measured, (row.rank, row.bucket)
    # The runs differ where they should: ZeRO-1 gives the two ranks different optimizer shares.
    if name == "zero1":
        assert planned[0]["optimizer"] != planned[1]["optimizer"]


@pytest.mark.parametrize("name,precision,mode", ACTIVATION_CASES, ids=["-".join(c) for c in ACTIVATION_CASES])
def test_check_predicts_activations(runs, name, precision, mode):
    """What each rank saved up to its first backward (the issue's bar is 3%; the census is exact
    to 0.1%); no bucket left unpredicted."""
    import math

    from gridtrain.plan.check_run import check_run

    rows = check_run(runs / f"acts-{name}-{precision}-{mode}")
    assert all(not math.isnan(r.predicted) for r in rows)
    acts = [r for r in rows if r.bucket == "activations"]
    assert len(acts) == 2
    for row in acts:
        assert row.measured == pytest.approx(row.predicted, rel=1e-3), (row.rank, row.predicted, row.measured)


CP_CASES = [c for c in ACTIVATION_CASES if c[0].startswith("cp")]


@pytest.mark.parametrize("name,precision,mode", CP_CASES, ids=["-".join(c) for c in CP_CASES])
def test_check_predicts_cp_collectives_exactly(runs, name, precision, mode):
    """Under context parallelism the check's collectives are exact, byte for byte, on both ranks:
    the ring's sends (or the all-gathers and all-to-alls of keys, values and their gradients),
    which recomputation repeats, and FSDP's traffic over the same two ranks."""
    from gridtrain.plan.check_run import check_run

    rows = [r for r in check_run(runs / f"acts-{name}-{precision}-{mode}") if "/" in r.bucket]
    keys = {r.bucket for r in rows}
    assert ({"cp/send_bytes"} if name == "cp" else {"cp/all_gather_bytes", "cp/all_to_all_bytes"}) <= keys
    for row in rows:
        assert not row.estimated and row.measured == row.predicted, (row.rank, row.bucket, row.predicted,
                                                                      row.measured)
