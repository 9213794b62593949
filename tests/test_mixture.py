"""Weighted mixtures (data.mix): each source's share of 10,000 sequences within 1% of its weight,
measured from the tokens themselves; each source's epoch visits all its windows; the data-parallel
slices are the one-process batch bit for bit; a run resumed mid-mixture under another split of its
batch reads the same next batches; the log's epochs and validation per source; another mixture's
checkpoint refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gridtrain.data.mix_spec import parse_mix
from gridtrain.data.mixture import MIX_BLOCK, MixtureReader, quotas
from gridtrain.data.prepare import prepare
from gridtrain.data.shards import TokenStore
from gridtrain.data.tokenizer import ByteTokenizer
from gridtrain.errors import BadInput

LETTERS = "xyz"


def letter_corpus(root, letter, num_docs=40):
    """Documents of one letter and spaces: a sequence's bytes say which source it came from."""
    rng = np.random.default_rng(ord(letter))
    root.mkdir(parents=True)
    for i in range(num_docs):
        words = [letter * int(n) for n in rng.integers(1, 9, size=int(rng.integers(20, 80)))]
        (root / f"d{i:02d}.txt").write_text(" ".join(words) + "\n")
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mix")
    return {c: letter_corpus(tmp / c, c, num_docs=30 + 15 * i) for i, c in enumerate(LETTERS)}


