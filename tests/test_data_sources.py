"""Record sources: parquet files and folders, JSON lines plain/.gz/.zst, save_to_disk folders,
each made here and read back as the documents written, in batches; bad files refused in one line."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from gridtrain.data import sources
from gridtrain.data.corpus import iter_documents, iter_texts, source_files
from gridtrain.errors import BadInput

DOCS = [f"document {i}: " + "wörd " * (i % 7) for i in range(50)] + ["", "last one"]


def write_parquet(path, texts, column="text", row_group_size=8):
    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), path, row_group_size=row_group_size)


def write_jsonl(path, texts, column="text"):
    data = "".join(json.dumps({column: t, "meta": 1}) + "\n" for t in texts).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def save_dataset(path, texts):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path), max_shard_size="1KB")


def test_parquet_file_and_folder_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BATCH_ROWS", 5)  # several batches per row group and file
    write_parquet(tmp_path / "one.parquet", DOCS)
    assert list(iter_texts(tmp_path / "one.parquet")) == DOCS
    assert list(iter_documents(tmp_path / "one.parquet")) == [d for d in DOCS if d]
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    write_parquet(folder / "b.parquet", DOCS[20:], column="content")
    write_parquet(folder / "sub" / "a.parquet", DOCS[:20], column="content")  # sorted walk: b, then sub/a
    assert list(iter_texts(folder, column="content")) == DOCS[20:] + DOCS[:20]
    with pytest.raises(BadInput, match=r"has no column 'text' \(its columns: content, id\): set data.text_column"):
        list(iter_texts(folder))


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.jsonl.zst", "c.json.zst"])
def test_json_lines_plain_and_compressed(tmp_path, name):
    write_jsonl(tmp_path / name, DOCS, column="body")
    assert list(iter_texts(tmp_path / name, column="body")) == DOCS
    with pytest.raises(BadInput, match=rf"{name}:1: expected a JSON object with a 'text' field"):
        list(iter_texts(tmp_path / name))


def test_saved_dataset_and_dataset_dict(tmp_path):
    save_dataset(tmp_path / "saved", DOCS)
    files = source_files(tmp_path / "saved")
    assert len(files) > 1 and all(f.suffix == ".arrow" for f in files)  # several shards, read in order
    assert list(iter_texts(tmp_path / "saved")) == DOCS
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:3]}),
                          "test": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    assert list(iter_texts(tmp_path / "dd")) == DOCS[:3]


def test_bad_record_files_are_one_line(tmp_path):
    write_parquet(tmp_path / "good.parquet", DOCS)
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInput, match="cut.parquet is not a readable parquet file"):
        list(iter_texts(tmp_path / "cut.parquet"))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(BadInput, match="column 'text' holds int64, not text"):
        sources.check_record_file(tmp_path / "ints.parquet", "text")
    pq.write_table(pa.table({"text": pa.array([b"ok", b"\xff\xfe"], pa.binary())}), tmp_path / "bytes.parquet")
    with pytest.raises(BadInput, match="a value of column 'text' is not valid UTF-8"):
        list(iter_texts(tmp_path / "bytes.parquet"))
    (tmp_path / "bad.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "ok"}\n{"text": "\xff"}\n'))
    with pytest.raises(BadInput, match=r"bad.jsonl.zst:2 is not valid UTF-8"):
        list(iter_texts(tmp_path / "bad.jsonl.zst"))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n' * 1000)[:60])
    with pytest.raises(BadInput, match=r"cut.jsonl.gz:\d+ cannot be decompressed"):
        list(iter_texts(tmp_path / "cut.jsonl.gz"))


def test_a_saved_datasets_json_goes_through_the_input_boundary(tmp_path):
    """state.json of a handed-over save_to_disk folder is read as any input is: a FIFO (which
    would block the read for ever) is refused in one line, before anything parses it."""
    import os

    from gridtrain.data.sources import saved_dataset_files
    from gridtrain.errors import UserError

    folder = tmp_path / "ds"
    folder.mkdir()
    os.mkfifo(folder / "state.json")
    with pytest.raises(UserError, match="state.json"):
        saved_dataset_files(folder)


def test_a_readable_source_is_walked_once_a_process_only_when_asked(tmp_path, monkeypatch):
    """source_problem walks a folder at every check, so a file broken since the last one is
    found before launch; a process that validates many runs on an unchanging corpus (a parity
    launch) asks it to walk a readable source once. A missing source is found every time."""
    from gridtrain.data import corpus

    (tmp_path / "a").mkdir()
    write_parquet(tmp_path / "a" / "part-0.parquet", DOCS)
    assert corpus.source_problem(tmp_path / "a") is None
    (tmp_path / "a" / "b.parquet").write_bytes(b"PA")  # broken after a check: found by the next
    assert "b.parquet" in corpus.source_problem(tmp_path / "a")
    (tmp_path / "a" / "b.parquet").unlink()
    walks = []
    monkeypatch.setattr(corpus, "_SOURCES_READ", None)
    monkeypatch.setattr(corpus, "source_files", lambda path: walks.append(path) or [path / "part-0.parquet"])
    corpus.remember_readable_sources()
    assert corpus.source_problem(tmp_path / "a") is None and corpus.source_problem(tmp_path / "a") is None
    assert len(walks) == 1
    assert corpus.source_problem(tmp_path / "a", "content") is not None  # another column: walked again
    (tmp_path / "a" / "part-0.parquet").unlink()
    (tmp_path / "a").rmdir()
    assert "not found" in corpus.source_problem(tmp_path / "a")
