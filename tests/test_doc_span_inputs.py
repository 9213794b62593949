"""A prepared folder's document starts as `plan --doc-len DIR`, `plan --check` and the explorer read
them (data/doc_span.py through TokenStore.doc_starts): a broken folder is one line naming the file,
never a hang (a fifo in place of a .docs.npy), a traceback (an index.json without its splits) or a
span computed from starts that contradict index.json."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal

import numpy as np
import pytest

from gridtrain.data.shards import TokenStore, prepare
from gridtrain.data.tokenizer import ByteTokenizer
from gridtrain.errors import UserError

DOCS = "train-00000.docs.npy"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": "x" * (10 + i % 7)}) + "\n")
    return prepare(root, ByteTokenizer(), tmp_path_factory.mktemp("p") / "p", val_fraction=0.05)


def _copy(prepared, tmp_path):
    out = tmp_path / "p"
    shutil.copytree(prepared, out)
    return out


def _plan_doc_len(folder):
    from gridtrain.cli import build_parser
    from gridtrain.plan.app.command import run_plan

    args, extra = build_parser().parse_known_args(["plan", "--model", "tiny", "--num-gpus", "1", "--seq-len", "64",
                                                   "--doc-len", str(folder)])
    out, err = io.StringIO(), io.StringIO()
    return run_plan(args, extra, out, err), out.getvalue(), err.getvalue()


def _alarm(seconds):
    def fail(*_):
        raise TimeoutError(f"blocked for {seconds} s")
    signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)


def test_a_fifo_in_place_of_the_document_starts_is_refused_not_waited_on(prepared, tmp_path):
    out = _copy(prepared, tmp_path)
    os.remove(out / DOCS)
    os.mkfifo(out / DOCS)
    _alarm(20)  # np.load of a fifo waited for a writer for ever
    try:
        rc, _, err = _plan_doc_len(out)
    finally:
        signal.alarm(0)
    assert rc == 2 and "is not a regular file" in err and DOCS in err and err.count("\n") == 1


def test_missing_document_starts_and_an_index_without_splits_are_one_line(prepared, tmp_path):
    out = _copy(prepared, tmp_path)
    os.remove(out / DOCS)
    rc, _, err = _plan_doc_len(out)
    assert rc == 2 and DOCS in err and "does not exist" in err and err.count("\n") == 1
    shutil.rmtree(out)
    out = _copy(prepared, tmp_path)
    index = json.loads((out / "index.json").read_text())
    del index["splits"]
    (out / "index.json").write_text(json.dumps(index))
    rc, _, err = _plan_doc_len(out)
    assert rc == 2 and "index.json lacks what `gridtrain data prepare` writes" in err and err.count("\n") == 1
    shutil.rmtree(out)
    out = _copy(prepared, tmp_path)
    index = json.loads((out / "index.json").read_text())
    del index["splits"]["train"]["shards"][0]["docs_file"]
    (out / "index.json").write_text(json.dumps(index))
    rc, _, err = _plan_doc_len(out)
    assert rc == 2 and "lacks a shard's document starts or count (KeyError" in err and err.count("\n") == 1


@pytest.mark.parametrize("starts", [[5, 3, 100_000], [], [0, 0], "pickled"])
def test_starts_that_contradict_the_index_are_refused(prepared, tmp_path, starts):
    """The shard holds len(TokenStore.doc_starts) documents by index.json (num_docs); starts out of
    order, outside the shard, fewer, or an object array are refused instead of read as documents (an
    empty array made the whole split one document: span = the sequence)."""
    out = _copy(prepared, tmp_path)
    num_docs = json.loads((out / "index.json").read_text())["splits"]["train"]["shards"][0]["num_docs"]
    assert len(TokenStore(out, "train").doc_starts) == num_docs
    if starts == "pickled":
        np.save(out / DOCS, np.array([{"a": 1}] * num_docs, dtype=object), allow_pickle=True)
    else:
        np.save(out / DOCS, np.asarray(starts, np.int64))
    with pytest.raises(UserError, match="prepare the corpus again"):
        TokenStore(out, "train").doc_starts


def test_a_mixtures_span_weighs_its_sources_by_the_samples_it_draws(tmp_path):
    """plan --check's span of a data.mix run (run_attention_span) weighs its sources as MixtureReader
    draws them, by the quotas per block of 1,000 samples, as the trainer's MFU does (Data.attention_span):
    weights 999.5 and 0.5 draw 999 and 1 (every source at least one sample a block), so the span is
    (999 short + 1 long) / 1,000, not (999.5 short + 0.5 long) / 1,000."""
    from gridtrain.config_load import load_config
    from gridtrain.data.doc_span import prepared_span, run_attention_span

    def corpus(name, lengths):
        root = tmp_path / name
        root.mkdir()
        with open(root / "docs.jsonl", "w") as f:
            for n in lengths:
                f.write(json.dumps({"text": "y" * n}) + "\n")
        return prepare(root, ByteTokenizer(), tmp_path / f"{name}-p", val_fraction=0.05)

    short, long = corpus("short", [3] * 200), corpus("long", [495] * 20)
    s_short, s_long = prepared_span(short, 16), prepared_span(long, 16)
    assert (s_short, s_long) == (4.0, 16.0)  # 3 bytes + eos fill 16 as 4 x 4; 495 + eos = 31 x 16 fill whole windows
    cfg = load_config(None, {"model.preset": "tiny", "data.seq_len": "16", "data.doc_mask": "true",
                             "data.mix": f"{short}=999.5,{long}=0.5"})
    assert run_attention_span(cfg) == pytest.approx((999 * 4.0 + 1 * 16.0) / 1000, rel=1e-12)  # 4.012, not 4.006


def test_a_number_is_tokens_even_beside_a_folder_of_that_name(prepared, tmp_path, monkeypatch):
    """`--doc-len 2048` (and the explorer's doc_len, which sends digits) is documents of 2,048 tokens,
    though the working directory holds a folder named 2048: 4 of them fill 8,192, span 2,048; the
    folder is `./2048`. A word that is neither a count nor a folder says both."""
    from gridtrain.cli import build_parser
    from gridtrain.plan.app.command import run_plan

    shutil.copytree(prepared, tmp_path / "2048")
    monkeypatch.chdir(tmp_path)

    def plan(doc_len, seq="8192"):
        args, extra = build_parser().parse_known_args(["plan", "--model", "tiny", "--num-gpus", "1", "--seq-len", seq,
                                                       "--doc-len", doc_len, "--json"])
        out, err = io.StringIO(), io.StringIO()
        rc = run_plan(args, extra, out, err)
        return rc, (json.loads(out.getvalue()) if rc == 0 else None), err.getvalue()

    rc, report, _ = plan("2048")
    assert rc == 0 and report["problem"]["attention_span"] == 2048
    rc, report, _ = plan("./2048", seq="64")
    assert rc == 0 and report["problem"]["attention_span"] < 64  # the folder's documents, 10-16 tokens
    rc, _, err = plan("./no-such-folder")
    assert rc == 2 and "is not a count" in err and "nor is it a folder here" in err and err.count("\n") == 1
    shutil.copy(tmp_path / "2048" / "index.json", tmp_path / "index.json")  # the working directory looks prepared
    rc, _, err = plan("")
    assert rc == 2 and "--doc-len = '' is not a count" in err and err.count("\n") == 1  # not read as "."