@pytest.fixture(scope="module")
def stores(sources, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prepared")
    return [TokenStore(prepare(sources[c], ByteTokenizer(), tmp / c, val_fraction=0.1), "train") for c in LETTERS]


def which_source(inputs):
    """The source of each row, read from its bytes (one letter per source)."""
    codes = [ord(c) for c in LETTERS]
    found = np.array([[bool((row == code).any()) for code in codes] for row in inputs.numpy()])
    assert (found.sum(axis=1) == 1).all()  # every sequence comes from exactly one source
    return found.argmax(axis=1)


def test_shares_over_10000_sequences_are_within_1pct(stores):
    weights = [0.47, 0.33, 0.2]
    reader = MixtureReader(stores, list(LETTERS), weights, seq_len=16, seed=5)
    inputs, _ = reader.read(12_345, 10_000)  # not on a block boundary
    share = np.bincount(which_source(inputs), minlength=3) / 10_000
    assert np.abs(share - np.asarray(weights)).max() < 0.01, share
    assert quotas(weights).tolist() == [470, 330, 200] and quotas([1, 1, 1]).sum() == MIX_BLOCK


def test_each_source_visits_all_its_windows_per_epoch(stores):
    reader = MixtureReader(stores, list(LETTERS), [2, 1, 1], seq_len=16, seed=0)
    counts = [o.num_samples for o in reader.orders]
    n = int(max(c / w for c, w in zip(counts, (0.5, 0.25, 0.25)))) + MIX_BLOCK  # an epoch of each source
    inputs, targets = reader.read(0, n)
    origin = which_source(inputs)
    for s, store in enumerate(stores):
        rows = inputs[origin == s][: counts[s]]
        windows = {tuple(store.read(w * 16, 16)) for w in range(counts[s])}
        assert len(rows) == counts[s] and {tuple(r.tolist()) for r in rows} == windows
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    epochs = reader.epochs(n)
    assert all(abs(epochs[f"data/epochs/{c}"] - (origin == s).sum() / counts[s]) < 1e-12 for s, c in enumerate(LETTERS))


def test_data_parallel_slices_are_the_one_process_batch(stores):
    reader = MixtureReader(stores, list(LETTERS), [0.5, 0.3, 0.2], seq_len=16, seed=1)
    first, batch = 3 * MIX_BLOCK - 8, 16  # straddles two blocks
    whole, _ = reader.read(first, batch)
    for ranks in (2, 4):
        again = MixtureReader(stores, list(LETTERS), [0.5, 0.3, 0.2], seq_len=16, seed=1)  # a fresh process
        parts = [again.read(first + r * batch // ranks, batch // ranks)[0] for r in range(ranks)]
        assert torch.equal(torch.cat(parts), whole)


def test_parse_mix_refuses_what_is_not_a_mixture():
    assert [(s.name, s.weight) for s in parse_mix("/a/web=3, /b/web=1,c=0.5")] == [("web", 3.0), ("web-2", 1.0),
                                                                                   ("c", 0.5)]
    for spec, words in [("/a=0", "weight 0 must be a positive finite number"), ("/a=-1", "weight -1 must be"),
                        ("/a", "is not PATH=WEIGHT"), ("/a=x", "weight 'x' is not a number"),
                        ("/a=inf", "weight inf must be")]:
        with pytest.raises(BadInput, match=words):
            parse_mix(spec)


def recording(trainer):
    """Wrap the trainer's reader: every (first sample, inputs) it reads, in order."""
    seen, read = [], trainer.read

    def record(first, count):
        inputs, targets = read(first, count)
        seen.append((first, inputs.clone()))
        return inputs, targets

    trainer.read = record
    return seen


def test_resume_mid_mixture_reads_the_same_next_batches(tmp_path, sources, make_config):
    from gridtrain.checkpoint.state import InvalidCheckpointError
    from gridtrain.train.trainer import Trainer

    mix = ",".join(f"{sources[c]}={w}" for c, w in zip(LETTERS, (0.5, 0.3, 0.2)))
    common = {"data.corpus": None, "data.mix": mix, "train.steps": 4, "data.val_fraction": 0.1,
              "data.cache_dir": str(tmp_path / "cache"),
              "train.val_every": 4, "train.val_batches": 1}
    whole = Trainer(make_config(tmp_path / "a", **common))
    seen = recording(whole)
    metrics = [whole.train_step() for _ in range(4)]
    assert set(metrics[-1]) >= {f"data/epochs/{c}" for c in LETTERS}
    assert all(0 < m["time/data_wait_s"] < m["time/step_s"] for m in metrics)  # measured, and reset each step
    val = whole.evaluate()
    assert set(val) >= {"loss/val", *(f"loss/val/{c}" for c in LETTERS)}
    assert min(val[f"loss/val/{c}"] for c in LETTERS) <= val["loss/val"] <= max(val[f"loss/val/{c}"] for c in LETTERS)
    whole.release()
    stopped = Trainer(make_config(tmp_path / "b", **common, **{"checkpoint.interval": 2}))
    for _ in range(2):
        stopped.train_step()
    stopped.save()
    stopped.release()
    # Another split of the same global batch of 4: one sequence per micro-batch, 4 accumulated.
    resumed = Trainer(make_config(tmp_path / "b", **common, **{"checkpoint.resume": True, "train.micro_batch": 1}))
    assert resumed.step == 2
    again = recording(resumed)
    for _ in range(2):
        resumed.train_step()
    resumed.release()
    later = {first: x for first, x in seen if first >= 8}
    batch = torch.cat([x for _, x in sorted(later.items())])
    assert torch.equal(torch.cat([x for _, x in again]), batch)  # samples 8..15, bit for bit
    other = mix.replace("=0.3", "=0.4")
    with pytest.raises(InvalidCheckpointError, match="resume with the data.mix"):
        Trainer(make_config(tmp_path / "b", **{**common, "data.mix": other, "checkpoint.resume": True}))


@pytest.mark.dist
def test_a_mixture_checkpoint_of_fsdp2_continues_in_one_process(tmp_path, sources, make_config):
    """`gridtrain train --nproc 2` (FSDP 2) on a mixture saves step 2; one process resumes it and
    reads, for steps 3 and 4, the batches an uninterrupted one-process run reads, bit for bit (and its
    losses match the FSDP 2 run's within fp32 tolerance: the same data)."""
    import shutil

    from gridtrain.train.trainer import Trainer
    from tests.test_recovery import losses, train

    mix = ",".join(f"{sources[c]}={w}" for c, w in zip(LETTERS, (0.5, 0.3, 0.2)))
    train(tmp_path, sources["x"], "fsdp2", 2, "--data.corpus", "none", "--data.mix", mix, "--train.steps", "4",
          "--data.val_fraction", "0.1")
    reference = losses(tmp_path / "fsdp2")
    (tmp_path / "one" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "fsdp2" / "checkpoints" / "step-0000002", tmp_path / "one" / "checkpoints" / "step-0000002")
    common = {"data.corpus": None, "data.mix": mix, "train.steps": 4, "data.val_fraction": 0.1,
              "data.cache_dir": str(tmp_path / "cache")}
    straight = Trainer(make_config(tmp_path / "straight", **common))
    seen = recording(straight)
    for _ in range(4):
        straight.train_step()
    straight.release()
    resumed = Trainer(make_config(tmp_path, **common, run_dir=str(tmp_path / "one"), **{"checkpoint.resume": True}))
    assert resumed.step == 2
    again = recording(resumed)
    for step in (3, 4):
        assert resumed.train_step()["loss/train"] == pytest.approx(reference[step], rel=1e-5), step
    resumed.release()
    assert torch.equal(torch.cat([x for _, x in again]), torch.cat([x for first, x in seen if first >= 8]))


def test_plan_check_shows_the_data_wait_beside_the_step(tmp_path):
    """plan --check's step-time line gives the median wait of the plain steps (not the first, not one
    that validated) beside the measured step."""
    import json

    from gridtrain.plan.check_run import CheckRow, format_step_time, measured_data_wait

    records = [{"step": 1, "time/step_s": 1.0, "time/data_wait_s": 0.01},
               {"step": 2, "time/step_s": 0.5, "time/data_wait_s": 0.002},
               {"step": 3, "time/step_s": 0.5, "time/data_wait_s": 0.009, "loss/val": 2.0},
               {"step": 4, "time/step_s": 0.5, "time/data_wait_s": 0.003}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    wait = measured_data_wait(tmp_path)
    assert wait == pytest.approx(0.0025)
    line = format_step_time(CheckRow(0, "step_time_s", 0.4, 0.5, data_wait=wait), {"compute_s": 0.4})
    assert "measured 0.5000 s (median of plain steps, of which waiting for data 0.0025 s (0.50%))" in line
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "time/step_s": 0.5}) + "\n")  # an older run
    assert "waiting" not in format_step_time(CheckRow(0, "step_time_s", 0.4, 0.5, data_wait=measured_data_wait(tmp_path)),
                                             {"compute_s": 0.4})
