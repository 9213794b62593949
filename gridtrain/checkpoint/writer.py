"""How a checkpoint's files are written, and what a failure to write them means.

`Writer` is DCP's file writer with two additions: a fault hook for tests, and files of their own for
large tensors (a state dict that produces its tensors as they are written stays small). `os_error`
and `fix_for` turn a failed write into the fix the user needs.

For tests only: GRIDTRAIN_FAULT_SAVE_ERROR=ENOSPC makes a save fail with that OSError while writing
shards; `ENOSPC:prepare` or `EACCES:manifest` pick another stage, `ENOSPC@1` only rank 1.
"""

from __future__ import annotations

import errno
import math
import os
import queue
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

FAULT_ENV = "GRIDTRAIN_FAULT_SAVE_ERROR"


def inject_fault(stage: str, where: Path) -> None:
    """For tests only: raise the OSError that $GRIDTRAIN_FAULT_SAVE_ERROR names for this stage
    ("ENOSPC" = while writing shards, "ENOSPC:prepare", "EACCES:manifest", "ENOSPC@1" = rank 1)."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    spec, _, rank = spec.partition("@")
    name, _, at = spec.partition(":")
    if (at or "shards") != stage or (rank and int(rank) != (dist.get_rank() if dist.is_initialized() else 0)):
        return
    code = getattr(errno, name, None)
    if not isinstance(code, int):
        raise ValueError(f"{FAULT_ENV}={os.environ[FAULT_ENV]!r}: {name!r} is not an errno name "
                         "such as ENOSPC or EACCES")
    raise OSError(code, f"{os.strerror(code)} (injected by {FAULT_ENV})", str(where))


class Writer(dcp.FileSystemWriter):
    """DCP's file writer, with the test fault hook after this rank's shards are written.

    With `own_file_from` set, each tensor of at least that many bytes goes to a file of its own
    and everything else to one more file: DCP's writer keeps every tensor of a file in memory
    until the file is closed, so a writer whose planner produces tensors one at a time
    (SavePlanner.resolve_data) holds only one large tensor at a time."""

    def __init__(self, path: Path, own_file_from: int | None = None) -> None:
        super().__init__(path)
        self.own_file_from = own_file_from

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.own_file_from is None:
            written = super().write_data(plan, planner)
        else:
            written = self._write_apart(plan, planner)
        inject_fault("shards", Path(self.path))
        return written

    def _write_apart(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        large = [item for item in plan.items if _tensor_bytes(item) >= self.own_file_from]
        rest = [item for item in plan.items if _tensor_bytes(item) < self.own_file_from]
        files: queue.Queue = queue.Queue()
        for number, items in enumerate([rest, *([item] for item in large)]):
            name = f"{plan.storage_data.prefix}{number}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)


def _tensor_bytes(item: WriteItem) -> int:
    """Bytes of a tensor item (0 for a bytes item)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


def os_error(error: BaseException | None) -> tuple[OSError | None, int | None]:
    """The first OSError inside `error` (DCP wraps each rank's in a CheckpointException), and
    the rank it came from when known."""
    pending: list[tuple[BaseException, int | None]] = [(error, None)] if error else []
    while pending:
        exc, rank = pending.pop(0)
        if isinstance(exc, OSError):
            return exc, rank
        if isinstance(exc, CheckpointException):
            pending += [(e, r) for r, (e, _) in sorted(exc.failures.items())]
        for nested in (exc.__cause__, exc.__context__):
            if nested is not None:
                pending.append((nested, rank))
    return None, None


def _free_space(path: Path) -> str:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return f"{shutil.disk_usage(path).free:,} bytes free now"
    except OSError:
        return "free space unknown"


def fix_for(code: int | None, where: Path) -> str:
    if code in (errno.ENOSPC, errno.EDQUOT):
        return (f"free space on the filesystem of {where} ({_free_space(where)}) or set "
                "checkpoint.dir to another filesystem")
    if code in (errno.EACCES, errno.EPERM):
        return (f"make {where} writable by this user (uid {os.geteuid()}) or set checkpoint.dir "
                "to a directory it can write")
    if code == errno.EROFS:
        return f"remount {where} read-write or set checkpoint.dir to another filesystem"
    return f"check the filesystem of {where} or set checkpoint.dir to another filesystem"
