"""One writer per run directory: a lock its job holds from start to exit.

Two jobs training into one run directory destroy each other's work (config.json replaced,
metrics.jsonl interleaved, both dying at their first save). So the job's rank 0 (the process that
writes config.json and commits checkpoints) holds an exclusive `flock` on `<run_dir>/.gridtrain.lock`
for as long as it lives, and writes into the file who holds it: host, PID, start time and command.

- The kernel releases a flock when its holder exits, however it exits: a job killed with kill -9
  leaves the file but not the lock, and the next job takes it over (and says whose it was). A
  holder that ends cleanly empties the file first, so a non-empty file found unlocked is the mark
  of a job that was killed.
- On a shared filesystem the lock holds across nodes: Linux emulates flock on NFS with byte-range
  locks the server arbitrates (since 2.6.12; NFSv4 frees a crashed node's locks when its lease
  expires, about 90 s), and Lustre and GPFS arbitrate them when mounted with flock support.
  `acquire` says so when the filesystem refuses locks.
- Before any process starts, `gridtrain train` looks whether the directory is held (`holder`:
  a shared lock tried and let go at once), so a second job is refused in one line naming the
  holder, before torchrun starts a process. The job's rank 0 then takes the lock for real
  (`acquire`, retried for a moment so a look by another launcher is not mistaken for a holder),
  and every rank agrees on the outcome (the Trainer).

Torch-free: the launcher uses it before torchrun starts a process.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from gridtrain.config import Config
from gridtrain.errors import BadInput

log = logging.getLogger("gridtrain")

LOCK_FILE = ".gridtrain.lock"
_HELD: weakref.WeakValueDictionary[Path, RunLock] = weakref.WeakValueDictionary()
"""The locks this process holds, by resolved run directory (a lock nobody keeps is let go)."""
RETRY_S = 1.0
"""How long `acquire` keeps trying: another launcher's look holds a shared lock for microseconds."""


class RunDirInUse(BadInput):
    """Another job holds the run directory."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run directory's lock, as its file says."""

    host: str = "?"
    pid: int = 0
    started: str = "?"
    command: str = ""

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file names, or None for anything else in it (garbage is no holder)."""
        try:
            data = json.loads(text)
            return cls(str(data["host"])[:200], int(data["pid"]), str(data["started"])[:100],
                       str(data.get("command", ""))[:500])
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
            return None

    def __str__(self) -> str:
        return f"host {self.host}, PID {self.pid}, started {self.started}"


def _read_holder(fd: int) -> Holder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    return Holder.parse(os.read(fd, 1 << 16).decode("utf-8", "replace"))


def _busy(run_dir: Path, holder: Holder | None) -> RunDirInUse:
    who = f" ({holder}: {holder.command})" if holder and holder.command else f" ({holder})" if holder else ""
    return RunDirInUse(f"{run_dir} is in use by another gridtrain job{who}: wait for it to end, or train into "
                       "another --run_dir (and checkpoint.dir)")


def _unsupported(run_dir: Path, err: OSError) -> RunDirInUse:
    return RunDirInUse(f"run_dir {run_dir}: its filesystem refuses file locks ({err.strerror}), so gridtrain cannot "
                       "keep a second job out of it: put the run directory on a filesystem with locks (Lustre: "
                       "mount with -o flock), or another --run_dir")


def _open(path: Path, flags: int) -> int:
    """The lock file, opened without following a link and without waiting on a fifo; RunDirInUse
    (bad input) if it is not a regular file: gridtrain writes into it."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            raise
        raise RunDirInUse(f"run_dir {path.parent}: its lock file {path.name} cannot be opened ({err.strerror}: a link "
                          "or a folder?): remove it, or train into another --run_dir") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunDirInUse(f"run_dir {path.parent}: its lock file {path.name} is not a regular file: remove it, or "
                          "train into another --run_dir")
    return fd


def holder(run_dir: Path) -> Holder | None:
    """Who holds `run_dir`'s lock now, or None if nobody does (or there is no directory yet).
    Takes a shared lock and lets it go at once: it never waits."""
    path = Path(run_dir) / LOCK_FILE
    if (mine := _HELD.get(Path(run_dir).resolve())) is not None and mine.fd >= 0:
        return None  # this process's own job
    try:
        fd = _open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd) or Holder()
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise _unsupported(Path(run_dir), err) from None
        raise
    finally:
        os.close(fd)  # also lets a shared lock go
    return None


def job_dirs(cfg: Config) -> list[Path]:
    """The directories a job writes and holds: its run directory, and its checkpoint directory
    when that lies outside (two jobs sharing one would delete each other's saves)."""
    run_dir, checkpoints = Path(cfg.run_dir), cfg.checkpoint_dir
    inside = checkpoints.resolve().is_relative_to(run_dir.resolve())
    return [run_dir] if inside else [run_dir, checkpoints]


def refuse_if_held(run_dir: Path) -> None:
    """RunDirInUse naming the holder if another job holds `run_dir`."""
    found = holder(Path(run_dir))
    if found is not None:
        raise _busy(Path(run_dir), found)


def _flock(fd: int, run_dir: Path, retry_s: float) -> None:
    """An exclusive flock on `fd` within `retry_s`, or RunDirInUse naming the holder (`fd` closed)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            found = _read_holder(fd)
            os.close(fd)
            raise _busy(run_dir, found) from None
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise _unsupported(run_dir, err) from None
            raise


class RunLock:
    """The exclusive lock of one run directory, held by this process until `release` or exit."""

    def __init__(self, run_dir: Path, fd: int, previous: Holder | None) -> None:
        self.run_dir, self.fd = run_dir, fd
        self.previous = previous
        """The holder a killed job left in the file (it ended without releasing), else None."""

    @classmethod
    def acquire(cls, run_dir: Path, retry_s: float = RETRY_S) -> RunLock:
        """Take `run_dir`'s lock (creating the directory) and write this process into it; raise
        RunDirInUse naming the holder if another job keeps it for `retry_s`. A lock this process
        already holds passes to the new owner (one process is one job: a test's second Trainer)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        key = run_dir.resolve()
        if (mine := _HELD.get(key)) is not None and mine.fd >= 0:
            fd, mine.fd = mine.fd, -1
            _HELD[key] = lock = cls(run_dir, fd, None)
            return lock
        fd = _open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
        _flock(fd, run_dir, retry_s)
        _HELD[key] = lock = cls(run_dir, fd, _read_holder(fd))
        lock._write(Holder(socket.gethostname(), os.getpid(),
                           datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           " ".join(["gridtrain", *sys.argv[1:]])[:500]))
        if lock.previous is not None:
            log.warning("run_dir %s: the job that held it (%s) ended without releasing it (killed?); taken over",
                        run_dir, lock.previous)
        return lock

    def _write(self, who: Holder | None) -> None:
        text = json.dumps(dataclasses.asdict(who)) + "\n" if who else ""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)
        os.fsync(self.fd)

    def __del__(self) -> None:
        self.release()

    def release(self) -> None:
        """Empty the file (a clean end) and let the lock go; exiting lets it go too."""
        if self.fd < 0:
            return
        try:
            self._write(None)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1
