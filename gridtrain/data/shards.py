"""Tokenize a corpus once into binary shards, and read them back as one memory-mapped stream.

A prepared directory holds, per split ("train", "val"), raw token shards `<split>-00000.bin`
(uint16, or uint32 for vocabularies over 65535), the shard-local start offset of every document
that begins in each shard (`<split>-00000.docs.npy`, int64), and `index.json` describing it all:
the manifest (source, tokenizer, documents, empty documents skipped and tokens per source file,
each shard's sha256). Every document is followed by the tokenizer's eos id; a document may
continue into the next shard. gridtrain.data.prepare writes it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from gridtrain.data.corpus import default_corpus
from gridtrain.data.tokenizer import Tokenizer, build_tokenizer, encode_batch
from gridtrain.errors import BadInput, ExistingOutput, MissingInput
from gridtrain.inputs import read_input, read_json

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
INDEX_FILE = "index.json"
LENGTHS_PNG = "lengths.png"
"""`gridtrain data stats` draws the document lengths here: a file of the prepared directory too."""
SPLITS = ("train", "val")


def encode_with_eos(texts: list[str], tokenizer: Tokenizer, dtype: np.dtype) -> list[np.ndarray]:
    """Each text's tokens followed by eos, as `dtype`; ValueError for an id past the vocabulary."""
    out = []
    for ids in encode_batch(tokenizer, texts):
        ids = np.asarray(ids)
        if len(ids) and int(ids.max()) >= tokenizer.vocab_size:
            raise ValueError(f"tokenizer {tokenizer.name} produced id {int(ids.max())} >= its "
                             f"vocab_size {tokenizer.vocab_size}")
        tokens = np.empty(len(ids) + 1, dtype=dtype)
        tokens[:-1] = ids
        tokens[-1] = tokenizer.eos_id
        out.append(tokens)
    return out


def prepare(source: str | Path, tokenizer: Tokenizer, out_dir: Path, val_fraction: float = 0.005,
            seed: int = 0, shard_tokens: int = 2**26, overwrite: bool = False, column: str = "text",
            workers: int = 1) -> Path:
    """Tokenize `source` into shards under `out_dir`: gridtrain.data.prepare.prepare."""
    from gridtrain.data.prepare import prepare as run

    return run(source, tokenizer, out_dir, val_fraction, seed, shard_tokens, overwrite, column, workers)


def assign_split(doc_index: int, seed: int, val_fraction: float) -> str:
    """The split of the `doc_index`-th non-empty document: val when a hash of (seed, index) falls
    below `val_fraction`."""
    digest = hashlib.blake2b(f"{seed}:{doc_index}".encode(), digest_size=8).digest()
    return "val" if int.from_bytes(digest, "little") / 2**64 < val_fraction else "train"


LOCK_FILE = ".lock"
"""A prepare's flock, in its work folder (gridtrain.data.prepare); it moves with the folder when
published and is removed after, or stays where that prepare was killed in between."""


def check_output(out_dir: Path, overwrite: bool) -> None:
    """Refuse an output directory that holds anything but a prepared dataset, and a prepared one
    unless `overwrite` (before any work: nothing is built for a refused output)."""
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / INDEX_FILE).is_file():
        raise ExistingOutput(f"{out_dir} exists and is not a prepared directory; "
                             "refusing to replace it (choose an empty or new out_dir)")
    if (out_dir / INDEX_FILE).is_file():
        _check_replaceable(out_dir, overwrite)


def _check_replaceable(out_dir: Path, overwrite: bool) -> None:
    """Refuse to replace a prepared directory unless asked to, or when it holds other files."""
    if not overwrite:
        raise ExistingOutput(f"{out_dir} already holds a prepared dataset: pass --overwrite to replace it, "
                              "or choose a new --out")
    try:
        shards = load_index(out_dir)["splits"]
        owned = {INDEX_FILE, LENGTHS_PNG, LOCK_FILE} | {name for split in shards.values() for shard in split["shards"]
                                           for name in (shard["file"], shard["docs_file"])}
    except (OSError, ValueError, KeyError, TypeError):
        owned = {INDEX_FILE, LENGTHS_PNG, LOCK_FILE}
    foreign = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file()
                     and str(p.relative_to(out_dir)) not in owned)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ExistingOutput(f"{out_dir} also holds files gridtrain did not write ({shown}); --overwrite "
                              "would delete them: move them out, or choose a new --out")


