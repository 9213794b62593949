"""The progress line of a prepare: documents/s, tokens/s, the share of the corpus read, and an ETA.

The share is measured in bytes of the source files: the files read whole, plus the current file's
bytes in proportion to the characters read from it (its size stands in for its text: exact for
text, close for JSON lines, a guess for compressed and columnar files until the file ends).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from gridtrain.data.corpus import source_files

logger = logging.getLogger(__name__)

EVERY_S = 5.0
"""Seconds between progress lines."""


class Progress:
    """Counts a prepare's records as they are read and its tokens as they are written, and logs a
    line every EVERY_S seconds."""

    def __init__(self, source: Path, skip: int = 0) -> None:
        self.source = Path(source)
        self.root = self.source if self.source.is_dir() else self.source.parent
        self.sizes = {f: f.stat().st_size for f in source_files(self.source)}
        self.total_bytes = max(1, sum(self.sizes.values()))
        self.skip = skip
        self.records = 0
        self.docs = self.tokens = 0
        self.done_bytes = 0
        self.file: Path | None = None
        self.file_chars = 0
        self.share0 = 0.0
        self.start = self.last = time.perf_counter()

    def name(self, file: Path) -> str:
        """The name a source file's counts go under: its path inside the corpus folder."""
        return str(file.relative_to(self.root)) if file.is_relative_to(self.root) else str(file)

    def record(self, file: Path, text: str) -> None:
        """A record read from `file` (records come file after file)."""
        if file != self.file:
            if self.file is not None:
                self.done_bytes += self.sizes.get(self.file, 0)
            self.file, self.file_chars = file, 0
        self.file_chars += len(text)
        self.records += 1
        if self.records == self.skip:  # a resumed prepare's rate counts what it reads itself
            self.share0, self.start = self.fraction(), time.perf_counter()

    def add(self, tokens: np.ndarray | None) -> None:
        """A document written (None: an empty one skipped)."""
        if tokens is not None:
            self.docs += 1
            self.tokens += len(tokens)
        now = time.perf_counter()
        if now - self.last >= EVERY_S:
            self.last = now
            logger.info("prepare: %s", self.line(now))

    def fraction(self) -> float:
        size = self.sizes.get(self.file, 0) if self.file is not None else 0
        return min(1.0, (self.done_bytes + min(size, self.file_chars)) / self.total_bytes)

    def line(self, now: float) -> str:
        seconds = max(now - self.start, 1e-9)
        share = self.fraction()
        done = share - self.share0
        eta = seconds * (1 - share) / done if done > 0 else float("nan")
        resumed = f" (resumed after {self.skip:,} records)" if self.skip else ""
        return (f"{self.docs:,} documents ({self.docs / seconds:,.0f}/s), {self.tokens:,} tokens "
                f"({self.tokens / seconds:,.0f}/s), {100 * share:.0f}% of {self.total_bytes / 1e6:,.1f} MB read, "
                f"ETA {duration(eta)}{resumed}")

    def finish(self) -> None:
        self.record(Path(), "")  # the last file is read whole
        self.records -= 1
        logger.info("prepare: %s", self.line(time.perf_counter()).split(", ETA")[0] + " (done)")


def duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
