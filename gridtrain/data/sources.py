"""Record sources read in batches, never whole: parquet, JSON lines (plain, .gz, .zst) and
Hugging Face `datasets` folders written by `save_to_disk` (Arrow IPC stream files, memory-mapped).

Each reader yields the text of every record, empty ones included (the caller counts and skips
them), and raises BadInput naming the file (and the line, for JSON lines) for anything it cannot
read: a corrupted file, a missing or non-text column, bytes that are not UTF-8.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from gridtrain.errors import BadInput
from gridtrain.inputs import read_json

BATCH_ROWS = 1024
"""Rows per record batch read from parquet and Arrow files: the most held in memory at once."""
JSON_LINES_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")
RECORD_SUFFIXES = (".parquet", ".arrow") + JSON_LINES_SUFFIXES
DATASET_MARKERS = ("state.json", "dataset_info.json")
"""A folder holding both is one split that `datasets.Dataset.save_to_disk` wrote."""


def record_kind(path: Path) -> str | None:
    """'parquet', 'arrow' or 'jsonl' for a record file by its name, else None."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    if name.endswith(JSON_LINES_SUFFIXES):
        return "jsonl"
    return None


def is_saved_dataset(path: Path) -> bool:
    """A `save_to_disk` folder: one dataset, or a DatasetDict (dataset_dict.json and a folder per split)."""
    return path.is_dir() and (all((path / m).is_file() for m in DATASET_MARKERS)
                              or (path / "dataset_dict.json").is_file())


def iter_records(path: Path, column: str = "text") -> Iterator[str]:
    """The `column` of every record of one record file (see record_kind), in file order."""
    kind = record_kind(path)
    if kind == "parquet":
        yield from _parquet_texts(path, column)
    elif kind == "arrow":
        yield from _arrow_texts(path, column)
    elif kind == "jsonl":
        yield from json_lines_texts(path, column)
    else:
        raise BadInput(f"{path}: not a record file (expected one of {', '.join(RECORD_SUFFIXES)})")


def saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder in their order (its 'train' split for a DatasetDict)."""
    if (path / "dataset_dict.json").is_file():
        splits = _json_field(path / "dataset_dict.json", "splits")
        if "train" not in splits:
            raise BadInput(f"{path} is a saved DatasetDict without a 'train' split (splits: {', '.join(splits)}): "
                           f"give the folder of one split, e.g. {path / splits[0]}" if splits else
                           f"{path} is a saved DatasetDict without splits")
        path = path / "train"
    files = _json_field(path / "state.json", "_data_files")
    names = [f.get("filename") if isinstance(f, dict) else None for f in files]
    if not names or not all(isinstance(n, str) and "/" not in n and n.endswith(".arrow") for n in names):
        raise BadInput(f"{path / 'state.json'} lists no Arrow files in _data_files: save the dataset again")
    return [path / n for n in names]


def _json_field(path: Path, key: str) -> Any:
    """`key` of a JSON file handed over with a dataset, read through the input boundary (a regular
    file, of bounded size, before it is parsed)."""
    try:
        value = read_json(path, str(path))[key]
    except (KeyError, TypeError) as err:
        raise BadInput(f"{path} is not what datasets' save_to_disk writes ({type(err).__name__}: {err})") from None
    if not isinstance(value, list):
        raise BadInput(f"{path}: {key} is a {type(value).__name__}, not a list")
    return value


def check_record_file(path: Path, column: str) -> None:
    """Open a parquet or Arrow file's schema (its footer or first message) and check `column`:
    BadInput for a corrupted file or a missing or non-text column. Reads no rows."""
    kind = record_kind(path)
    if kind == "parquet":
        _text_column_index(_open_parquet(path).schema_arrow, column, path)
    elif kind == "arrow":
        with _ArrowBatches(path) as reader:
            _text_column_index(reader.schema, column, path)


def _open_parquet(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, memory_map=True)
    except (pa.ArrowException, OSError) as err:
        raise BadInput(f"{path} is not a readable parquet file ({_first_line(err)})") from None


def _parquet_texts(path: Path, column: str) -> Iterator[str]:
    import pyarrow as pa

    pf = _open_parquet(path)
    _text_column_index(pf.schema_arrow, column, path)
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=[column]):
            yield from _column_texts(batch.column(0), path, column)
    except (pa.ArrowException, OSError) as err:
        raise BadInput(f"{path} is not a readable parquet file ({_first_line(err)})") from None


class _ArrowBatches:
    """A `datasets` Arrow file (IPC stream; or IPC file format) opened memory-mapped."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Any:
        import pyarrow as pa

        try:
            self.source = pa.memory_map(str(self.path))
        except (pa.ArrowException, OSError) as err:
            raise BadInput(f"{self.path} cannot be read ({_first_line(err)})") from None
        try:
            return pa.ipc.open_stream(self.source)
        except (pa.ArrowException, OSError):
            pass
        try:
            reader = pa.ipc.open_file(self.source)
        except (pa.ArrowException, OSError) as err:
            self.source.close()
            raise BadInput(f"{self.path} is not a readable Arrow file ({_first_line(err)})") from None
        return _FileBatches(reader)

    def __exit__(self, *exc: object) -> None:
        self.source.close()


