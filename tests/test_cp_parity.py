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
from gridtrain.parity.run import load_result, run_reference

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


def _base(tmp: Path, corpus: Path) -> dict[str, object]:
    return {**base_overrides(), "train.precision": "fp32", "parallel.dp_shard": 1,
            "data.corpus": str(corpus), "data.cache_dir": str(tmp / "cache")}


def launch_cases(work: Path, corpus: Path) -> dict[int, dict[str, dict[str, object]]]:
    """Every layout, in the launch of its world size that the test modules share (tests/launches.py)."""
    base = _base(work, corpus)
    return {world: {name: {**base, **layout} for name, layout in layouts.items()} for world, layouts in LAYOUTS.items()}


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
        if precision == "fp32":
            for got, want in dev.losses + dev.grad_norms:  # measured: within 1e-6
                assert got == pytest.approx(want, rel=1e-5), name


def test_a_cp_checkpoint_resumes_in_one_process_and_under_tp(tmp_path, corpus_dir):
    """Checkpoints stay layout-free: a CP 2 x FSDP 2 run's step-4 checkpoint continues in one
    process and under TP 2 with the losses of steps 5-8 that one process trained straight through
    gives (1e-5). The CP run's own training and validation losses are that run's too (each CP
    rank validates its chunks of every sequence)."""
    import shutil

    from test_recovery import losses, train

    val = ["--checkpoint.keep", "10", "--train.val_every", "4", "--data.val_fraction", "0.2"]
    train(tmp_path, corpus_dir, "ref", 1, *val)
    train(tmp_path, corpus_dir, "cp", 4, "--parallel.cp", "2", "--parallel.dp_shard", "2", *val)
    want = losses(tmp_path / "ref")
    assert set(want) == set(range(1, 9))
    assert losses(tmp_path / "cp") == pytest.approx(want, rel=1e-5)
    validated = [val_losses(tmp_path / run) for run in ("ref", "cp")]
    assert set(validated[0]) == {0, 4, 8} and validated[1] == pytest.approx(validated[0], rel=1e-5)
    # Throughput counts the global batch's tokens once (4 sequences of 32), not once per CP rank.
    records = [json.loads(line) for line in (tmp_path / "cp" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "throughput/tokens_per_s" in r]
    assert len(steps) == 8
    assert all(r["throughput/tokens_per_s"] * r["time/step_s"] == pytest.approx(4 * 32) for r in steps)
    for name, nproc, layout in (("one", 1, []), ("tp2", 2, ["--parallel.tp", "2"])):
        shutil.copytree(tmp_path / "cp", tmp_path / name)
        for step in (6, 8):
            shutil.rmtree(tmp_path / name / "checkpoints" / f"step-{step:07d}")
        proc = train(tmp_path, corpus_dir, name, nproc, "--checkpoint.resume", "true", *val, *layout)
        assert "at step 4 (sample offset 16)" in proc.stdout + proc.stderr, proc.stderr[-3000:]
        got = losses(tmp_path / name)
        for step in (5, 6, 7, 8):
            assert got[step] == pytest.approx(want[step], rel=1e-5), (name, step)


def val_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/val"] for r in records if "loss/val" in r}
