"""`gridtrain data prepare`: tokenize a corpus in worker processes into memory-mapped shards, resumably.

The shards are built in `.<out>.partial` beside the output. A shard is written as `<name>.tmp` and
renamed when complete; every time the train split completes a shard, the open shards of both splits
are closed and `progress.json` (records read, shards, counts) is replaced atomically. A prepare that
is interrupted (Ctrl-C, a kill, a lost machine) continues from its last progress.json: files it does
not list (a half-written shard) are deleted, the records it covers are skipped unread by the
tokenizer. Only a finished prepare writes index.json and moves the folder into place, so a reader
never sees a half-written shard. Bad input (an exception) removes the folder: nothing is left.
A prepare holds an flock on `.lock` in that folder until it has published it (the lock moves with
the folder, and is removed after): a second prepare of the same output meanwhile is refused
(PrepareBusy), or waits for the first (`shards.ensure_prepared`), and looks at the output again
once it holds the lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gridtrain.data.corpus import iter_file_texts
from gridtrain.data.progress import Progress
from gridtrain.data.shards import (FORMAT_VERSION, INDEX_FILE, LOCK_FILE, SPLITS, _publish, assign_split,
                                   check_output, encode_with_eos, remove_stale_folders)
from gridtrain.data.tokenizer import Tokenizer
from gridtrain.errors import BadInput, ExistingOutput

logger = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
CHUNK_CHARS = 1_000_000
"""Characters of text sent to a worker at once."""


class ShardWriter:
    """Appends documents of one split to shards of at most `shard_tokens` tokens, recording where each
    document starts and each shard's sha256; a shard is `<name>.tmp` until it is closed."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, done: list[dict[str, Any]]) -> None:
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.done = list(done)
        """Shards recorded in progress.json."""
        self.closed: list[dict[str, Any]] = []
        """Shards closed since: a new progress.json is due when the train split has one."""
        self.num_docs = sum(s["num_docs"] for s in self.done)
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._fill = 0
        self._starts: list[int] = []

    def add_document(self, tokens: np.ndarray) -> None:
        self.num_docs += 1
        pos = 0
        while pos < len(tokens):
            if self._file is None or self._fill == self.shard_tokens:
                self._next_shard()
            if pos == 0:
                self._starts.append(self._fill)
            take = min(len(tokens) - pos, self.shard_tokens - self._fill)
            data = tokens[pos:pos + take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._fill += take
            pos += take

    def commit(self) -> list[dict[str, Any]]:
        """Close the open shard; every shard so far, as progress.json records them."""
        self._finish_shard()
        self.done += self.closed
        self.closed = []
        return self.done

    def _next_shard(self) -> None:
        self._finish_shard()
        stem = f"{self.split}-{len(self.done) + len(self.closed):05d}"
        self._file = open(self.out_dir / f"{stem}.bin.tmp", "wb")
        self._hash = hashlib.sha256()
        self.closed.append({"file": f"{stem}.bin", "docs_file": f"{stem}.docs.npy"})

    def _finish_shard(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        shard = self.closed[-1]
        with open(self.out_dir / f"{shard['docs_file']}.tmp", "wb") as f:
            np.save(f, np.asarray(self._starts, np.int64))
        for name in (shard["docs_file"], shard["file"]):  # the .bin last: its presence means both are whole
            os.replace(self.out_dir / f"{name}.tmp", self.out_dir / name)
        shard.update(num_tokens=self._fill, num_docs=len(self._starts), sha256=self._hash.hexdigest())
        self._fill, self._starts = 0, []


def prepare(source: str | Path, tokenizer: Tokenizer, out_dir: Path, val_fraction: float = 0.005,
            seed: int = 0, shard_tokens: int = 2**26, overwrite: bool = False, column: str = "text",
            workers: int = 1) -> Path:
    """Tokenize every document of `source` into train/val shards under `out_dir` (the module's
    docstring says how it resumes).

    Document i (counting non-empty documents) goes to val when a hash of (seed, i) falls below
    `val_fraction`; each split gets at least one document (a corpus of one document is cut in two).
    Empty documents are skipped and counted. `workers` > 1 tokenizes in that many processes; the
    shards are the same whatever their number. An existing prepared directory is replaced only with
    `overwrite`, and only when it holds nothing but a prepared dataset.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    out_dir = Path(out_dir)
    check_output(out_dir, overwrite)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32)
    settings = {"format_version": FORMAT_VERSION, "source": str(Path(source).resolve()), "column": column,
                "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                "dtype": dtype.name, "val_fraction": val_fraction, "seed": seed, "shard_tokens": shard_tokens}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_folders(out_dir.parent)
    work = out_dir.parent / f".{out_dir.name}.partial"
    work.mkdir(exist_ok=True)
    lock = _lock(work, out_dir, overwrite)
    try:
        state = _resume_state(work, settings)
        _write(state, work, Path(source), tokenizer, dtype, workers)
        (work / INDEX_FILE).write_text(json.dumps(_index(settings, state), indent=2) + "\n")
        (work / PROGRESS_FILE).unlink(missing_ok=True)
        _publish(work, out_dir)  # the lock moves with the folder: no one can take a new one beside this work
        (out_dir / LOCK_FILE).unlink(missing_ok=True)
    except Exception:
        shutil.rmtree(work, ignore_errors=True)  # bad input or a failure: nothing is left to resume
        raise
    finally:
        os.close(lock)
    return out_dir


class PrepareBusy(ExistingOutput):
    """Another process prepares the same output now (it holds `lock`)."""

    def __init__(self, work: Path, out_dir: Path) -> None:
        super().__init__(f"another prepare is writing {out_dir} now (in {work}): wait for it to finish "
                         "(it moves the result into place)")
        self.lock = work / LOCK_FILE

    def wait(self) -> None:
        """Until that process has published or stopped."""
        try:
            fd = os.open(self.lock, os.O_RDONLY)
        except OSError:  # published or removed already, or a stale handle on a network file system
            time.sleep(0.1)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)


def _lock(work: Path, out_dir: Path, overwrite: bool) -> int:
    """The work folder's lock, then `out_dir` checked again (another prepare may have published
    it meanwhile: then this one's new work folder, empty but for the lock, goes)."""
    try:
        fd = os.open(work / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # the folder was published or removed since this process made it
        raise PrepareBusy(work, out_dir) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise PrepareBusy(work, out_dir) from None
    try:
        check_output(out_dir, overwrite)
    except ExistingOutput:
        if {entry.name for entry in work.iterdir()} <= {LOCK_FILE}:
            shutil.rmtree(work, ignore_errors=True)
        os.close(fd)
        raise
    return fd


def _resume_state(work: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """progress.json's state when it was written with the same settings and its shards are whole;
    a fresh state otherwise. Files it does not list are deleted."""
    fresh = {"settings": settings, "records": 0, "docs": 0, "empty": 0, "sources": {},
             "shards": {split: [] for split in SPLITS}}
    state = fresh
    try:
        found = json.loads((work / PROGRESS_FILE).read_text())
        if found["settings"] != settings:
            logger.warning("%s holds an interrupted prepare of other settings: starting again", work)
        elif all(
                (work / s["file"]).stat().st_size == s["num_tokens"] * np.dtype(settings["dtype"]).itemsize
                and (work / s["docs_file"]).is_file() for shards in found["shards"].values() for s in shards):
            state = found
            logger.info("resuming the prepare in %s after %s records (%s documents)", work,
                        f"{state['records']:,}", f"{state['docs']:,}")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    keep = {LOCK_FILE, PROGRESS_FILE} | {n for shards in state["shards"].values() for s in shards
                                         for n in (s["file"], s["docs_file"])}
    for entry in work.iterdir():
        if entry.name not in keep:
            entry.unlink() if not entry.is_dir() or entry.is_symlink() else shutil.rmtree(entry)
    return state


def _save_state(work: Path, state: dict[str, Any]) -> None:
    tmp = work / f"{PROGRESS_FILE}.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, work / PROGRESS_FILE)


def _write(state: dict[str, Any], work: Path, source: Path, tokenizer: Tokenizer, dtype: np.dtype,
           workers: int) -> None:
    s = state["settings"]
    writers = {split: ShardWriter(work, split, s["shard_tokens"], state["shards"][split]) for split in SPLITS}
    progress = Progress(source, skip=state["records"])
    pending: tuple[int, np.ndarray] | None = None  # held back: it may go to a split that would be empty
    position = state["records"]
    for name, tokens in encoded(_records(source, s["column"], state["records"], progress), tokenizer, dtype, workers):
        position += 1
        counts = state["sources"].setdefault(name, {"documents": 0, "empty": 0, "tokens": 0})
        progress.add(tokens)
        if tokens is None:
            counts["empty"] += 1
            state["empty"] += 1
            continue
        if pending is not None:
            writers[assign_split(pending[0], s["seed"], s["val_fraction"])].add_document(pending[1])
            if "sha256" in next(iter(writers["train"].closed), {}):  # a train shard is complete: a progress point
                state["shards"] = {split: w.commit() for split, w in writers.items()}
                state["records"] = position - 1  # the current record is read again on resume
                _save_state(work, state)
        counts["documents"] += 1
        counts["tokens"] += len(tokens)
        pending = (state["docs"], tokens)
        state["docs"] += 1
    progress.finish()
    _place_last(pending, writers, s["val_fraction"], s["seed"], source, state["docs"])
    state["shards"] = {split: w.commit() for split, w in writers.items()}


def _records(source: Path, column: str, skip: int, progress: Progress) -> Iterator[tuple[str, str]]:
    """(source file's name, text) of every record after the first `skip`, counted by `progress`."""
    for i, (file, text) in enumerate(iter_file_texts(source, column)):
        progress.record(file, text)
        if i >= skip:
            yield progress.name(file), text


def _place_last(pending: tuple[int, np.ndarray] | None, writers: dict[str, ShardWriter], val_fraction: float,
                seed: int, source: Path, num_docs: int) -> None:
    if pending is None:
        raise BadInput(f"no documents found in {source} (empty documents, and files with other suffixes, are "
                       "skipped; see gridtrain.data.corpus.TEXT_SUFFIXES)")
    last, tokens = pending
    if num_docs == 1:
        _split_single_document(tokens, writers, val_fraction)
    elif writers["val"].num_docs == 0:
        writers["val"].add_document(tokens)
    elif writers["train"].num_docs == 0:
        writers["train"].add_document(tokens)
    else:
        writers[assign_split(last, seed, val_fraction)].add_document(tokens)


def _split_single_document(tokens: np.ndarray, writers: dict[str, ShardWriter], val_fraction: float) -> None:
    body, eos = tokens[:-1], tokens[-1:]
    if len(body) < 2:
        raise BadInput(f"the corpus is one document of {len(body)} token(s): too short to split into train and val")
    num_val = min(max(1, int(len(body) * val_fraction)), len(body) - 1)
    logger.warning("the corpus is a single document: its last %d of %d tokens become the validation split",
                   num_val, len(body))
    writers["train"].add_document(np.concatenate([body[:-num_val], eos]))
    writers["val"].add_document(np.concatenate([body[-num_val:], eos]))


def _index(settings: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    splits = {split: {"num_tokens": sum(s["num_tokens"] for s in shards), "num_docs": sum(s["num_docs"] for s in shards),
                      "shards": shards} for split, shards in state["shards"].items()}
    return {**{k: settings[k] for k in ("format_version", "tokenizer", "vocab_size", "eos_id", "dtype", "source",
                                        "column", "val_fraction", "seed")},
            "splits": splits, "num_tokens": sum(i["num_tokens"] for i in splits.values()),
            "num_docs": sum(i["num_docs"] for i in splits.values()), "empty_docs": state["empty"],
            "sources": state["sources"]}


# -- tokenizing, in this process or in workers -------------------------------------------------------

def encode_chunk(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of the non-empty texts, each followed by eos, concatenated; and every text's
    length in tokens with its eos (0 for an empty text)."""
    parts = iter(encode_with_eos([t for t in texts if t], tokenizer, dtype))
    lengths = np.zeros(len(texts), np.int64)
    kept = []
    for i, text in enumerate(texts):
        if text:
            kept.append(next(parts))
            lengths[i] = len(kept[-1])
    return (np.concatenate(kept) if kept else np.zeros(0, dtype)), lengths


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Tokenizer, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
    _WORKER.update(tokenizer=tokenizer, dtype=np.dtype(dtype))


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_chunk(_WORKER["tokenizer"], texts, _WORKER["dtype"])


def _chunks(records: Iterator[tuple[str, str]]) -> Iterator[tuple[list[str], list[str]]]:
    names: list[str] = []
    texts: list[str] = []
    size = 0
    for name, text in records:
        names.append(name)
        texts.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield names, texts
            names, texts, size = [], [], 0
    if texts:
        yield names, texts


def encoded(records: Iterator[tuple[str, str]], tokenizer: Tokenizer, dtype: np.dtype,
            workers: int) -> Iterator[tuple[str, np.ndarray | None]]:
    """(name, tokens with eos, or None for an empty text) of each record, in order. With `workers` > 1
    at most 2 chunks per worker are in flight, so memory stays flat however long the corpus."""
    for names, (flat, lengths) in _encoded_chunks(_chunks(records), tokenizer, dtype, workers):
        ends = np.cumsum(lengths)
        for name, end, length in zip(names, ends, lengths):
            yield name, flat[end - length:end] if length else None


def _encoded_chunks(chunks: Iterator[tuple[list[str], list[str]]], tokenizer: Tokenizer, dtype: np.dtype,
                    workers: int) -> Iterator[tuple[list[str], tuple[np.ndarray, np.ndarray]]]:
    if workers <= 1:
        for names, texts in chunks:
            yield names, encode_chunk(tokenizer, texts, dtype)
        return
    # spawn: a fresh interpreter, whatever threads (torch's, tokenizers') this process runs.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer, dtype.str)) as pool:
        in_flight: deque = deque()
        for names, texts in chunks:
            in_flight.append((names, pool.apply_async(_encode_in_worker, (texts,))))
            if len(in_flight) >= 2 * workers:
                names, result = in_flight.popleft()
                yield names, result.get()
        while in_flight:
            names, result = in_flight.popleft()
            yield names, result.get()