class _FileBatches:
    """An Arrow IPC file reader seen as a stream of record batches."""

    def __init__(self, reader: Any) -> None:
        self.reader, self.schema = reader, reader.schema

    def __iter__(self) -> Iterator[Any]:
        return (self.reader.get_batch(i) for i in range(self.reader.num_record_batches))


def _arrow_texts(path: Path, column: str) -> Iterator[str]:
    import pyarrow as pa

    with _ArrowBatches(path) as reader:
        index = _text_column_index(reader.schema, column, path)
        try:
            for batch in reader:
                # A datasets batch may hold many rows: slice it so that Python strings stay few.
                for start in range(0, batch.num_rows, BATCH_ROWS):
                    yield from _column_texts(batch.column(index).slice(start, BATCH_ROWS), path, column)
        except (pa.ArrowException, OSError) as err:
            raise BadInput(f"{path} is not a readable Arrow file ({_first_line(err)})") from None


def _text_column_index(schema: Any, column: str, path: Path) -> int:
    import pyarrow as pa

    index = schema.get_field_index(column)
    if index < 0:
        names = ", ".join(schema.names[:12]) + (" ..." if len(schema.names) > 12 else "")
        raise BadInput(f"{path} has no column '{column}' (its columns: {names}): set data.text_column "
                       "(gridtrain data prepare --text-column) to the one that holds the text")
    kind = schema.field(index).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind) or pa.types.is_string_view(kind)):
        raise BadInput(f"{path}: column '{column}' holds {kind}, not text: set data.text_column "
                       "(gridtrain data prepare --text-column) to the one that holds the text")
    return index


def _column_texts(array: Any, path: Path, column: str) -> Iterator[str]:
    """A column's values as strings: a null is an empty document; bytes must be UTF-8."""
    for i, value in enumerate(array.to_pylist()):
        if value is None:
            yield ""
        elif isinstance(value, bytes):
            try:
                yield value.decode("utf-8")
            except UnicodeDecodeError as err:
                raise BadInput(f"{path}: a value of column '{column}' is not valid UTF-8 ({err})") from None
        else:
            yield value


def _open_bytes(path: Path) -> BinaryIO:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def json_lines_texts(path: Path, column: str = "text") -> Iterator[str]:
    """The `column` string of every line of a JSON-lines file, plain, gzip or zstd; blank lines skipped."""
    with _open_bytes(path) as f:
        line_no = 0
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError, ValueError) as err:  # gzip's BadGzipFile, zstd's ZstdError
                raise BadInput(f"{path}:{line_no + 1} cannot be decompressed ({_first_line(err)})") from None
            if not raw:
                return
            line_no += 1
            text = _json_line_text(raw, path, line_no, column)
            if text is not None:
                yield text


def _json_line_text(raw: bytes, path: Path, line_no: int, column: str) -> str | None:
    """The line's text ('' for a null), or None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadInput(f"{path}:{line_no} is not valid UTF-8 ({err})") from None
    if not line.strip():
        return None
    try:
        text = json.loads(line)[column]
        if text is None:
            return ""
        if not isinstance(text, str):
            raise TypeError(f"'{column}' is a {type(text).__name__}, not a string")
    except (json.JSONDecodeError, KeyError, TypeError, IndexError, RecursionError) as err:
        raise BadInput(f"{path}:{line_no}: expected a JSON object with a '{column}' field "
                       f"({type(err).__name__}: {err})") from None
    return text


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
