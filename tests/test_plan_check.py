"""`gridtrain plan` and `gridtrain plan --check` as one model of a rank: for runs of the small
model on 2 ranks, the plan of the run's layout (`plan --json`) and the check of the run predict
the same bytes per memory bucket on every rank, and those are the bytes each rank measured."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from gridtrain.cli import main
from gridtrain.parity.run import launch

LAYOUTS = {  # run overrides, and the same layout for `gridtrain plan --layout`
    "ddp": ({"parallel.zero_stage": 0}, "tp=1,pp=1,dp=2,zero=0"),
    "zero1": ({"parallel.zero_stage": 1}, "tp=1,pp=1,dp=2,zero=1"),
    "zero2": ({"parallel.zero_stage": 2}, "tp=1,pp=1,dp=2,zero=2,dp_shard=2"),
    "fsdp": ({"parallel.zero_stage": 3}, "tp=1,pp=1,dp=2,zero=3,dp_shard=2"),
    "tp": ({"parallel.tp": 2}, "tp=2,pp=1,dp=1"),
    "tp_sp": ({"parallel.tp": 2, "parallel.sequence_parallel": True}, "tp=2,pp=1,dp=1"),
    "pp": ({"parallel.pp": 2}, "tp=1,pp=2,dp=1,schedule=1f1b,v=1"),
}
PRECISIONS = ("fp32", "bf16")


def small_run(out: Path, corpus: Path) -> dict[str, object]:
    return {"model.preset": "small", "data.corpus": str(corpus), "data.cache_dir": str(out / "cache"),
            "data.seq_len": 64, "train.micro_batch": 2, "train.global_batch": 8, "train.steps": 2,
            "train.warmup_steps": 1, "train.val_every": 0, "metrics.tensorboard": False,
            "metrics.progress": False, "metrics.account_every": 1, "metrics.log_every": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("plan-check")
    base = small_run(out, corpus_dir)
    spec = {f"{name}-{prec}": {**base, **overrides, "train.precision": prec}
            for name, (overrides, _) in LAYOUTS.items() for prec in PRECISIONS}
    proc = launch(2, spec, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


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
    from gridtrain.plan.check import check_run

    planned = {r["rank"]: r for r in plan_json(LAYOUTS[name][1], precision)["ranks"]}
    rows = check_run(runs / f"{name}-{precision}")
    assert len(planned) == 2
    for row in rows:
        if row.bucket not in ("params", "grads", "optimizer"):
            continue
        plan_bucket = {"params": "weights", "grads": "gradients", "optimizer": "optimizer"}[row.bucket]
        assert planned[row.rank][plan_bucket] == row.predicted == row.measured, (row.rank, row.bucket)
    # The runs differ where they should: ZeRO-1 gives the two ranks different optimizer shares.
    if name == "zero1":
        assert planned[0]["optimizer"] != planned[1]["optimizer"]
