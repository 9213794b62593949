"""Context parallelism against one process: the parity module's run (the widened tiny model, 3
steps of 2 accumulated micro-batches of 4 sequences, clipping active, fp32) under cp 2 with either
rotation, with grouped-query and multi-head attention, tied embeddings, in bf16 and with full
recomputation, under cp 4, and under cp 2 beside each other axis (FSDP, TP with and without SP,
PP), in the three 3-D layouts that cover every pair of the four axes, HSDP, and the 4-D layout
PP 2 x FSDP 2 x CP 2 x TP 2; the losses (whose CP shares must add up to the
whole batch's mean, not 1/cp of it), gradient norms, initial and final gathered weights are one
process's within the parity tolerance (in fp32, losses and norms within 1e-5 relative)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridtrain.parity.compare import deviation, problems, tolerance
from gridtrain.parity.matrix import GLOBAL_BATCH, base_overrides
from gridtrain.parity.run import LEG, load_result, run_reference
from gridtrain.parity.sweep import LEG_OVERRIDES

pytestmark = pytest.mark.dist

LAYOUTS = {
    2: {"cp2_ring": {"parallel.cp": 2, "parallel.cp_rotate": "ring"},
        "cp2_allgather": {"parallel.cp": 2, "parallel.cp_rotate": "allgather"},
        "cp2_mha": {"parallel.cp": 2, "model.n_kv_heads": 8},
        "cp2_tied": {"parallel.cp": 2, "model.tie_embeddings": True},
        "cp2_bf16": {"parallel.cp": 2, "train.precision": "bf16"},
        "cp2_full_recompute": {"parallel.cp": 2, "train.recompute": "full"}},
    4: {"cp4_ring": {"parallel.cp": 4},
        "cp4_allgather": {"parallel.cp": 4, "parallel.cp_rotate": "allgather"},
        "cp2_fsdp2": {"parallel.cp": 2, "parallel.dp_shard": 2},
        "cp2_tp2": {"parallel.cp": 2, "parallel.tp": 2},
        "cp2_tp2_sp": {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True},
        "cp2_pp2": {"parallel.cp": 2, "parallel.pp": 2},
        "cp2_pp2_interleaved": {"parallel.cp": 2, "parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                                "parallel.pp_virtual_stages": 2}},
    # The three 3-D layouts that cover every pair of the four axes, and HSDP.
    8: {"pp2_fsdp2_cp2": {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.cp": 2, "train.micro_batch": 2},
        "pp2_cp2_tp2_sp": {"parallel.pp": 2, "parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True},
        "fsdp2_cp2_tp2": {"parallel.dp_shard": 2, "parallel.cp": 2, "parallel.tp": 2},
        "hsdp2x2_cp2": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.cp": 2,
                        "train.micro_batch": 1}},
    # The 4-D layout, 16 processes on this 2-core machine (about a minute).
    16: {"pp2_fsdp2_cp2_tp2": {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.cp": 2, "parallel.tp": 2,
                               "train.micro_batch": 2}},
}


RESUMED_AS = {"parallel.tp": 2, "parallel.dp_shard": 2}
"""The layout the CP 2 x FSDP 2 case's checkpoint resumes under, in the same launch."""


def _base(tmp: Path, corpus: Path) -> dict[str, object]:
    return {**base_overrides(), "train.precision": "fp32", "parallel.dp_shard": 1,
            "data.corpus": str(corpus), "data.cache_dir": str(tmp / "cache")}


def launch_cases(work: Path, corpus: Path) -> dict[int, dict[str, dict[str, object]]]:
    """Every layout, in the launch of its world size that the test modules share (tests/launches.py)."""
    base = _base(work, corpus)
    cases = {world: {name: {**base, **layout} for name, layout in layouts.items()} for world, layouts in LAYOUTS.items()}
    cases[4]["cp2_fsdp2_leg"] = {**base, **LAYOUTS[4]["cp2_fsdp2"], **LEG_OVERRIDES, LEG: RESUMED_AS}
    return cases


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_context_parallel_trains_as_one_process(world, tmp_path, corpus_dir, launches):
    base = _base(tmp_path, corpus_dir)
    out = launches.out(__name__, world)
    refs = {}
    for name, layout in LAYOUTS[world].items():
        same = {k: v for k, v in layout.items() if not k.startswith("parallel.")}
        key = tuple(sorted(same.items()))
        if key not in refs:
            refs[key] = run_reference({**base, **same, "run_dir": str(tmp_path / f"ref{len(refs)}")})
        ref, precision = refs[key], str(same.get("train.precision", "fp32"))
        tol = tolerance(precision, GLOBAL_BATCH * 32, ref.lrs, 0.9, 0.95)
        dev = deviation(load_result(out, name), ref)
        assert not problems(dev, tol), (name, problems(dev, tol))
        # Throughput counts the global batch's tokens once (8 sequences of 32), not once per CP rank.
        steps = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["throughput/tokens_per_s"] * r["time/step_s"] for r in steps] == \
            pytest.approx([GLOBAL_BATCH * 32] * len(steps)), name
        if precision == "fp32":
            for got, want in dev.losses + dev.grad_norms:  # measured: within 1e-6
                assert got == pytest.approx(want, rel=1e-5), name


def test_a_cp_checkpoint_resumes_under_tp_and_validates_as_one_process(tmp_path, corpus_dir, launches):
    """Checkpoints stay layout-free: a CP 2 x FSDP 2 run validates after its first 2 steps with one
    process's validation loss (each CP rank validates its chunks of every sequence), saves, and its
    checkpoint continues under TP 2 x FSDP 2 with the last step of one process's straight run
    (1e-5, fp32). CP resumed in one process is the parity subset's (its 8-rank CP cases)."""
    out = launches.out(__name__, 4)
    base = _base(tmp_path, corpus_dir)
    ref = run_reference({**base, **LEG_OVERRIDES, "run_dir": str(tmp_path / "ref")}, leg=True)
    run = load_result(out, "cp2_fsdp2_leg")
    assert run is not None and run.leg is not None and len(run.leg.losses) == LEG_OVERRIDES["train.steps"]
    assert run.val_loss == pytest.approx(ref.val_loss, rel=1e-5)
    dev, tol = deviation(run.leg, ref.leg), tolerance("fp32", GLOBAL_BATCH * 32, ref.leg.lrs, 0.9, 0.95)
    assert not problems(dev, tol), problems(dev, tol)
    for got, want in dev.losses + dev.grad_norms:
        assert got == pytest.approx(want, rel=1e-5)
