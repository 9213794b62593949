"""Every parallel layout against one process: per-step losses and final (gathered) weights.

One torchrun launch per world size (2, 4, 8) runs all of that size's layouts, fp32 and bf16, since
starting processes dominates the time (tests/dist/run_layouts.py). The reference is the
single-process Trainer on the same global batch, here in the test process.

Tolerances. fp32: losses within 1e-5 relative and weights within 1e-5, as the layouts only change
the order of floating-point sums. bf16: data- and pipeline-parallel layouts run the same bf16
matmuls on the same micro-batches as one process and stay as tight as fp32. Tensor parallelism
does not: a row-parallel matmul rounds each rank's partial sum to bf16 before the all-reduce,
where one process rounds once after the whole reduction, so activations differ by about bf16's
unit roundoff (2^-9). Losses still agree to 1e-4 relative. Weights mostly agree to fp32 precision,
but Adam divides each gradient by its own RMS, so where a gradient is near zero a rounding can flip
the sign of that element's update: such an element differs by at most 2 x lr per step. The bf16
weight check is therefore: every element within 2 x lr x steps, and the mean difference below
1e-4 (a wrong layout moves most elements, not a few).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gridtrain.config import load_config
from gridtrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
STEPS, LR = 4, 2e-3

LAYOUTS = {
    2: {
        "ddp2": {"parallel.zero_stage": 0},
        "zero1": {"parallel.zero_stage": 1},
        "zero2": {"parallel.zero_stage": 2},
        "tp2": {"parallel.tp": 2},
        "tp2_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
        "pp2_gpipe": {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"},
        "pp2_1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
        "pp2_interleaved": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                            "parallel.pp_virtual_stages": 2},
        "pp2_looped_bfs": {"parallel.pp": 2, "parallel.pp_schedule": "looped-bfs",
                           "parallel.pp_virtual_stages": 2},
        "pp2_interleaved_zb": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-zb",
                               "parallel.pp_virtual_stages": 2},
        "pp2_zbv": {"parallel.pp": 2, "parallel.pp_schedule": "zbv", "parallel.pp_virtual_stages": 2},
        "pp2_dualpipev": {"parallel.pp": 2, "parallel.pp_schedule": "dualpipev",
                          "parallel.pp_virtual_stages": 2},
        "fsdp2_accum4": {"train.micro_batch": 1},
    },

    4: {
        "fsdp4": {},
        "ddp4": {"parallel.zero_stage": 0},
        "hsdp2x2": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2},
        "tp4_gqa": {"parallel.tp": 4},
        "pp2_tp2": {"parallel.pp": 2, "parallel.tp": 2},
        "pp2_fsdp2": {"parallel.pp": 2, "parallel.dp_shard": 2},
    },
    8: {
        "pp2_tp2_fsdp2": {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 2},
    },
}
PRECISIONS = ("fp32", "bf16")

# Activation checkpointing and fp16 loss scaling under sharded, split and pipelined layouts:
# name -> (layout, precision). Recomputation does not change the numbers; fp16 is compared with
# one process in fp16 (same loss scale, so the same skipped steps).
EXTRA = {
    "fsdp2_ac_full": ({"train.activation_checkpointing": "full"}, "fp32"),
    "tp2_sp_ac_selective": ({"parallel.tp": 2, "parallel.sequence_parallel": True,
                             "train.activation_checkpointing": "selective"}, "fp32"),
    "pp2_ac_full": ({"parallel.pp": 2, "train.activation_checkpointing": "full"}, "fp32"),
    "fsdp2_fp16": ({}, "fp16"),
    "zero2_fp16": ({"parallel.zero_stage": 2}, "fp16"),
    "tp2_fp16": ({"parallel.tp": 2}, "fp16"),
    "pp2_fp16": ({"parallel.pp": 2}, "fp16"),
}


def base_overrides(tmp: Path, corpus: Path) -> dict[str, object]:
    """A GQA model (8 query heads, 4 KV heads) with 4 layers, so tp 4 and 4 pipeline stages fit."""
    return {
        "run_dir": str(tmp / "run"), "model.preset": "tiny", "model.n_layers": 4, "model.n_heads": 8,
        "model.n_kv_heads": 4, "model.ffn_dim": 128, "data.corpus": str(corpus),
        "data.cache_dir": str(tmp / "cache"), "data.seq_len": 32, "train.micro_batch": 2,
        "train.global_batch": 8, "train.steps": STEPS, "train.lr": LR, "train.warmup_steps": 1,
        "train.val_every": 0, "metrics.tensorboard": False, "metrics.progress": False,
        "metrics.account_every": 2,  # steps 1, 2 and 4: the last one is steady state
    }


def launch(world: int, spec: dict[str, dict[str, object]], out: Path) -> None:
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(ROOT / "tests" / "dist" / "run_layouts.py"), str(spec_path), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> dict[int, Path]:
    """Launch each world size once with all its layouts in both precisions."""
    outs = {}
    for world, layouts in LAYOUTS.items():
        out = tmp_path_factory.mktemp(f"world{world}")
        base = base_overrides(out, corpus_dir)
        spec = {f"{name}-{prec}": {**base, **layout, "train.precision": prec}
                for name, layout in layouts.items() for prec in PRECISIONS}
        if world == 2:
            spec.update({f"{name}-{prec}": {**base, **layout, "train.precision": prec}
                         for name, (layout, prec) in EXTRA.items()})
        launch(world, spec, out)
        outs[world] = out
    return outs


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> dict[tuple[str, int], dict]:
    """Single-process runs, one per precision and micro-batch size."""
    cache: dict[tuple[str, int], dict] = {}

    def get(precision: str, micro_batch: int) -> dict:
        key = (precision, micro_batch)
        if key not in cache:
            tmp = tmp_path_factory.mktemp("reference")
            cfg = load_config(None, {**base_overrides(tmp, corpus_dir), "train.precision": precision,
                                     "train.micro_batch": micro_batch})
            trainer = Trainer(cfg)
            losses = [trainer.train_step()["loss/train"] for _ in range(STEPS)]
            cache[key] = {"losses": losses,
                          "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}
        return cache[key]

    return get  # type: ignore[return-value]


def load_run(out: Path, case: str) -> dict:
    files = sorted(out.glob(f"{case}.pp*.pt"))
    assert files, f"{case} wrote no result"
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        part = torch.load(f, weights_only=True)
        weights.update(part["weights"])
    return {"losses": part["losses"], "weights": weights}


CASES = [(world, name, prec) for world, layouts in LAYOUTS.items() for name in layouts for prec in PRECISIONS]


@pytest.mark.parametrize("world,name,precision", CASES, ids=[f"{n}-{p}" for _, n, p in CASES])
def test_layout_matches_one_process(runs, references, world, name, precision):
    got = load_run(runs[world], f"{name}-{precision}")
    micro = LAYOUTS[world][name].get("train.micro_batch", 2)
    ref = references(precision, micro)
    uses_tp = "parallel.tp" in LAYOUTS[world][name]
    loss_rtol = 1e-4 if precision == "bf16" and uses_tp else 1e-5
    assert got["losses"] == pytest.approx(ref["losses"], rel=loss_rtol)
    assert set(got["weights"]) == set(ref["weights"])
    for key, want in ref["weights"].items():
        have = got["weights"][key]
        if precision == "bf16" and uses_tp:
            diff = (have - want).abs()
            assert diff.max() <= 2 * LR * STEPS, key
            assert diff.mean() < 1e-4, key
        else:
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", list(EXTRA))
def test_checkpointing_and_fp16_under_layouts(runs, references, name):
    layout, precision = EXTRA[name]
    got = load_run(runs[2], f"{name}-{precision}")
    ref = references(precision, 2)
    split = "parallel.tp" in layout
    tol = 1e-5 if not (split and precision == "fp16") else 1e-3
    assert got["losses"] == pytest.approx(ref["losses"], rel=tol)
    for key, want in ref["weights"].items():
        if split and precision == "fp16":  # as bf16 with TP: see the module docstring
            assert (got["weights"][key] - want).abs().max() <= 2 * LR * STEPS, key
        elif precision == "fp16":
            # One process divides each micro-batch's loss by the accumulation count before the
            # fp16 backward; FSDP and pipelines reduce or rescale after it. The factor is a power
            # of two, exact except for gradients that fall in fp16's subnormal range (below
            # 6e-5 / 65536 unscaled), which keep a few bits more or less: 1.4e-5 measured.
            torch.testing.assert_close(got["weights"][key], want, rtol=1e-5, atol=1e-4, msg=key)
        else:
            torch.testing.assert_close(got["weights"][key], want, rtol=1e-5, atol=1e-5, msg=key)


def test_layouts_really_differ_from_one_process_layout(runs):
    """Guard against a harness that silently ran one process: TP shards show in bf16 rounding."""
    tp = load_run(runs[2], "tp2-bf16")["losses"]
    pp = load_run(runs[2], "pp2_1f1b-bf16")["losses"]
    assert tp != pp


# ---------------------------------------------------------------------------------------------
# Accounting, read from each rank's last accounted step (step 4)


def accounting(out: Path, case: str) -> list[dict]:
    records = []
    for path in sorted((out / case / "accounting").glob("rank*.jsonl")):
        records.append(json.loads(path.read_text().splitlines()[-1]))
    assert records, f"{case} wrote no accounting"
    return records


def model_bytes(references) -> int:
    return sum(t.numel() * t.element_size() for t in references("fp32", 2)["weights"].values())


def test_zero3_holds_one_nth_of_parameters(runs, references):
    total = model_bytes(references)
    for rec in accounting(runs[4], "fsdp4-fp32"):
        assert rec["memory/params_bytes"] == total / 4
        assert rec["memory/grads_bytes"] == total / 4
        # AdamW: two moments of the parameter's size, plus one scalar step count per parameter.
        assert rec["memory/optimizer_bytes"] == pytest.approx(2 * total / 4, abs=4 * 64)


def test_ddp_all_reduces_each_gradient_byte_once_per_step(runs, references):
    total = model_bytes(references)
    for world, case in ((2, "ddp2-fp32"), (4, "ddp4-fp32")):
        for rec in accounting(runs[world], case):
            assert rec["memory/params_bytes"] == total
            assert rec["memory/grads_bytes"] == total
            assert rec["comm/dp_replicate/all_reduce_bytes"] == total
            # Ring all-reduce: each rank sends 2(N-1)/N of the buffer.
            assert rec["comm/dp_replicate/all_reduce_wire_bytes"] == pytest.approx(2 * (world - 1) / world * total)


def test_pipeline_sends_activations_between_stages(runs):
    """PP 2, 1F1B, 4 micro-batches of 2 x 32 tokens x dim 64 in fp32: each forward send is
    2*32*64*4 = 16,384 bytes; stage 0 sends 4 activations, stage 1 sends 4 gradients back."""
    for rec in accounting(runs[2], "pp2_1f1b-fp32"):
        assert rec["comm/pp/send_bytes"] == 4 * 2 * 32 * 64 * 4


CHECKED = [(2, "ddp2"), (2, "zero2"), (2, "tp2"), (2, "tp2_sp"), (2, "pp2_1f1b"), (2, "pp2_gpipe"), (2, "pp2_zbv"),
           (4, "fsdp4"), (4, "hsdp2x2"), (4, "tp4_gqa"), (4, "pp2_tp2"), (4, "pp2_fsdp2"), (8, "pp2_tp2_fsdp2")]


@pytest.mark.parametrize("world,name", CHECKED, ids=[n for _, n in CHECKED])
def test_plan_check_predicts_model_state_bytes(runs, world, name):
    """`gridtrain plan --check`: predicted parameter, gradient and optimizer bytes per rank equal
    the bytes each rank measured."""
    from gridtrain.plan.check import check_run

    rows = check_run(runs[world] / f"{name}-fp32")
    state = [r for r in rows if r.bucket in ("params", "grads", "optimizer")]
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


COMM_CHECKED = [(2, "ddp2"), (4, "ddp4"), (2, "zero2"), (2, "fsdp2_accum4"), (4, "fsdp4"), (2, "tp2"),
                (2, "tp2_sp"), (4, "hsdp2x2"), (2, "pp2_1f1b"), (2, "pp2_gpipe")]


@pytest.mark.parametrize("world,name", COMM_CHECKED, ids=[n for _, n in COMM_CHECKED])
def test_plan_check_predicts_bytes_per_collective(runs, world, name):
    """`gridtrain plan --check`: the predicted payload of every collective on every axis equals
    what the rank tracked, and nothing was tracked that the prediction leaves out."""
    from gridtrain.plan.check import check_run

    case = runs[world] / f"{name}-fp32"
    rows = [r for r in check_run(case) if "/" in r.bucket]
    assert rows, "no collective predicted"
    for row in rows:
        assert row.predicted == row.measured, (row.rank, row.bucket, row.predicted, row.measured)
    for path in (case / "accounting").glob("rank*.jsonl"):
        rec = json.loads(path.read_text().splitlines()[-1])
        tracked = {k[5:] for k in rec if k.startswith("comm/") and k.endswith("_bytes") and "wire" not in k}
        assert tracked == {r.bucket for r in rows if r.rank == rec["rank"]}


def test_plan_check_small_model_fsdp_tp_pp(tmp_path_factory, corpus_dir):
    """The issue's bar, literally: FSDP 2, TP 2 and PP 2 runs of the small model (the default
    preset, at a short sequence): `gridtrain plan --check` predicts parameter, gradient and
    optimizer bytes and every collective's bytes exactly, and activations within 3%."""
    from gridtrain.plan.check import check_run, check_step_time

    out = tmp_path_factory.mktemp("small")
    base = {"model.preset": "small", "data.corpus": str(corpus_dir), "data.cache_dir": str(out / "cache"),
            "data.seq_len": 64, "train.micro_batch": 2, "train.global_batch": 8, "train.steps": 4,
            "train.warmup_steps": 1, "train.val_every": 0, "metrics.tensorboard": False,
            "metrics.progress": False, "metrics.account_every": 4, "metrics.log_every": 1}
    spec = {"fsdp2": {**base}, "tp2": {**base, "parallel.tp": 2}, "pp2": {**base, "parallel.pp": 2}}
    launch(2, spec, out)
    for name in spec:
        rows = check_run(out / name)
        assert {r.bucket for r in rows} >= {"params", "grads", "optimizer", "activations"}
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
        assert step.predicted == pytest.approx(sum(parts.values()))
