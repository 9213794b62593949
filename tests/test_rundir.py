"""A run directory holds one run: training on top of it is refused, and `--resume` continues the
same model and data or is refused naming each difference, before anything in the directory changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridtrain.config import ConfigError

from conftest import cli_train


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("rundir") / "run"
    assert cli_train(run_dir, corpus_dir) == 0
    return run_dir


def test_training_into_a_run_is_refused_and_changes_nothing(trained, corpus_dir, capsys):
    before = snapshot(trained)
    assert cli_train(trained, corpus_dir) == 2
    err = capsys.readouterr().err
    assert f"run_dir {trained} already holds a run" in err and "--resume" in err and "Traceback" not in err
    assert snapshot(trained) == before


@pytest.mark.parametrize("extra,named", [
    (["--model.n_layers", "1"], "model.n_layers: saved 2, now 1"),
    (["--model.tie_embeddings", "true"], "model.tie_embeddings: saved False, now True"),
    (["--model.rope_theta", "10000"], "model.rope_theta: saved 500000.0, now 10000.0"),
    (["--model.n_kv_heads", "4"], "model.n_kv_heads: saved 2, now 4"),
    (["--data.seq_len", "16"], "data.seq_len: saved 32, now 16"),
    (["--data.tokenizer", "bpe:300"], "data.tokenizer: saved 'byte', now 'bpe:300'"),
])
def test_resume_with_another_model_or_data_is_refused(trained, corpus_dir, capsys, extra, named):
    """Today's failure mode: a shallower model loaded what fit, said "resumed", replaced config.json
    and rotated the old checkpoints out. Now: exit 2, each difference named, nothing touched."""
    before = snapshot(trained)
    assert cli_train(trained, corpus_dir, "--resume", *extra) == 2
    err = capsys.readouterr().err
    assert named in err and "give a new --run_dir" in err and "Traceback" not in err
    assert snapshot(trained) == before


def test_resume_of_the_same_run_continues(trained, corpus_dir):
    assert cli_train(trained, corpus_dir, "--resume", "--train.steps", "4") == 0
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss/train" in r] == [1, 2, 3, 4]


def test_a_file_as_run_dir_is_refused(tmp_path, corpus_dir, capsys):
    path = tmp_path / "run"
    path.write_text("mine")
    assert cli_train(path, corpus_dir) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert path.read_text() == "mine"



def test_a_jobs_own_run_continues_and_another_jobs_needs_resume(tmp_path, make_config, monkeypatch):
    """The decision is keyed by the job's rendezvous id, not by torchrun's restart count: any
    attempt of job A (a healthy node restarted beside a failed one, or a node started again, counts
    0 restarts) continues A's run with or without --resume; a new job B is refused without --resume
    on every attempt (its restart count grows), and --resume makes it a resume. torchrun's default
    id 'none' names no job: then a restart of any rank decides."""
    from gridtrain.rundir import NEW, OWN, RESUME, RunRecord, job_id, run_dir_decision
    from gridtrain.validate import validate

    cfg = make_config(tmp_path, run_dir=str(tmp_path / "run"))
    resumed = make_config(tmp_path, run_dir=str(tmp_path / "run"), **{"checkpoint.resume": True})
    assert run_dir_decision(cfg, "job-A", restarted=False) == NEW
    RunRecord(cfg, validate(cfg), job_id="job-A").write(tmp_path / "run")
    assert RunRecord.load(tmp_path / "run").job_id == "job-A"
    assert run_dir_decision(cfg, "job-A", restarted=False) == OWN
    assert run_dir_decision(resumed, "job-A", restarted=True) == OWN
    for restarted in (False, True):
        with pytest.raises(ConfigError, match="already holds a run"):
            run_dir_decision(cfg, "job-B", restarted)
        assert run_dir_decision(resumed, "job-B", restarted) == RESUME
    RunRecord(cfg, validate(cfg)).write(tmp_path / "run")  # written outside torchrun: no job
    assert run_dir_decision(cfg, None, restarted=True) == OWN
    for job, restarted in ((None, False), ("job-B", True)):
        with pytest.raises(ConfigError, match="already holds a run"):
            run_dir_decision(cfg, job, restarted)
    for value, expected in (("", None), ("none", None), ("4711", "4711")):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", value)
        assert job_id() == expected
