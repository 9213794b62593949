"""Where training text comes from: a file, a JSON-lines file, or a directory tree of text files."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

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


def iter_documents(source: str | Path) -> Iterator[str]:
    """Yield the non-empty documents of `source` in a deterministic order.

    A file is one document, except a `.jsonl` file, or a `.json` file whose first line is a JSON
    object with a "text" field: there each line's "text" is a document. A directory is walked
    recursively in sorted order, reading files with a suffix in TEXT_SUFFIXES and skipping hidden
    entries, SKIP_DIRS and files that are not valid UTF-8.
    """
    path = Path(source)
    if not path.exists():
        raise MissingInput(f"corpus not found: {path} (give a text file, a .jsonl file "
                                "with a 'text' field per line, or a directory of text files)")
    if path.is_file():
        yield from _file_documents(path, strict=True)
        return
    other: list[Path] = []
    undecodable: list[Path] = []
    for file in _walk_text_files(path, other):
        yield from _file_documents(file, strict=False, undecodable=undecodable)
    if other or undecodable:  # said once, after the walk: nothing is dropped in silence
        logger.info("%s: skipped %s", path, "; ".join(
            f"{len(files):,} {'entry' if len(files) == 1 else 'entries'} {why} "
            f"(e.g. {', '.join(str(f.relative_to(path)) for f in files[:3])})"
            for why, files in (("not read as text (by suffix, see TEXT_SUFFIXES; a linked folder; not a regular file)", other),
                               ("not valid UTF-8", undecodable)) if files))


def _walk_text_files(root: Path, other: list[Path]) -> Iterator[Path]:
    """Text files under `root` in sorted order; the visible files of other suffixes go to `other`."""
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning and sorting in place steers os.walk itself: deterministic and never descends.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        other.extend(Path(dirpath) / d for d in dirnames if (Path(dirpath) / d).is_symlink())  # not followed
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            if Path(name).suffix.lower() in TEXT_SUFFIXES and file_problem(Path(dirpath) / name) is None:
                yield Path(dirpath) / name  # a regular file: a link to /dev/zero or a fifo is never read
            else:
                other.append(Path(dirpath) / name)


def _file_documents(path: Path, strict: bool, undecodable: list[Path] | None = None) -> Iterator[str]:
    """Documents of one file; `strict` raises on undecodable text instead of skipping it (and
    listing it in `undecodable`)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        if strict and _is_json_lines(path):
            yield from _json_lines_documents(path)  # names the line that is not UTF-8
            return
        if strict:
            raise BadInput(f"{path} is not valid UTF-8: {err}") from None
        logger.debug("skipping %s: not valid UTF-8 (%s)", path, err)
        if undecodable is not None:
            undecodable.append(path)
        return
    if _is_json_lines(path):
        yield from _json_lines_documents(path)
    elif text:
        yield text


def _is_json_lines(path: Path) -> bool:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return True
    if suffix != ".json":
        return False
    # A .json file may be ordinary JSON (config, test data) or JSON lines: peek at line one.
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline()
        obj = json.loads(first)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return isinstance(obj, dict) and "text" in obj


def _json_lines_documents(path: Path) -> Iterator[str]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise BadInput(f"{path}:{line_no} is not valid UTF-8 ({err})") from None
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
                if not isinstance(text, str):
                    raise TypeError(f"'text' is a {type(text).__name__}, not a string")
            except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as err:
                raise BadInput(f"{path}:{line_no}: expected a JSON object with a 'text' field "
                                 f"({type(err).__name__}: {err})") from None
            if text:
                yield text
