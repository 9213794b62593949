"""Named layouts beyond the parity matrix's degree 2 (DDP 4, FSDP 4, TP 4 with GQA; CP 2 alone,
beside FSDP 2 and beside TP 2), and what their runs measured: memory per bucket and bytes per
collective, against `gridtrain plan --check`.

One torchrun launch per world size (2, 4, 8), shared with other modules (tests/launches.py), runs
all of that size's layouts in fp32, plus FSDP 2 in bf16 (its parameters are gathered in bf16).
Each is first compared with one process by the parity check (gridtrain/parity/compare.py: losses,
gradient norms with clipping active, gathered weights); the matrix of every layout, precision and
recomputation mode is tests/test_parity.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridtrain.parity.compare import deviation, problems, tolerance
from gridtrain.parity.matrix import GLOBAL_BATCH, base_overrides as parity_base
from gridtrain.parity.run import launch as launch_runs
from gridtrain.parity.run import load_result
from gridtrain.parity.sweep import References

pytestmark = pytest.mark.dist  # every test here starts several processes

STEPS = 4

LAYOUTS = {
    2: {
        "ddp2": {"parallel.zero_stage": 0},
        "zero1": {"parallel.zero_stage": 1},
        "zero2": {"parallel.zero_stage": 2},
        "tp2": {"parallel.tp": 2},
        "tp2_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
        "tp2_tied": {"parallel.tp": 2, "model.tie_embeddings": True},
        "pp2_gpipe": {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"},
        "pp2_1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
        "pp2_zbv": {"parallel.pp": 2, "parallel.pp_schedule": "zbv", "parallel.pp_virtual_stages": 2},
        "fsdp2_accum4": {"train.micro_batch": 1},
        "fsdp2_bf16": {"train.precision": "bf16"},
        "cp2": {"parallel.cp": 2},
    },
    4: {
        "fsdp4": {},
        "ddp4": {"parallel.zero_stage": 0},
        "hsdp2x2": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2},
        "tp4_gqa": {"parallel.tp": 4},
        "pp2_tp2": {"parallel.pp": 2, "parallel.tp": 2},
        "pp2_fsdp2": {"parallel.pp": 2, "parallel.dp_shard": 2},
        "pp2_fsdp2_zbv": {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.pp_schedule": "zbv",
                          "parallel.pp_virtual_stages": 2, "train.micro_batch": 1},
        "cp2_fsdp2": {"parallel.cp": 2, "parallel.dp_shard": 2},
        "cp2_tp2": {"parallel.cp": 2, "parallel.tp": 2},  # FSDP over a group of its own: dp_shard_cp
    },
    8: {
        "pp2_tp2_fsdp2": {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 2},
    },
}


def base_overrides(tmp: Path, corpus: Path) -> dict[str, object]:
    """The parity matrix's run (4 layers, 8 query and 4 KV heads, so tp 4 and 4 pipeline stages
    fit; clipping active), over 4 steps with the accounting on steps 1, 2 and 4 (the last one is
    steady state)."""
    return {**parity_base(), "run_dir": str(tmp / "run"), "data.corpus": str(corpus),
            "data.cache_dir": str(tmp / "cache"), "train.micro_batch": 2, "train.steps": STEPS,
            "train.precision": "fp32", "model.tie_embeddings": False, "parallel.dp_shard": -1,
            "metrics.account_every": 2}


def launch(world: int, spec: dict[str, dict[str, object]], out: Path) -> None:
    proc = launch_runs(world, spec, out, timeout_s=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def launch_cases(work: Path, corpus: Path) -> dict[int, dict[str, dict[str, object]]]:
    """Every layout, in the launch of its world size that the test modules share (tests/launches.py)."""
    base = base_overrides(work, corpus)
    return {world: {name: {**base, **layout} for name, layout in layouts.items()} for world, layouts in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(launches) -> dict[int, Path]:  # noqa: ANN001 - tests/launches.py
    return {world: launches.out(__name__, world) for world in LAYOUTS}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> References:
    work = tmp_path_factory.mktemp("reference")
    return References(corpus_dir, work / "cache", work)


CASES = [(world, name) for world, layouts in LAYOUTS.items() for name in layouts]


@pytest.mark.parametrize("world,name", CASES, ids=[n for _, n in CASES])
def test_layout_matches_one_process(runs, references, tmp_path, corpus_dir, world, name):
    overrides = {**base_overrides(tmp_path, corpus_dir), **LAYOUTS[world][name]}
    ref = references.get(overrides)
    tol = tolerance(str(overrides["train.precision"]), GLOBAL_BATCH * 32, ref.lrs, 0.9, 0.95)
    found = problems(deviation(load_result(runs[world], name), ref), tol)
    assert not found, found


# ---------------------------------------------------------------------------------------------
# Accounting, read from each rank's last accounted step (step 4)


def accounting(out: Path, case: str) -> list[dict]:
    records = []
    for path in sorted((out / case / "accounting").glob("rank*.jsonl")):
        records.append(json.loads(path.read_text().splitlines()[-1]))
    assert records, f"{case} wrote no accounting"
    return records


def model_bytes(runs) -> int:
    return sum(t.numel() * t.element_size() for t in load_result(runs[2], "ddp2").weights.values())


def test_zero3_holds_one_nth_of_parameters(runs):
    total = model_bytes(runs)
    for rec in accounting(runs[4], "fsdp4"):
        assert rec["memory/weights_bytes"] == total / 4
        assert rec["memory/gradients_bytes"] == total / 4
        # AdamW: two moments of the parameter's size, plus one scalar step count per parameter.
        assert rec["memory/optimizer_bytes"] == pytest.approx(2 * total / 4, abs=4 * 64)


def test_ddp_all_reduces_each_gradient_byte_once_per_step(runs):
    total = model_bytes(runs)
    for world, case in ((2, "ddp2"), (4, "ddp4")):
        for rec in accounting(runs[world], case):
            assert rec["memory/weights_bytes"] == total
            assert rec["memory/gradients_bytes"] == total
            assert rec["comm/dp_replicate/all_reduce_bytes"] == total


def test_pipeline_sends_activations_between_stages(runs):
    """PP 2, 1F1B, 4 micro-batches of 2 x 32 tokens x dim 64 in fp32: each forward send is
    2*32*64*4 = 16,384 bytes; stage 0 sends 4 activations, stage 1 sends 4 gradients back."""
    for rec in accounting(runs[2], "pp2_1f1b"):
        assert rec["comm/pp/send_bytes"] == 4 * 2 * 32 * 64 * 4


def test_fsdp_gathers_parameters_in_bf16_and_reduces_in_fp32(runs):
    """bf16 under FSDP 2 (ZeRO-3): per micro-batch each unit is gathered in forward and again in
    backward, except the last block and the head (final norm and output), which stay gathered
    between the two, and the embedding, whose backward needs no weights; 2 bytes an element.
    Gradients are reduced in fp32 (gloo all-reduces where NCCL would reduce-scatter), plus one
    fp32 scalar per parameter tensor for the gradient norm. 2 micro-batches per rank."""
    weights = load_result(runs[2], "fsdp2_bf16").weights
    numel = sum(t.numel() for t in weights.values())
    once = sum(t.numel() for k, t in weights.items() if k.startswith(("layers.3.", "norm.", "output.", "tok_embeddings.")))
    for rec in accounting(runs[2], "fsdp2_bf16"):
        assert rec["comm/dp_shard/all_gather_bytes"] == 2 * 2 * (2 * numel - once)
        assert rec["comm/dp_shard/all_reduce_bytes"] == 2 * 4 * numel + 4 * len(weights)
        fp32 = accounting(runs[2], "zero2")[rec["rank"]]  # ZeRO-2 gathers once: fp32 bytes per element
        assert fp32["comm/dp_shard/all_gather_bytes"] == 2 * 4 * numel


CHECKED = [(2, "ddp2"), (2, "zero2"), (2, "tp2"), (2, "tp2_sp"), (2, "tp2_tied"), (2, "pp2_1f1b"), (2, "pp2_gpipe"), (2, "pp2_zbv"),
           (4, "fsdp4"), (4, "hsdp2x2"), (4, "tp4_gqa"), (4, "pp2_tp2"), (4, "pp2_fsdp2"), (8, "pp2_tp2_fsdp2")]


@pytest.mark.parametrize("world,name", CHECKED, ids=[n for _, n in CHECKED])
def test_plan_check_predicts_model_state_bytes(runs, world, name):
    """`gridtrain plan --check`: predicted parameter, gradient and optimizer bytes per rank equal
    the bytes each rank measured."""
    from gridtrain.plan.check_run import check_run

    rows = check_run(runs[world] / name)
    state = [r for r in rows if r.bucket in ("weights", "gradients", "optimizer")]
    assert len(state) == 3 * world
    for row in state:
        assert row.predicted == row.measured, (row.rank, row.bucket, row.predicted, row.measured)
    # Activations: within 3% (the bar) without a pipeline, and on the last stage of a
    # pipeline that FSDP does not shard. Left open (see the issue note): earlier 1F1B stages hold
    # one micro-batch more at the forward-to-backward turn than the p - i the census assumes, and
    # under PP x FSDP the storage FSDP frees after a block can be reused by an activation.
    layout = LAYOUTS[world][name]
    pp = layout.get("parallel.pp", 1)
    for row in rows:
        if row.bucket != "activations" or row.predicted != row.predicted:
            continue
        if pp == 1 or (row.rank // (world // pp) == pp - 1 and "parallel.dp_shard" not in layout):
            assert row.measured == pytest.approx(row.predicted, rel=0.03), (row.rank, row.predicted, row.measured)


COMM_CHECKED = [(2, "ddp2"), (4, "ddp4"), (2, "zero1"), (2, "zero2"), (2, "fsdp2_accum4"), (2, "fsdp2_bf16"), (4, "fsdp4"),
                (2, "tp2"), (2, "tp2_sp"), (4, "hsdp2x2"), (2, "pp2_1f1b"), (2, "pp2_gpipe")]


@pytest.mark.parametrize("world,name", COMM_CHECKED, ids=[n for _, n in COMM_CHECKED])
def test_plan_check_predicts_bytes_per_collective(runs, world, name):
    """`gridtrain plan --check`: the predicted payload of every collective on every axis equals
    what the rank tracked, and nothing was tracked that the prediction leaves out."""
    from gridtrain.plan.check_run import check_run

    case = runs[world] / name
    rows = [r for r in check_run(case) if "/" in r.bucket]
    assert rows, "no collective predicted"
    for row in rows:
        assert row.predicted == row.measured, (row.rank, row.bucket, row.predicted, row.measured)
    for path in (case / "accounting").glob("rank*.jsonl"):
        rec = json.loads(path.read_text().splitlines()[-1])
        tracked = {k[5:] for k in rec if k.startswith("comm/") and k.endswith("_bytes") and "wire" not in k}
        assert tracked == {r.bucket for r in rows if r.rank == rec["rank"]}


ALL_RUNS = [(world, name) for world, layouts in LAYOUTS.items() for name in layouts]


@pytest.mark.parametrize("world,name", ALL_RUNS, ids=[n for _, n in ALL_RUNS])
def test_plan_check_predicts_every_collective_of_every_layout(runs, world, name):
    """No layout is left unpredicted: plan --check's table shows every collective a rank made
    (its measured bytes add up to the rank's accounted payload bytes of the step, the optimizer's
    broadcast included), each has a prediction (exact, or estimated axis by axis for the layouts
    that combine axes: within 15% here, measured 0-12.5%), and the step time is a number."""
    import math

    from gridtrain.plan.check_run import check_run, check_step_time

    case = runs[world] / name
    rows = check_run(case)
    assert not [r.bucket for r in rows if r.missing], "collectives the planner does not predict"
    assert all(not math.isnan(r.predicted) for r in rows)
    for path in (case / "accounting").glob("rank*.jsonl"):
        rec = json.loads(path.read_text().splitlines()[-1])
        accounted = sum(v for k, v in rec.items() if k.startswith("comm/") and k.endswith("_bytes")
                        and not k.endswith("_wire_bytes"))
        shown = sum(r.measured for r in rows if r.rank == rec["rank"] and "/" in r.bucket)
        assert shown == accounted, (rec["rank"], shown, accounted)
    for row in rows:
        if row.estimated:
            assert row.measured == pytest.approx(row.predicted, rel=0.15), (row.rank, row.bucket)
    step, parts = check_step_time(case)
    assert all(math.isfinite(v) for v in (step.predicted, *parts.values()))


def test_plan_check_is_exact_for_zero3_beside_a_zero_bubble_schedule(runs):
    """PP 2 x FSDP 2 under ZB-V, 4 micro-batches: every rank's activations, pipeline sends and
    FSDP collectives as predicted, to the byte. The stage's gathers serve both backward passes,
    but the embedding's unit is gathered again by each micro-batch's forward (it was predicted
    once: the first rank's all-gathers measured 1.53x the prediction)."""
    from gridtrain.plan.check_run import check_run

    rows = check_run(runs[4] / "pp2_fsdp2_zbv")
    assert {r.bucket for r in rows} >= {"activations", "pp/send_bytes", "dp_shard/all_gather_bytes",
                                        "dp_shard/all_reduce_bytes"}
    for row in rows:
        assert row.measured == row.predicted, (row.rank, row.bucket, row.predicted, row.measured)


def test_plan_check_shows_a_collective_it_does_not_predict(runs, tmp_path):
    """A collective a rank made that the planner has no prediction for is a row of its own,
    marked missing, not left out of the table (ZeRO-1's broadcast once was)."""
    import shutil

    from gridtrain.plan.check_run import check_run, format_check

    case = tmp_path / "zero1"
    shutil.copytree(runs[2] / "zero1", case)
    path = case / "accounting" / "rank1.jsonl"
    rec = json.loads(path.read_text().splitlines()[-1])
    assert rec["comm/dp_replicate/broadcast_bytes"] > 0  # the optimizer's collectives are accounted
    path.write_text(json.dumps({**rec, "comm/dp_replicate/all_to_all_bytes": 4096.0}) + "\n")
    rows = check_run(case)
    missing = [r for r in rows if r.missing]
    assert [(r.rank, r.bucket, r.measured) for r in missing] == [(1, "dp_replicate/all_to_all_bytes", 4096.0)]
    line = next(line for line in format_check(rows).splitlines() if "all_to_all" in line)
    assert "missing" in line and "4,096" in line


def test_plan_check_small_model_fsdp_tp_pp(tmp_path_factory, corpus_dir):
    """The issue's bar, literally: FSDP 2, TP 2 and PP 2 runs of the small model (the default
    preset, at a short sequence): `gridtrain plan --check` predicts parameter, gradient and
    optimizer bytes and every collective's bytes exactly, and activations within 3%."""
    from gridtrain.plan.check_run import check_run, check_step_time

    out = tmp_path_factory.mktemp("small")
    base = {"model.preset": "small", "data.corpus": str(corpus_dir), "data.cache_dir": str(out / "cache"),
            "data.seq_len": 64, "train.micro_batch": 2, "train.global_batch": 8, "train.steps": 4,
            "train.warmup_steps": 1, "train.val_every": 0, "metrics.tensorboard": False,
            "metrics.progress": False, "metrics.account_every": 4, "metrics.log_every": 1}
    spec = {"fsdp2": {**base}, "tp2": {**base, "parallel.tp": 2}, "pp2": {**base, "parallel.pp": 2}}
    launch(2, spec, out)
    for name in spec:
        rows = check_run(out / name)
        assert {r.bucket for r in rows} >= {"weights", "gradients", "optimizer", "activations"}
        for row in rows:
            if row.bucket == "activations":
                assert row.measured == pytest.approx(row.predicted, rel=0.03), (name, row)
            else:
                assert row.predicted == row.measured, (name, row)
        # Step time on this machine: predicted from the (fake) calibration, measured as the median
        # of the steps that neither warmed up nor ran the accounting (steps 2 and 3).
        step, parts = check_step_time(out / name)
        plain = [json.loads(line)["time/step_s"] for line in (out / name / "metrics.jsonl").read_text().splitlines()][1:3]
        assert step.measured == pytest.approx(sum(plain) / 2)
        assert 0 < parts["compute_s"] and 0 < parts["comm_s"] < step.predicted


DRY_RUNS = ALL_RUNS  # DDP and ZeRO-1 too: their dry run sums the gradients as DDP's buckets would

def per_axis(record: dict[str, float], gloo: bool, tp: int) -> dict[str, float]:
    """Payload bytes per axis and kind, the gloo run's made comparable with the dry run's: gloo
    has no reduce-scatter (it all-reduces the same tensor: both are 'reduce' here), and its flight
    recorder logs a DTensor all-gather by its input, 1/tp of what it gathers."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key.startswith("comm/") and key.endswith("_bytes") and "wire" not in key:
            _, axis, kind = key.split("/")
            if gloo and axis == "tp" and kind == "all_gather_bytes":
                value *= tp
            kind = "reduce" if kind in ("all_reduce_bytes", "reduce_scatter_bytes") else kind
            out[f"{axis}/{kind}"] = out.get(f"{axis}/{kind}", 0.0) + value
    return out


def dry_run_record(overrides: dict[str, object], world: int, rank: int) -> dict[str, float]:
    """`gridtrain train --dry-run` of one rank, as a user runs it but in this process (a process
    of its own cost 5-10 s a rank to start)."""
    import contextlib
    import io

    from gridtrain.cli import main

    args = [f"--{key}={value}" for key, value in overrides.items()]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", "--dry-run", "--world", str(world), "--rank", str(rank), *args])
    assert code == 0, out.getvalue()[-3000:]
    assert f"dry run of rank {rank} of {world}" in out.getvalue()
    path = Path(str(overrides["run_dir"])) / "accounting" / f"rank{rank}.jsonl"
    return json.loads(path.read_text().splitlines()[-1])


@pytest.mark.parametrize("world,name", DRY_RUNS, ids=[n for _, n in DRY_RUNS])
def test_dry_run_measures_what_the_run_measured(runs, world, name, tmp_path, corpus_dir):
    """A dry run of the first and the last rank (fake process group, fake tensors, one step; no
    other rank) measures what that rank measured in the real run (its steady-state step): the
    parameter, gradient and optimizer bytes to the byte, the activations to the byte but where
    the real run undercounts (below), and per mesh axis the same bytes gathered, reduced and sent.

    The real run's accounting tells saved activations apart by storage address; under a pipeline
    the allocator can hand an address FSDP or the pipeline just freed to a later activation,
    which is then not counted (PP 2 x TP 2's first rank: one 16 KB activation of 745 KB). Fake
    storages are told apart by identity, so the dry run counts it (and agrees with the plan)."""
    overrides = {**base_overrides(tmp_path, corpus_dir), **LAYOUTS[world][name], "run_dir": str(tmp_path / "dry")}
    tp = LAYOUTS[world][name].get("parallel.tp", 1)
    for rank in (0, world - 1):
        path = runs[world] / name / "accounting" / f"rank{rank}.jsonl"
        real = json.loads(path.read_text().splitlines()[-1])
        dry = dry_run_record(overrides, world, rank)
        for bucket in ("weights", "gradients", "optimizer"):
            key = f"memory/{bucket}_bytes"
            assert dry[key] == real[key], (rank, key, dry[key], real[key])
        acts = dry["memory/activations_bytes"], real["memory/activations_bytes"]
        assert acts[0] == acts[1] or ("parallel.pp" in LAYOUTS[world][name] and acts[1] < acts[0] <= 1.03 * acts[1]), acts
        assert per_axis(dry, False, tp) == per_axis(real, True, tp), rank
