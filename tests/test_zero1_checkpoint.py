"""ZeRO-1 saves and resumes like every layout: each rank writes the optimizer state of the
parameters it updates as a DCP state dict (no consolidation on one rank, which used to kill every
ZeRO-1 run at its first save), and any layout reads it back."""

from __future__ import annotations

import shutil

import pytest

from test_recovery import losses, train

pytestmark = pytest.mark.dist

ZERO1 = ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1", "--parallel.zero_stage", "1"]
FSDP2 = ["--parallel.dp_shard", "2", "--parallel.zero_stage", "3"]


def resume_from(tmp_path, corpus_dir, source: str, name: str, step: int, nproc: int, *layout: str) -> dict[int, float]:
    """Copy run `source`, keep its checkpoints up to `step`, and resume it under `layout`."""
    shutil.copytree(tmp_path / source, tmp_path / name)
    for path in (tmp_path / name / "checkpoints").iterdir():
        if int(path.name.removeprefix("step-")) > step:
            shutil.rmtree(path)
    proc = train(tmp_path, corpus_dir, name, nproc, "--resume", "--checkpoint.keep", "10", *layout)
    assert f"at step {step} (sample offset {4 * step})" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return losses(tmp_path / name)


def test_zero1_saves_and_resumes_in_one_process_under_fsdp_and_back(tmp_path, corpus_dir):
    """The issue's command (ZeRO-1 over 2 replicas) trains 8 steps with a checkpoint every 2: its
    step-4 checkpoint continues in one process and under FSDP 2, and FSDP's step-6 checkpoint
    continues under ZeRO-1 again, each with the losses one process trains straight through (1e-5)."""
    train(tmp_path, corpus_dir, "ref", 1)
    train(tmp_path, corpus_dir, "zero1", 2, "--checkpoint.keep", "10", *ZERO1)
    want = losses(tmp_path / "ref")
    assert set(want) == set(range(1, 9)) and losses(tmp_path / "zero1") == pytest.approx(want, rel=1e-5)
    one = resume_from(tmp_path, corpus_dir, "zero1", "one", 4, 1)
    fsdp = resume_from(tmp_path, corpus_dir, "zero1", "fsdp", 4, 2, *FSDP2)
    back = resume_from(tmp_path, corpus_dir, "fsdp", "back", 6, 2, *ZERO1)
    for name, got, first in (("one", one, 5), ("fsdp", fsdp, 5), ("back", back, 7)):
        for step in range(first, 9):
            assert got[step] == pytest.approx(want[step], rel=1e-5), (name, step)
