"""Runs with data.doc_mask and the attention FLOPs they count: the trainer's MFU numerator counts
attention inside the documents of its data, `plan --check`'s step time too (and refuses where the
data is not here to measure), and a dry run masks (or, under a pipeline, refuses in one line)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gridtrain.config import ConfigError
from gridtrain.config_load import load_config
from gridtrain.layout.dims import ParallelDims
from gridtrain.model.documents import Documents, document_ids
from gridtrain.plan.localtime import LocalMachine, microbatch_seconds


def test_trainer_mfu_counts_attention_inside_documents(tmp_path, make_config):
    """6N + 12 L H Q x span, the span measured here independently: every training window's
    documents as the model finds them (document_ids), their squared lengths over the tokens."""
    from gridtrain.data.sampler import num_windows
    from gridtrain.model.stats import flops_per_token
    from gridtrain.train.trainer import Trainer
    from tests.test_documents import short_documents

    corpus = short_documents(tmp_path / "corpus")
    trainer = Trainer(make_config(tmp_path, **{"data.corpus": str(corpus), "data.doc_mask": True}))
    store, seq = trainer.data.train.store, trainer.cfg.data.seq_len
    count = num_windows(store, seq)
    inputs = torch.from_numpy(np.stack([store.read(i * seq, seq).astype(np.int64) for i in range(count)]))
    squares = sum(int((torch.bincount(row) ** 2).sum()) for row in document_ids(inputs, store.eos_id))
    span = squares / (count * seq)
    a = trainer.args
    whole = flops_per_token(a, seq)
    assert span < seq / 2  # documents of 6 to 25 bytes in 32-token sequences
    assert trainer.flops_per_token == pytest.approx(whole - 12 * a.n_layers * a.n_heads * a.head_dim * (seq - span),
                                                    rel=1e-12)
    trainer.release()


def test_local_step_time_counts_the_span():
    """The CPU model's attention: 3 x 4 x tokens x keys x h x layers / tp FLOPs at the calibrated
    attention rate; a span of a quarter of the sequence saves 3/4 of it."""
    cfg = load_config(None, {"model.preset": "tiny", "data.seq_len": "256", "train.micro_batch": "2"})
    args, dims = cfg.model.args(), ParallelDims(1, 1, 1, 1, 1, 1, 1)
    machine = LocalMachine(1e10, 2e9, 1e10, 1e9, 2)
    whole = microbatch_seconds(args, dims, cfg, machine, args.n_layers, True, 0.0)
    docs = microbatch_seconds(args, dims, cfg, machine, args.n_layers, True, 0.0, span=64.0)
    saved = 3 * 4 * (2 * 256) * (256 - 64) * args.dim * args.n_layers / 2e9
    assert whole - docs == pytest.approx(saved, rel=1e-12)


def _dry(tmp_path, name, world, **keys):
    from gridtrain.train.dry_run import dry_run

    cfg = load_config(None, {"model.preset": "tiny", "data.doc_mask": "true", "run_dir": str(tmp_path / name),
                             "data.cache_dir": str(tmp_path / "cache"), **keys})
    return cfg, dry_run(cfg, world, 0)


@pytest.mark.parametrize("keys", [{}, {"parallel.cp": "2"}], ids=["one", "cp2"])
def test_dry_run_masks_and_measures_the_plan(tmp_path, monkeypatch, keys):
    """The dry run's model attends inside documents (their ids reach it: 4 a sequence), and its
    bytes are the planner's."""
    from gridtrain.plan.check_run import check_run

    built = []
    real = Documents.__init__

    def spy(self, ids, restart=False):
        built.append(ids.tolist())  # a real tensor: the fake mode would turn a clone into a fake one
        real(self, ids, restart)

    monkeypatch.setattr(Documents, "__init__", spy)
    world = 2 if keys else 1
    cfg, result = _dry(tmp_path, "run", world, **keys)
    assert built and all(len(row) == cfg.data.seq_len and max(row) == 3 for ids in built for row in ids)
    rows = [r for r in check_run(result.run_dir) if r.rank == 0 and not r.missing]
    assert rows and all(r.ratio == pytest.approx(1.0, rel=1e-9) for r in rows)


def test_dry_run_under_a_pipeline_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        _dry(tmp_path, "pp", 2, **{"parallel.pp": "2"})
    assert len(err.value.problems) == 1
    assert "a dry run of data.doc_mask under parallel.pp = 2 cannot mask" in err.value.problems[0]
    assert not (tmp_path / "pp").exists()


def test_check_refuses_a_step_time_without_the_documents(tmp_path):
    """A doc_mask run whose prepared data is not on this machine: its documents set attention's
    FLOPs, so --check says so instead of predicting the whole sequence's."""
    from gridtrain.plan.check_run import check_step_time, span_line

    cfg, result = _dry(tmp_path, "run", 1)
    calibration = {"peak_flops": {"fp32": 1e10}, "memory_bytes_per_s": 1e10, "gloo_bytes_per_s": 1e9}
    with pytest.raises(ValueError, match="data.doc_mask: the prepared tokens of .* are not at .*cache"):
        check_step_time(result.run_dir, calibration)
    line, known = span_line(cfg)
    assert line.startswith("attention: data.doc_mask: the prepared tokens") and not known
    assert span_line(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, doc_mask=False))) == (None, True)


def test_check_without_the_documents_says_so_once_and_measures_nothing(tmp_path, monkeypatch, capsys):
    """`plan --check` of a doc_mask run on CPU whose documents are not on this machine: the reason
    once, and no step time, before any calibration (the suite fails a test that would measure)."""
    from gridtrain.cli import main
    from gridtrain.rundir import RunRecord

    _, result = _dry(tmp_path, "run", 1)
    real = RunRecord.load
    monkeypatch.setattr(RunRecord, "load", lambda run_dir, with_layout=True: dataclasses.replace(
        real(run_dir, with_layout), backend="gloo"))  # as a CPU run's record reads
    assert main(["plan", "--check", str(result.run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count("are not at") == 1, out
    assert "step time: not predicted without the run's documents (above)" in out
