"""A checkpoint's manifest: the size and sha256 of every file DCP wrote, so corruption is caught.

`manifest.json` sits beside DCP's `.metadata` and shards (`__<rank>_<n>.distcp`):

    {"format": "gridtrain-checkpoint", "version": 1, "step": 6, "world_size": 2,
     "created": "2025-01-01T12:00:00+00:00",
     "files": {".metadata": {"bytes": 1234, "sha256": "..."}, "__0_0.distcp": {...}, ...}}

It is written last, atomically (temporary name, fsync, rename), after every file it lists has been
fsynced, so a directory holding a manifest holds everything the manifest describes. `verify`
compares the directory with it: a truncated, altered, missing or extra file is named in the reason.
Nothing here unpickles; the manifest is JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from gridtrain.errors import UserError
from gridtrain.inputs import read_input

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 2**20
"""A manifest lists a file per rank and item (about 100 bytes each): 64 MiB is some 600,000 files."""
FORMAT = "gridtrain-checkpoint"
VERSION = 1

_CHUNK = 4 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_STEP_NAME = re.compile(r"^step-(\d{7})$")

# Directories that passed a full verify, with the stat signature they had then: an unchanged
# signature (size, mtime, ctime and inode of every file; ctime cannot be set back by a user)
# lets a resume verify once in `latest_valid_checkpoint` and not hash everything again in `load`.
_verified: dict[Path, tuple[tuple[str, int, int, int, int], ...]] = {}


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (names created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path, sync: bool) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of one file read in 4 MiB chunks; `sync` also fsyncs it."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        if sync:
            os.fsync(f.fileno())
        while n := f.readinto(buf):
            h.update(view[:n])  # releases the GIL: the thread pool hashes files in parallel
            size += n
    return size, h.hexdigest()


def digest_files(paths: list[Path], sync: bool = False) -> dict[str, tuple[int, str]]:
    """Size and sha256 of each file, keyed by file name, hashed in parallel threads."""
    if not paths:
        return {}
    workers = max(1, min(len(paths), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-hash") as pool:
        results = pool.map(lambda p: _digest(p, sync), paths)
        return {p.name: r for p, r in zip(paths, results)}


def write_manifest(directory: Path, step: int, world_size: int) -> dict[str, object]:
    """Hash and fsync every file in `directory`, then write its manifest atomically and fsync the
    directory. Called by one rank (rank 0) once every rank has written its files."""
    paths = sorted(p for p in directory.iterdir() if not p.name.startswith(MANIFEST))
    for p in paths:
        if not p.is_file():
            raise ValueError(f"{p} is not a regular file; a DCP checkpoint directory holds only files")
    files = {name: {"bytes": size, "sha256": sha}
             for name, (size, sha) in digest_files(paths, sync=True).items()}
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "files": files}
    tmp = directory / f"{MANIFEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    fsync_dir(directory)
    return manifest


def _label(name: str) -> str:
    return f"shard {name}" if name.endswith(".distcp") else f"file {name}"


def _manifest_problem(manifest: object) -> str | None:
    """Why a parsed manifest cannot be used, or None."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{MANIFEST} is not a gridtrain checkpoint manifest (no \"format\": \"{FORMAT}\")"
    if manifest.get("version") != VERSION:
        return (f"{MANIFEST} has format version {manifest.get('version')!r}; this gridtrain reads "
                f"version {VERSION}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} lists no files"
    for name, entry in files.items():
        if "/" in name or name in ("", ".", "..") or name.startswith(MANIFEST):
            return f"{MANIFEST} lists {name!r}, which is not a plain file name"
        if (not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int)
                or not _HEX64.match(str(entry.get("sha256")))):
            return f"{MANIFEST} entry for {name} lacks an integer \"bytes\" and a sha256 hex digest"
    if not isinstance(manifest.get("step"), int):
        return f"{MANIFEST} has no integer \"step\""
    return None


def read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) for a usable manifest in checkpoint directory `path`, else (None, reason)."""
    file = path / MANIFEST
    if not file.is_file():
        return None, (f"no {MANIFEST} (the save did not finish, or the checkpoint was written by "
                      "a gridtrain without manifests)")
    try:
        manifest = json.loads(read_input(file, MANIFEST, MAX_MANIFEST_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, UserError) as e:
        return None, f"cannot read {MANIFEST}: {e}"
    except (json.JSONDecodeError, RecursionError) as e:
        return None, f"{MANIFEST} is not valid JSON ({type(e).__name__}: {str(e)[:200]})"
    problem = _manifest_problem(manifest)
    if problem is None:
        match = _STEP_NAME.match(path.name)
        if match and int(match.group(1)) != manifest["step"]:
            problem = (f"{MANIFEST} is for step {manifest['step']}, but the directory is "
                       f"{path.name} (copied from another checkpoint?)")
    return (None, problem) if problem else (manifest, None)


def _signature(path: Path) -> tuple[tuple[str, int, int, int, int], ...]:
    stats = ((p.name, p.stat()) for p in path.iterdir())
    return tuple(sorted((n, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for n, s in stats))


def _check_files(path: Path, listed: dict[str, dict], deep: bool) -> list[str]:
    """The problems of the files in `path` against the manifest's `listed` table."""
    present = {p.name: p for p in path.iterdir() if p.name != MANIFEST}
    problems: list[str] = []
    to_hash: list[Path] = []
    for name in sorted(listed):
        want = listed[name]["bytes"]
        if name not in present:
            problems.append(f"{_label(name)} is missing (the manifest lists {want:,} bytes)")
            continue
        size = present[name].stat().st_size if present[name].is_file() and not present[name].is_symlink() else -1
        if size < 0:
            problems.append(f"{_label(name)} is not a regular file (a link, a device or a folder: gridtrain reads "
                            "nothing outside the checkpoint directory)")
        elif size != want:
            how = "truncated" if size < want else "longer than written"
            problems.append(f"{_label(name)} is {size:,} bytes, the manifest says {want:,} ({how})")
        else:
            to_hash.append(present[name])
    for name in sorted(set(present) - set(listed)):
        problems.append(f"{_label(name)} is not in the manifest (an extra file the save did not write)")
    if deep:
        for name, (_, sha) in sorted(digest_files(to_hash).items()):
            if sha != listed[name]["sha256"]:
                problems.append(f"{_label(name)} has sha256 {sha[:12]}..., the manifest says "
                                f"{listed[name]['sha256'][:12]}... (contents changed since the save)")
    return problems


def verify(path: Path, deep: bool = True) -> str | None:
    """None if checkpoint directory `path` is complete and intact, else why not, naming each bad
    file ("shard __0_0.distcp is 812 bytes, the manifest says 4,096 (truncated)"; several problems
    are joined by "; "). `deep=False` skips the sha256 (names and sizes only: cheap, for pruning).
    Reads only; safe on any rank."""
    if not path.is_dir():
        return f"{path} is not a directory"
    try:
        signature = _signature(path) if deep else ()
        if deep and _verified.get(path) == signature:
            return None
        manifest, problem = read_manifest(path)
        if manifest is None:
            return problem
        problems = _check_files(path, manifest["files"], deep)
    except OSError as e:
        return f"cannot read the checkpoint: {e}"
    if problems:
        _verified.pop(path, None)
        return "; ".join(problems)
    if deep:
        _verified[path] = signature
    return None
