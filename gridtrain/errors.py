"""The two ways a command fails, as `gridtrain` reports them.

- `UserError`: bad input (a value, a file, a directory the user gave). One line naming the value
  and the fix, exit status 2, before anything is written.
- Anything else raised is a failure of the run (exit status 1), also reported on one line; the
  traceback is printed only with `--debug`.
"""

from __future__ import annotations

import os


class UserError(Exception):
    """Bad input; the message says what is wrong, the value and the fix."""


def one_line(err: BaseException, anticipated: bool = False) -> str:
    """How `gridtrain` reports an exception: its message, prefixed with the rank under torchrun
    (each rank may fail on its own) and, for a failure nobody anticipated, its type."""
    rank = os.environ.get("RANK")
    text = str(err).strip() or type(err).__name__
    where = "" if rank is None or text.startswith(f"rank {rank} ") else f"rank {rank}: "
    if not (anticipated or isinstance(err, UserError)):  # its first line: the rest comes with --debug
        text = f"{type(err).__name__}: {text.splitlines()[0]}" if str(err).strip() else text
    return f"{where}{text}"


class BadInput(UserError, ValueError):
    """A value, file or directory that is there but wrong."""


class MissingInput(UserError, FileNotFoundError):
    """A file or directory the command needs and cannot find."""


class ExistingOutput(UserError, FileExistsError):
    """An output that would overwrite what the user owns."""
