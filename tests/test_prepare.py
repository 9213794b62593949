"""gridtrain data prepare: parquet, .jsonl.zst and save_to_disk corpora prepared and trained on; the
manifest against the tokenizer run by hand; workers give the same shards; an interrupted prepare
serves nothing and continues where it stopped; a second job waits for the prepare that runs; a
128K-vocabulary Llama 3 style tokenizer.json; the closing summary and `data stats`."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from gridtrain.cli import main
from gridtrain.data.prepare import PROGRESS_FILE, prepare
from gridtrain.data.shards import TokenStore, load_index
from gridtrain.data.tokenizer import BPETokenizer, ByteTokenizer
from tests.test_data_sources import save_dataset, write_jsonl, write_parquet

TEXTS = [f"record {i} " + "alpha beta gamma " * (i % 11) for i in range(300)] + ["", "", "tail"]


def stream_docs(out, split):
    store = TokenStore(out, split)
    stream = store.read(0, store.num_tokens)
    bounds = list(store.doc_starts) + [store.num_tokens]
    return [tuple(stream[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def expected_docs(texts, tok):
    return sorted(tuple(tok.encode(t)) + (tok.eos_id,) for t in texts if t)


@pytest.fixture
def corpora(tmp_path):
    """The three record formats, each made here, holding TEXTS."""
    made = {"parquet": tmp_path / "pq", "zst": tmp_path / "c.jsonl.zst", "saved": tmp_path / "saved"}
    made["parquet"].mkdir()
    write_parquet(made["parquet"] / "part-0.parquet", TEXTS[:150], column="content")
    write_parquet(made["parquet"] / "part-1.parquet", TEXTS[150:], column="content")
    write_jsonl(made["zst"], TEXTS, column="content")
    save_dataset(made["saved"], TEXTS)
    return made


def test_each_format_prepares_to_the_tokenizers_own_tokens(tmp_path, corpora):
    tok = ByteTokenizer()
    for name, source in corpora.items():
        column = "text" if name == "saved" else "content"
        out = prepare(source, tok, tmp_path / f"p-{name}", val_fraction=0.1, shard_tokens=2000, column=column)
        index = load_index(out)
        assert sorted(stream_docs(out, "train") + stream_docs(out, "val")) == expected_docs(TEXTS, tok)
        assert index["empty_docs"] == 2 and index["num_docs"] == 301
        assert sum(c["documents"] for c in index["sources"].values()) == 301
        assert sum(c["tokens"] for c in index["sources"].values()) == index["num_tokens"]
        for split in ("train", "val"):
            for shard in index["splits"][split]["shards"]:
                assert hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
    parquet = load_index(tmp_path / "p-parquet")["sources"]
    assert parquet == {"part-0.parquet": {"documents": 150, "empty": 0,
                                          "tokens": sum(len(t.encode()) + 1 for t in TEXTS[:150])},
                       "part-1.parquet": {"documents": 151, "empty": 2,
                                          "tokens": sum(len(t.encode()) + 1 for t in TEXTS[150:] if t)}}


def test_each_format_trains(tmp_path, corpora, make_config):
    from gridtrain.train.trainer import Trainer

    for name, source in corpora.items():
        column = "text" if name == "saved" else "content"
        trainer = Trainer(make_config(tmp_path / name, **{"data.corpus": str(source), "data.text_column": column,
                                                          "train.steps": 1, "data.val_fraction": 0.1}))
        metrics = trainer.train_step()
        assert np.isfinite(metrics["loss/train"])
        trainer.release()


def test_workers_write_the_same_shards(tmp_path, corpora):
    tok = ByteTokenizer()
    from gridtrain.data import prepare as module

    one = prepare(corpora["zst"], tok, tmp_path / "one", val_fraction=0.1, shard_tokens=1500, column="content")
    old = module.CHUNK_CHARS
    module.CHUNK_CHARS = 500  # many chunks in flight
    try:
        two = prepare(corpora["zst"], tok, tmp_path / "two", val_fraction=0.1, shard_tokens=1500, column="content",
                      workers=2)
    finally:
        module.CHUNK_CHARS = old
    assert load_index(one) == load_index(two)


class Interrupting(ByteTokenizer):
    """Encodes like ByteTokenizer, counting documents; raises KeyboardInterrupt at the `stop`-th."""

    def __init__(self, stop=None):
        self.stop, self.seen = stop, 0

    def encode_batch(self, texts):
        self.seen += len(texts)
        if self.stop is not None and self.seen >= self.stop:
            raise KeyboardInterrupt
        return super().encode_batch(texts)


def test_an_interrupted_prepare_serves_nothing_and_continues(tmp_path, corpora, monkeypatch):
    from gridtrain.data import prepare as module

    monkeypatch.setattr(module, "CHUNK_CHARS", 100)  # a chunk of a few documents
    kwargs = dict(val_fraction=0.1, shard_tokens=700, column="content")
    reference = load_index(prepare(corpora["parquet"], ByteTokenizer(), tmp_path / "ref", **kwargs))
    stopped = Interrupting(stop=200)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpora["parquet"], stopped, tmp_path / "out", **kwargs)
    partial = tmp_path / ".out.partial"
    progress = json.loads((partial / PROGRESS_FILE).read_text())
    assert not (tmp_path / "out").exists()  # nothing served: no index, no folder
    assert 0 < progress["records"] < 200 and progress["shards"]["train"]
    assert list(partial.glob("*.tmp"))  # a half-written shard was left, and is dropped on resume
    resumed = Interrupting()
    index = load_index(prepare(corpora["parquet"], resumed, tmp_path / "out", **kwargs))
    assert index == reference  # the same shards, checksums and counts
    assert resumed.seen == 301 - progress["docs"]  # the records before the progress point were not encoded again
    assert not partial.exists()


def test_a_second_job_waits_for_the_prepare_that_runs_and_uses_its_result(tmp_path, corpora):
    """Two jobs on one cache (torchft's replica groups start together): the second one's rank 0
    found the first's prepare running and stopped with "another prepare is writing". It waits now:
    for the first to publish (it uses that result), or to die (it continues the prepare itself)."""
    import fcntl
    import os
    import threading

    from gridtrain.data.shards import LOCK_FILE, ensure_prepared

    def second_job(cache):
        got = []
        job = threading.Thread(target=lambda: got.append(ensure_prepared(corpora["zst"], "byte", cache, 0.1,
                                                                         column="content")))
        job.start()
        job.join(timeout=1.0)
        assert job.is_alive() and not got  # waiting, not refused
        return job, got

    reference = load_index(prepare(corpora["zst"], ByteTokenizer(), tmp_path / "ref", val_fraction=0.1, column="content"))
    for ending in ("publishes", "dies"):
        cache = tmp_path / ending
        first = ensure_prepared(corpora["zst"], "byte", cache, val_fraction=0.1, column="content")  # its name
        work = cache / f".{first.name}.partial"
        first.rename(work)  # as if the other job were still writing it
        held = os.open(work / LOCK_FILE, os.O_RDWR | os.O_CREAT)
        fcntl.flock(held, fcntl.LOCK_EX)
        job, got = second_job(cache)
        if ending == "publishes":  # with its lock inside, removed after
            work.rename(first)
            (first / LOCK_FILE).unlink()
        os.close(held)
        job.join(timeout=60)
        assert got == [first] and load_index(first) == reference and not work.exists()
    (first / LOCK_FILE).touch()  # a prepare killed between publishing and removing its lock
    assert load_index(prepare(corpora["zst"], ByteTokenizer(), first, val_fraction=0.1, column="content",
                              overwrite=True)) == reference


def llama3_style_tokenizer_json(path):
    """A tokenizer.json shaped like Llama 3's: byte-level BPE with its split pattern, 128,000 regular
    tokens and 256 special ones (<|begin_of_text|> 128000, <|end_of_text|> 128001); the byte
    symbols sit at the top of the regular range so that ids pass 65,535 (uint32 shards)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {f"<filler_{i}>": i for i in range(128000 - len(alphabet))}
    vocab.update({c: 128000 - len(alphabet) + i for i, c in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    split = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)]
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(path))
    return path


