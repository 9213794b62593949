import json
import os

import numpy as np
import pytest
import torch

from gridtrain.data import shards
from gridtrain.data.corpus import iter_documents
from gridtrain.data.sampler import BatchReader, SampleOrder, ValReader
from gridtrain.data.shards import TokenStore, ensure_prepared, load_index, prepare
from gridtrain.data.tokenizer import BPETokenizer, ByteTokenizer, build_tokenizer


def make_corpus(root, num_docs=40, seed=0):
    """A directory of small .py/.txt documents (plus files that must be skipped)."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "import", "numpy", "é", "日本", "λ", "token", "shard"]
    docs = {}
    for i in range(num_docs):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        text = " ".join(rng.choice(words, size=int(rng.integers(5, 60)))) + f"\n# doc {i}\n"
        path = sub / f"m{i:03d}.{'py' if i % 2 else 'txt'}"
        path.write_text(text, encoding="utf-8")
        docs[path] = text
    (root / "pkg0" / "bad.py").write_bytes(b"caf\xe9 latin-1\n")
    (root / "pkg0" / "binary.so").write_bytes(b"\x00\x01")
    (root / "pkg0" / "empty.py").write_text("")
    for skipped in ("__pycache__", ".hidden", "site-packages"):
        (root / skipped).mkdir()
        (root / skipped / "x.py").write_text("skip me")
    return [docs[p] for p in sorted(docs)]


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    return root, make_corpus(root)


def all_split_docs(out_dir, split):
    store = TokenStore(out_dir, split)
    stream = store.read(0, store.num_tokens)
    bounds = list(store.doc_starts) + [store.num_tokens]
    return [stream[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "hello, wörld: 日本語 λ→∞ 🙂\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(list(ids) + [tok.eos_id] + list(tok.encode("b"))) == text + "<eos>b"
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.decode([0xE6]) == "\ufffd"


def test_bpe_train_save_load_round_trip(tmp_path, corpus):
    _, docs = corpus
    path = tmp_path / "tok" / "tokenizer.json"
    tok = BPETokenizer.train(docs, vocab_size=300, save_path=path)
    assert tok.vocab_size == 300
    loaded = BPETokenizer.load(path)
    text = "def numpy(self): return 日本 é λ"
    assert loaded.decode(loaded.encode(text)) == text
    assert list(loaded.encode(text)) == list(tok.encode(text))
    assert len(tok.encode(docs[0])) < len(docs[0].encode("utf-8"))
    assert (loaded.name, loaded.eos_id) == (tok.name, tok.eos_id)
    assert loaded.decode([loaded.eos_id]) == "<eos>"
    with pytest.raises(ValueError, match="vocab_size"):
        BPETokenizer.train(docs, vocab_size=100)


def test_build_tokenizer_specs(tmp_path, corpus):
    root, _ = corpus
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    cache = tmp_path / "cache"
    tok = build_tokenizer("bpe:280", corpus=str(root), cache_dir=cache)
    (saved,) = cache.glob("tokenizer-bpe280-*.json")
    mtime = saved.stat().st_mtime_ns
    again = build_tokenizer("bpe:280", corpus=str(root), cache_dir=cache)
    assert saved.stat().st_mtime_ns == mtime and again.name == tok.name
    assert build_tokenizer(str(saved)).name == tok.name
    with pytest.raises(ValueError, match="'byte', 'bpe:N'"):
        build_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="bpe:N"):
        build_tokenizer("bpe:lots", corpus=str(root), cache_dir=cache)


def test_iter_documents_dir_file_jsonl(tmp_path, corpus):
    root, docs = corpus
    assert list(iter_documents(root)) == docs
    assert list(iter_documents(str(root))) == docs
    one = root / "pkg1" / "m001.py"
    assert list(iter_documents(one)) == [one.read_text()]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(docs[:5])))
    assert list(iter_documents(jsonl)) == docs[:5]
    plain_json = tmp_path / "cfg.json"
    plain_json.write_text('{"a": 1}\n')
    assert list(iter_documents(plain_json)) == ['{"a": 1}\n']
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"no_text": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(iter_documents(bad))
    with pytest.raises(FileNotFoundError, match="corpus not found"):
        list(iter_documents(tmp_path / "missing"))


def test_prepare_index_totals_and_disjoint_splits(tmp_path, corpus):
    root, docs = corpus
    tok = ByteTokenizer()
    out = prepare(root, tok, tmp_path / "prepared", val_fraction=0.2, seed=3, shard_tokens=500)
    index = load_index(out)
    expected_tokens = sum(len(tok.encode(d)) + 1 for d in docs)
    assert index["num_tokens"] == expected_tokens and index["num_docs"] == len(docs)
    assert (index["vocab_size"], index["eos_id"], index["dtype"]) == (257, 256, "uint16")
    for split in ("train", "val"):
        info = index["splits"][split]
        assert info["num_tokens"] == sum(s["num_tokens"] for s in info["shards"])
        assert all(s["num_tokens"] <= 500 for s in info["shards"])
        assert info["num_docs"] >= 1
    assert len(index["splits"]["train"]["shards"]) > 1
    encoded = {tuple(tok.encode(d)) + (tok.eos_id,) for d in docs}
    assert len(encoded) == len(docs)
    train = [tuple(d) for d in all_split_docs(out, "train")]
    val = [tuple(d) for d in all_split_docs(out, "val")]
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(encoded)
    assert not list(tmp_path.glob(".prepared*"))


def test_prepare_is_deterministic_and_seeded(tmp_path, corpus):
    root, _ = corpus
    tok = ByteTokenizer()
    a = prepare(root, tok, tmp_path / "a", val_fraction=0.3, seed=0)
    b = prepare(root, tok, tmp_path / "b", val_fraction=0.3, seed=0)
    c = prepare(root, tok, tmp_path / "c", val_fraction=0.3, seed=1)
    assert (a / "val-00000.bin").read_bytes() == (b / "val-00000.bin").read_bytes()
    assert (a / "val-00000.bin").read_bytes() != (c / "val-00000.bin").read_bytes()


def test_prepare_single_document_and_refusals(tmp_path):
    single = tmp_path / "input.txt"
    single.write_text("to be or not to be " * 50)
    out = prepare(single, ByteTokenizer(), tmp_path / "one", val_fraction=0.1)
    index = load_index(out)
    assert index["splits"]["train"]["num_docs"] == index["splits"]["val"]["num_docs"] == 1
    assert index["splits"]["val"]["num_tokens"] == 95 + 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no documents"):
        prepare(tmp_path / "empty", ByteTokenizer(), tmp_path / "out")
    keep = tmp_path / "precious"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a prepared directory"):
        prepare(single, ByteTokenizer(), keep)
    assert (keep / "notes.txt").read_text() == "mine"


def test_prepare_replaces_previous_output_only_when_asked(tmp_path, corpus):
    root, _ = corpus
    out = prepare(root, ByteTokenizer(), tmp_path / "p", val_fraction=0.1, shard_tokens=100)
    many = len(load_index(out)["splits"]["train"]["shards"])
    index = (out / "index.json").read_bytes()
    with pytest.raises(FileExistsError, match="already holds a prepared dataset: pass --overwrite"):
        prepare(root, ByteTokenizer(), out, val_fraction=0.1)
    assert (out / "index.json").read_bytes() == index
    prepare(root, ByteTokenizer(), out, val_fraction=0.1, overwrite=True)
    assert many > 1 and len(load_index(out)["splits"]["train"]["shards"]) == 1
    assert not (out / "train-00001.bin").exists()


def test_prepare_never_deletes_a_users_file_beside_the_shards(tmp_path, corpus, capsys):
    """The user's NOTES.txt beside a prepared dataset survives a second `data prepare`, with or
    without --overwrite: both refuse, naming the file."""
    from gridtrain.cli import main

    root, _ = corpus
    out = prepare(root, ByteTokenizer(), tmp_path / "p", val_fraction=0.1)
    (out / "NOTES.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for flags in ([], ["--overwrite"]):
        assert main(["data", "prepare", str(root), "--out", str(out), "--cache-dir", str(tmp_path / "c"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gridtrain: ") and "Traceback" not in err
        assert ("NOTES.txt" in err) == bool(flags)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_token_store_reads_across_shards(tmp_path, corpus):
    root, docs = corpus
    out = prepare(root, ByteTokenizer(), tmp_path / "p", val_fraction=0.1, shard_tokens=64)
    store = TokenStore(out, "train")
    index = load_index(out)
    shard_files = [s["file"] for s in index["splits"]["train"]["shards"]]
    full = np.concatenate([np.fromfile(out / f, dtype=np.uint16) for f in shard_files])
    assert len(store) == store.num_tokens == len(full) > 64 * 3
    for start, length in [(0, 64), (60, 10), (63, 1), (50, 200), (0, len(full)), (len(full), 0)]:
        np.testing.assert_array_equal(store.read(start, length), full[start:start + length])
    assert store.doc_starts[0] == 0 and np.all(np.diff(store.doc_starts) > 0)
    assert np.all(full[store.doc_starts[1:] - 1] == store.eos_id)
    assert (store.vocab_size, store.eos_id) == (257, 256)
    with pytest.raises(IndexError):
        store.read(len(full) - 5, 6)
    with pytest.raises(ValueError, match="no split 'test'"):
        TokenStore(out, "test")
    with pytest.raises(FileNotFoundError, match="not a prepared data directory"):
        TokenStore(tmp_path, "train")


def test_sample_order_is_seeded_permutation_per_epoch():
    order = SampleOrder(num_samples=50, seed=7)
    epoch0 = [order.window(g) for g in range(50)]
    epoch1 = [order.window(g) for g in range(50, 100)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1
    assert [SampleOrder(50, 7).window(g) for g in range(100)] == epoch0 + epoch1
    assert [SampleOrder(50, 8).window(g) for g in range(50)] != epoch0
    assert list(order.windows(30, 45)) == [order.window(g) for g in range(30, 75)]
    assert order.window(10**9) == SampleOrder(50, 7).window(10**9)


@pytest.fixture
def prepared(tmp_path, corpus):
    root, _ = corpus
    return prepare(root, ByteTokenizer(), tmp_path / "p", val_fraction=0.2, shard_tokens=256)


def test_batch_reader_shift_and_data_parallel_slices(prepared):
    store = TokenStore(prepared, "train")
    reader = BatchReader(store, seq_len=16, seed=0)
    assert reader.num_samples == (store.num_tokens - 1) // 16
    batch_size, step = 8, 3
    inputs, targets = reader.read(step * batch_size, batch_size)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (batch_size, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for num_ranks in (1, 2, 4):
        per_rank = batch_size // num_ranks
        parts = [BatchReader(store, 16, seed=0).read(step * batch_size + r * per_rank, per_rank)
                 for r in range(num_ranks)]
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), targets)
    first = reader.order.window(step * batch_size)
    window = store.read(first * 16, 17).astype(np.int64)
    assert torch.equal(inputs[0], torch.from_numpy(window[:-1]))
    assert not torch.equal(BatchReader(store, 16, seed=1).read(24, 8)[0], inputs)
    wrapped = reader.read(reader.num_samples - 3, 6)[0]
    assert wrapped.shape == (6, 16)


def test_readers_reject_too_short_streams(prepared):
    store = TokenStore(prepared, "val")
    with pytest.raises(ValueError, match=rf"{store.num_tokens} tokens.*seq_len="):
        BatchReader(store, seq_len=store.num_tokens, seed=0)
    with pytest.raises(ValueError, match="smaller seq_len"):
        ValReader(store, seq_len=store.num_tokens + 5)


def test_val_reader_fixed_order(prepared):
    store = TokenStore(prepared, "val")
    reader = ValReader(store, seq_len=8)
    batches = list(reader.batches(batch_size=4, max_batches=3))
    assert len(batches) == min(3, -(-reader.num_samples // 4))
    inputs = torch.cat([b[0] for b in batches])
    stream = torch.from_numpy(store.read(0, len(inputs) * 8 + 1).astype(np.int64))
    assert torch.equal(inputs.flatten(), stream[:-1])
    again = torch.cat([b[0] for b in reader.batches(batch_size=4, max_batches=3)])
    assert torch.equal(inputs, again)


def test_ensure_prepared_caches(tmp_path, corpus, monkeypatch):
    root, _ = corpus
    calls = []
    real_prepare = shards.prepare
    monkeypatch.setattr(shards, "prepare", lambda *a, **k: calls.append(1) or real_prepare(*a, **k))
    cache = tmp_path / "cache"
    first = ensure_prepared(str(root), "byte", cache, val_fraction=0.1, seed=0)
    mtime = os.stat(first / "index.json").st_mtime_ns
    assert ensure_prepared(root, "byte", cache, val_fraction=0.1, seed=0) == first
    assert len(calls) == 1 and os.stat(first / "index.json").st_mtime_ns == mtime
    assert ensure_prepared(first, "byte", cache, val_fraction=0.5, seed=9) == first.resolve()
    other = ensure_prepared(root, "byte", cache, val_fraction=0.1, seed=1)
    assert other != first and len(calls) == 2
    with pytest.raises(FileNotFoundError):
        ensure_prepared(tmp_path / "nope", "byte", cache)


class TinyTokenizer:
    """A Protocol-only tokenizer (no encode_batch) whose ids overflow its vocab."""

    name, vocab_size, eos_id = "tiny", 10, 9

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_failed_prepare_leaves_nothing(tmp_path, corpus):
    root, _ = corpus
    with pytest.raises(ValueError, match="vocab_size 10"):
        prepare(root, TinyTokenizer(), tmp_path / "p")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_a_directory_corpus_names_the_files_it_skips(tmp_path, caplog):
    """Files of other suffixes, linked folders and files that are not UTF-8 are left out of a
    directory corpus, and said so, with their number and a few names (they used to vanish)."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("kept")
    (root / "b.png").write_bytes(b"\x89PNG")
    (root / "c.bin").write_bytes(b"\x00")
    (root / "d.txt").write_bytes(b"\xff\xfe broken")
    (root / ".hidden.bin").write_bytes(b"\x00")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "e.txt").write_text("in a folder the corpus links to")
    (root / "linked").symlink_to(tmp_path / "elsewhere")
    with caplog.at_level("INFO", logger="gridtrain.data.corpus"):
        assert list(iter_documents(root)) == ["kept"]
    assert f"{root}: skipped 3 entries not read as text (by suffix, see TEXT_SUFFIXES; a linked folder; not a " \
           "regular file) (e.g. linked, b.png, c.bin); 1 entry not valid UTF-8 (e.g. d.txt)" in caplog.text