def _publish(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    # os.replace cannot overwrite a non-empty directory: move the old one aside first.
    old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-{_owner()}-"))
    os.replace(out_dir, old / "data")
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_")


def _owner() -> str:
    """HOST-PID of this process, in the names of its temporary folders: a later prepare on the same
    host removes them once that process is gone (a prepare killed by SIGKILL cannot)."""
    return f"{_host()}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process (EPERM), or a pid no process has: keep
        return True
    return pid > 0  # 0 would signal our own process group


def remove_stale_folders(parent: Path) -> list[Path]:
    """Remove the temporary folders (`.<name>.tmp-HOST-PID-*`, `.<name>.old-HOST-PID-*`) that a
    prepare on this host left in `parent` when it was killed: those whose process is gone. A live
    prepare's folders and anything else are never touched. Returns the folders removed."""
    pattern = re.compile(r"\..+\.(?:tmp|old)-" + re.escape(_host()) + r"-(\d{1,10})-[a-z0-9_]{8}")
    removed = []
    for entry in os.scandir(parent):
        match = pattern.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not _alive(int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
            logger.warning("removed %s, left by a prepare (process %s) that was killed", entry.path, match.group(1))
            removed.append(Path(entry.path))
    return removed


def ensure_prepared(source: str | Path | None, tokenizer_spec: str, cache_dir: Path,
                    val_fraction: float = 0.005, seed: int = 0, column: str = "text", workers: int = 1) -> Path:
    """Return a prepared directory for `source`, preparing it under `cache_dir` if needed.

    `source` None means the Python stdlib (`default_corpus()`); a `source` that is already a
    prepared directory is returned as is. The cache key covers the absolute source path, the
    tokenizer spec (and the tokenizer file's content when the spec is a path), val_fraction,
    seed, the text column and the format version; a change to the corpus's files is not detected.
    Call it on one process and let the others wait (a barrier). Another job that prepares the same
    key now (a second replica group, a second job on the same cache) is waited for, and its result
    used; an interrupted prepare is continued.
    """
    from gridtrain.data.prepare import PrepareBusy

    src = Path(source).resolve() if source is not None else default_corpus()
    if (src / INDEX_FILE).is_file():
        return src
    if not src.exists():
        raise MissingInput(f"corpus not found: {src}")
    out_dir = Path(cache_dir) / _cache_name(src, tokenizer_spec, val_fraction, seed, column)
    if (out_dir / INDEX_FILE).is_file():
        return out_dir
    tokenizer = build_tokenizer(tokenizer_spec, corpus=src, cache_dir=Path(cache_dir))
    start = time.perf_counter()
    while True:
        try:
            prepare(src, tokenizer, out_dir, val_fraction=val_fraction, seed=seed, column=column, workers=workers)
            break
        except PrepareBusy as busy:
            logger.info("another process prepares %s now: waiting for it", out_dir)
            busy.wait()
        except ExistingOutput:
            if not (out_dir / INDEX_FILE).is_file():
                raise
            logger.info("using %s, which another process prepared", out_dir)
            return out_dir
    index = load_index(out_dir)
    train, val = index["splits"]["train"], index["splits"]["val"]
    logger.info("prepared %s with %s in %.1fs: %d train tokens (%d docs), %d val tokens "
                "(%d docs) -> %s", src, tokenizer.name, time.perf_counter() - start,
                train["num_tokens"], train["num_docs"], val["num_tokens"], val["num_docs"],
                out_dir)
    return out_dir


def _cache_name(source: Path, tokenizer_spec: str, val_fraction: float, seed: int, column: str = "text") -> str:
    spec_id = tokenizer_spec
    is_builtin = tokenizer_spec == "byte" or tokenizer_spec.startswith("bpe:")
    if not is_builtin and Path(tokenizer_spec).is_file():
        spec_id += ":" + hashlib.sha256(Path(tokenizer_spec).read_bytes()).hexdigest()
    key = [str(source), spec_id, val_fraction, seed, FORMAT_VERSION] + ([column] if column != "text" else [])
    key_text = json.dumps(key)
    key = hashlib.sha256(key_text.encode()).hexdigest()[:12]
    spec_slug = re.sub(r"[^A-Za-z0-9]+", "", Path(tokenizer_spec).stem)[:24] or "tok"
    return f"{source.name}-{spec_slug}-{key}"


def load_index(prepared_dir: Path) -> dict[str, Any]:
    """The parsed `index.json` of a prepared directory, checked for a known format version."""
    path = Path(prepared_dir) / INDEX_FILE
    if not path.is_file():
        raise MissingInput(f"{prepared_dir} is not a prepared data directory (no "
                                f"{INDEX_FILE}); create one with gridtrain.data.shards.prepare")
    index = read_json(path, str(path))
    if not isinstance(index, dict) or index.get("format_version") != FORMAT_VERSION:
        version = index.get("format_version") if isinstance(index, dict) else None
        raise BadInput(f"{path} has format version {version}, this code "
                         f"reads {FORMAT_VERSION}: prepare the corpus again")
    return index


class TokenStore:
    """The shards of one split, memory-mapped read-only and presented as one token stream."""

    def __init__(self, prepared_dir: Path, split: str) -> None:
        self.prepared_dir = Path(prepared_dir)
        index = load_index(self.prepared_dir)
        try:
            if split not in index["splits"]:
                raise ValueError(f"no split {split!r} in {self.prepared_dir}; "
                                 f"available: {sorted(index['splits'])}")
            self.split = split
            self.vocab_size: int = index["vocab_size"]
            self.eos_id: int = index["eos_id"]
            self.dtype = np.dtype(index["dtype"])
            self._shards = index["splits"][split]["shards"]
            self._arrays = [self._open_shard(s) for s in self._shards]
        except (KeyError, TypeError) as err:  # a hand-edited or foreign index.json
            raise BadInput(f"{self.prepared_dir / INDEX_FILE} lacks what `gridtrain data prepare` writes "
                           f"({type(err).__name__}: {err}): prepare the corpus again") from None
        self._offsets = np.cumsum([0] + [len(a) for a in self._arrays])

    def _open_shard(self, shard: dict[str, Any]) -> np.ndarray:
        path = self.prepared_dir / shard["file"]
        expected = shard["num_tokens"] * self.dtype.itemsize
        if not path.is_file() or path.stat().st_size != expected:
            raise ValueError(f"shard {path} is missing or not {expected} bytes as index.json "
                             "says: prepare the corpus again")
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(shard["num_tokens"],))

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, copied out (shard boundaries crossed)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"read({start}, {length}) outside the {self.split} stream of "
                             f"{self.num_tokens} tokens")
        out = np.empty(length, dtype=self.dtype)
        shard = int(np.searchsorted(self._offsets, start, side="right")) - 1
        pos = 0
        while pos < length:
            local = start + pos - int(self._offsets[shard])
            take = min(length - pos, len(self._arrays[shard]) - local)
            out[pos:pos + take] = self._arrays[shard][local:local + take]
            pos += take
            shard += 1
        return out

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """Start offsets of the documents in the concatenated stream (int64, ascending)."""
        parts = [self._shard_starts(s) + int(offset) for s, offset in zip(self._shards, self._offsets[:-1])]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _shard_starts(self, shard: dict[str, Any]) -> np.ndarray:
        """A shard's document starts, read as a bounded regular file (a fifo in its place would block
        for ever) and held to index.json: num_docs of them, ascending, inside the shard."""
        try:
            path, count = self.prepared_dir / shard["docs_file"], int(shard["num_docs"])
        except (KeyError, TypeError, ValueError) as err:
            raise BadInput(f"{self.prepared_dir / INDEX_FILE} lacks a shard's document starts or count "
                           f"({type(err).__name__}: {err}): prepare the corpus again") from None
        data = read_input(path, str(path), max_bytes=8 * count + 4096)  # int64 .npy: 8 bytes each + header
        try:
            starts = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise BadInput(f"{path} is not a .npy of document starts ({err}): prepare the corpus again") from None
        if (starts.dtype.kind not in "iu" or starts.shape != (count,)
                or (count and (starts[0] < 0 or starts[-1] >= shard["num_tokens"] or np.any(np.diff(starts) <= 0)))):
            raise BadInput(f"{path} does not hold {count} ascending document starts within the shard's "
                           f"{shard['num_tokens']} tokens, as index.json says: prepare the corpus again")
        return starts.astype(np.int64)