def test_a_128k_llama3_style_tokenizer_json(tmp_path, corpora):
    path = llama3_style_tokenizer_json(tmp_path / "tokenizer.json")
    tok = BPETokenizer.load(path)
    assert (tok.vocab_size, tok.eos_id) == (128256, 128001)
    out = prepare(corpora["zst"], tok, tmp_path / "p", val_fraction=0.1, column="content")
    index = load_index(out)
    assert index["dtype"] == "uint32" and index["vocab_size"] == 128256
    docs = stream_docs(out, "train") + stream_docs(out, "val")
    assert max(max(d) for d in docs) > 65535
    assert sorted(tok.decode(d[:-1]) for d in docs) == sorted(t for t in TEXTS if t)
    # transformers' save_pretrained writes tokenizer_config.json beside it: its eos_token decides.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|reserved_special_token_3|>"}}))
    assert BPETokenizer.load(path).eos_id == 128002 + 3


def test_prepare_ends_with_counts_and_stats_draws_the_lengths(tmp_path, corpora, capsys):
    out = tmp_path / "p"
    assert main(["data", "prepare", str(corpora["parquet"]), "--out", str(out), "--text-column", "content",
                 "--workers", "1", "--val-fraction", "0.1"]) == 0
    printed = capsys.readouterr().out
    assert "source " in printed and "2 file(s), 2 empty document(s) skipped" in printed
    assert "part-1.parquet" in printed and "document length in tokens (eos included): mean" in printed
    lengths = [len(t.encode()) + 1 for t in TEXTS if t]
    assert f"max {max(lengths):,}" in printed and f"min {min(lengths):,}" in printed
    assert main(["data", "stats", str(out)]) == 0
    again = capsys.readouterr().out
    assert again.startswith(printed.split("prepared:")[0]) and (out / "lengths.png").stat().st_size > 1000
    assert main(["data", "prepare", str(corpora["parquet"]), "--out", str(out), "--text-column", "content",
                 "--workers", "1", "--val-fraction", "0.1", "--overwrite"]) == 0  # the PNG is the folder's own