def test_json_lines_that_are_not_utf8_are_named_by_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid UTF-8"):
        list(iter_documents(bad))


def test_prepare_removes_the_folders_a_killed_prepare_left(tmp_path, corpus):
    """A prepare killed by SIGKILL leaves its `.<name>.tmp-HOST-PID-*` folder (or `.old-`); the next
    prepare beside it removes those whose process is gone on this host, and nothing else: not a
    live prepare's, not another host's, not a name off the pattern, not a file."""
    import socket
    import subprocess
    import sys

    root, _ = corpus
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    host, live = socket.gethostname(), os.getpid()
    stale = [f".p.tmp-{host}-{gone.pid}-abcd_123", f".other.old-{host}-{gone.pid}-zz9zz9zz"]
    kept = [f".p.tmp-{host}-{live}-abcd_123", f".p.tmp-elsewhere-{gone.pid}-abcd_123", f".p.tmp-{host}-{gone.pid}",
            f"p.tmp-{host}-{gone.pid}-abcd_123", f".p.tmp-{host}-{gone.pid}-ABCD_123"]
    for name in stale + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "train-00000.bin").write_bytes(b"\0" * 100)
    (tmp_path / f".q.tmp-{host}-{gone.pid}-abcd_123.txt").write_text("a file, not a folder")
    (tmp_path / f".q.tmp-{host}-{gone.pid}-abcdefgh").write_text("a file of the folders' name")
    prepare(root, ByteTokenizer(), tmp_path / "p", val_fraction=0.1)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"corpus", "p", *kept, f".q.tmp-{host}-{gone.pid}-abcd_123.txt", f".q.tmp-{host}-{gone.pid}-abcdefgh"}
    assert (tmp_path / kept[0] / "train-00000.bin").is_file()
