"""Files the user names, checked before they are read: a regular file of bounded size.

`open()` of a fifo waits for a writer, a read of /dev/zero never ends, and a directory or a
100 GB file given by mistake should be one line, not a hang or an exhausted machine. The checks
are made on the opened file (fstat), so what is read is what was checked.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from gridtrain.errors import BadInput, MissingInput, UserError

MISSING = "does not exist"


def size_text(num_bytes: int) -> str:
    """Bytes as people read them: 16 MiB, 1.5 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes} bytes"


def _stat_problem(st: os.stat_result, max_bytes: int | None) -> str | None:
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a device, a pipe or a socket)"
    if max_bytes is not None and st.st_size > max_bytes:
        exact = f" ({st.st_size:,} bytes)" if st.st_size >= 2**10 else ""
        return f"is {size_text(st.st_size)}{exact}, more than the {size_text(max_bytes)} read from it"
    return None


def file_problem(path: str | Path, max_bytes: int | None = None) -> str | None:
    """Why `path` is not a readable input file (MISSING, a directory, a device or fifo, larger
    than `max_bytes`), or None. Follows symbolic links: a link to /dev/zero is not a file."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return MISSING
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    return _stat_problem(st, max_bytes)


def read_input(path: str | Path, label: str, max_bytes: int, error: type[UserError] = BadInput) -> bytes:
    """The bytes of the file at `path`, at most `max_bytes` of them; otherwise `error` (or
    MissingInput when there is no such file) saying "<label> <why>"."""
    try:  # O_NONBLOCK: opening a fifo returns at once instead of waiting for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        why = file_problem(path, max_bytes) or f"cannot be read ({err.strerror})"
        raise (MissingInput if why == MISSING else error)(f"{label} {why}") from None
    why = _stat_problem(os.fstat(fd), max_bytes)
    if why is not None:
        os.close(fd)
        raise error(f"{label} {why}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew since fstat
        raise error(f"{label} is more than the {size_text(max_bytes)} read from it")
    return data


JSON_BYTES = 64 * 2**20
"""The largest JSON file gridtrain reads (64 MiB): a run record, a manifest or an index is far
smaller; a 3 GiB config.json took 6.5 GB to parse."""


def read_json(path: str | Path, label: str, max_bytes: int = JSON_BYTES,
              error: type[UserError] = BadInput) -> object:
    """The parsed JSON of a file read through `read_input`; `error` "<label> is not readable JSON"
    for bytes that are not UTF-8 JSON, or JSON nested past the parser's recursion limit."""
    data = read_input(path, label, max_bytes, error)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError included
        raise error(f"{label} is not readable JSON ({type(err).__name__}: {str(err)[:200]})") from None
