"""Where training text comes from: a text, parquet, Arrow or JSON-lines file, a saved dataset, or a
directory tree of them."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from gridtrain.data.sources import (check_record_file, is_saved_dataset, iter_records, json_lines_texts, record_kind,
                                    saved_dataset_files)
from gridtrain.errors import BadInput, MissingInput
from gridtrain.inputs import file_problem

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({
    ".py", ".pyi", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".cc", ".cpp", ".hpp",
    ".rs", ".go", ".java", ".js", ".ts", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini",
    ".html", ".css", ".tex",
})
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "node_modules"})


def default_corpus() -> Path:
    """The source directory of the running interpreter's standard library: real text anywhere."""
    return Path(os.__file__).parent.resolve()


def iter_documents(source: str | Path, column: str = "text") -> Iterator[str]:
    """Yield the non-empty documents of `source` in a deterministic order (iter_texts, empty ones left out)."""
    return (text for text in iter_texts(source, column) if text)


def iter_texts(source: str | Path, column: str = "text") -> Iterator[str]:
    """Every document of `source` in a deterministic order, empty ones included (iter_file_texts)."""
    return (text for _, text in iter_file_texts(source, column))


def iter_file_texts(source: str | Path, column: str = "text") -> Iterator[tuple[Path, str]]:
    """Yield (file, text) for every document of `source` in a deterministic order, empty ones included.

    A record file is read in batches (gridtrain.data.sources): parquet and Arrow files give their
    `column`, JSON lines (plain, .gz, .zst; a `.json` file whose first line is a JSON object with
    the field too) give each line's `column` field. A folder that `datasets`' save_to_disk wrote
    gives its Arrow files. Any other file is one document. A directory is walked recursively in
    sorted order, reading record files and files with a suffix in TEXT_SUFFIXES and skipping hidden
    entries, SKIP_DIRS and text files that are not valid UTF-8 (a record file that is not is refused).
    """
    path = Path(source)
    if not path.exists():
        raise MissingInput(f"corpus not found: {path} (give a text file, a parquet file, JSON lines, a folder "
                           "that datasets' save_to_disk wrote, or a directory of those)")
    if path.is_file():
        yield from ((path, text) for text in _file_documents(path, column, strict=True))
        return
    other: list[Path] = []
    undecodable: list[Path] = []
    for file in _walk_files(path, other):
        yield from ((file, text) for text in _file_documents(file, column, strict=False, undecodable=undecodable))
    if other or undecodable:  # said once, after the walk: nothing is dropped in silence
        logger.info("%s: skipped %s", path, "; ".join(
            f"{len(files):,} {'entry' if len(files) == 1 else 'entries'} {why} "
            f"(e.g. {', '.join(str(f.relative_to(path)) for f in files[:3])})"
            for why, files in (("not read as text (by suffix, see TEXT_SUFFIXES; a linked folder; not a regular file)", other),
                               ("not valid UTF-8", undecodable)) if files))


def source_files(source: str | Path) -> list[Path]:
    """The files iter_texts reads for `source`, in its order (each Arrow file of a saved dataset)."""
    path = Path(source)
    if path.is_file():
        return [path]
    return list(_walk_files(path, []))


def _walk_files(root: Path, other: list[Path]) -> Iterator[Path]:
    """Record and text files under `root` in sorted order (a saved dataset's Arrow files in its own
    order); the visible files of other suffixes go to `other`."""
    for dirpath, dirnames, filenames in os.walk(root):
        if is_saved_dataset(Path(dirpath)):
            dirnames[:] = []
            yield from saved_dataset_files(Path(dirpath))
            continue
        # Pruning and sorting in place steers os.walk itself: deterministic and never descends.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        other.extend(Path(dirpath) / d for d in dirnames if (Path(dirpath) / d).is_symlink())  # not followed
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            readable = Path(name).suffix.lower() in TEXT_SUFFIXES or record_kind(Path(name)) is not None
            if readable and file_problem(Path(dirpath) / name) is None:
                yield Path(dirpath) / name  # a regular file: a link to /dev/zero or a fifo is never read
            else:
                other.append(Path(dirpath) / name)


def _file_documents(path: Path, column: str, strict: bool,
                    undecodable: list[Path] | None = None) -> Iterator[str]:
    """Documents of one file, empty ones included; `strict` raises on undecodable text instead of
    skipping it (and listing it in `undecodable`). Record files are always strict."""
    if record_kind(path) is not None:
        yield from iter_records(path, column)
        return
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        if strict and _is_json_lines(path):
            yield from json_lines_texts(path, column)  # names the line that is not UTF-8
            return
        if strict:
            raise BadInput(f"{path} is not valid UTF-8: {err}") from None
        logger.debug("skipping %s: not valid UTF-8 (%s)", path, err)
        if undecodable is not None:
            undecodable.append(path)
        return
    if _is_json_lines(path, column):
        yield from json_lines_texts(path, column)
    else:
        yield text


def _is_json_lines(path: Path, column: str = "text") -> bool:
    if path.suffix.lower() != ".json":
        return False
    # A .json file may be ordinary JSON (config, test data) or JSON lines: peek at line one.
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline()
        obj = json.loads(first)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return isinstance(obj, dict) and column in obj


_SOURCES_READ: set[tuple[str, str]] | None = None
"""(source, column) pairs source_problem found readable in this process, once a process that
validates many runs on an unchanging corpus asks it to (remember_readable_sources); None: every
check walks the source."""


def remember_readable_sources() -> None:
    """Let source_problem walk a source it found readable only once in this process: for a process
    that validates many runs on a corpus nothing changes meanwhile (a parity launch of many cases
    on the standard library walked its 12,000 files twice a case, 15% of the case's time). Its
    files are not looked at again, so a file broken later is named only when it is read."""
    global _SOURCES_READ
    if _SOURCES_READ is None:
        _SOURCES_READ = set()


def source_problem(source: str | Path, column: str = "text") -> str | None:
    """Why `source` cannot be read, found before anything is written (a missing path; a parquet or
    Arrow file whose footer or schema is broken or lacks `column`; a JSON-lines file whose first
    record lacks it), or None. Reads schemas and first lines only: bytes further in are checked
    as they are read; after remember_readable_sources, a source found readable is not walked again."""
    path = Path(source)
    if not path.exists():
        return (f"corpus {source} not found: give a text file, a parquet file, JSON lines (.jsonl, .gz, .zst), a folder "
                "that datasets' save_to_disk wrote, or a directory of those")
    key = (str(path.resolve()), column)
    if _SOURCES_READ is not None and key in _SOURCES_READ:
        return None
    try:
        for file in source_files(path):
            if record_kind(file) in ("parquet", "arrow"):
                check_record_file(file, column)
            elif record_kind(file) == "jsonl":
                next(iter(json_lines_texts(file, column)), None)
    except BadInput as err:
        return str(err)
    if _SOURCES_READ is not None:
        _SOURCES_READ.add(key)
    return None
