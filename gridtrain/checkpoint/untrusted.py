"""Reading a checkpoint someone else wrote without running their code or trusting its sizes.

A DCP checkpoint holds three kinds of thing, each a route to code execution or a runaway read if
taken on trust, and a manifest's checksums prove only that the files are the ones their author
wrote (the author can regenerate it):

- `.metadata` is a pickle. `MetadataUnpickler` admits only the classes DCP's metadata is made of
  (and the torch types they hold) and refuses anything else before constructing it.
- Any item `.metadata` marks as bytes (`BytesStorageMetadata`) is unpickled by DCP's default load
  planner with `torch.load(weights_only=False)`: a pickle that calls `os.system` runs. gridtrain
  writes no bytes items (checkpoint.state_of stores the optimizer's settings as tensors), so
  `check_metadata` refuses a checkpoint that has one, and `SafeLoadPlanner` refuses to unpickle
  one even if asked.
- Each item's `relative_path`, offset and length say where its bytes are: a path outside the
  checkpoint directory (`../../notes.bin`, `/dev/zero`) would read a file no manifest covers.
  Every one must name a file the manifest lists, and lie inside its size.

`SafeReader` reads `.metadata` once, checks all of the above and keeps the checked object, so
what DCP loads from is what was checked. Tensors themselves load through
`torch.load(weights_only=True)` (DCP's reader). `fit_problems` then compares a checkpoint's
shapes with the state it is to fill, before anything is allocated from it.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed._shard._utils import narrow_tensor_by_index  # what DCP's reader narrows with
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from gridtrain.errors import UserError
from gridtrain.inputs import read_input
from gridtrain.checkpoint.manifest import read_manifest

ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout (torch.strided) up by name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}


DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))
"""torch's dtype names (read from the module's own table: nothing is looked up by name, which
would import whatever torch loads lazily)."""
MAX_NESTING = 64
"""Containers in containers a .metadata may build: DCP's nest about 6 deep. A pickle of a tuple
nested a million deep is 2 MB, and hashing it crashes the interpreter (SIGSEGV) inside load()."""


class UntrustedCheckpointError(RuntimeError):
    """A checkpoint's metadata names something a gridtrain checkpoint never holds."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED or (module == "torch" and name in DTYPES):
            return super().find_class(module, name)
        raise UntrustedCheckpointError(
            f"its .metadata asks to load {module}.{name}, which no DCP checkpoint holds: it was crafted or "
            "damaged, and gridtrain refuses to unpickle it (nothing in it was run)")


def nesting(data: bytes) -> int:
    """How deep the objects a pickle builds are nested, read from its opcodes without building
    them: each opcode pops what pickletools says it takes and pushes one level above the deepest
    of those; the memo keeps each stored object's depth. Raises ValueError for a malformed pickle."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[object, int] = {}
    deepest = 0
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[arg if op.name != "MEMOIZE" else len(memo)] = stack[-1] if stack else 0
            continue
        if op.name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg, 0))
            continue
        popped: list[int] = []
        for kind in reversed(op.stack_before):
            if kind is pickletools.stackslice:
                popped += stack[marks[-1]:]
                del stack[marks[-1]:]
            elif kind is pickletools.markobject:
                marks.pop()
            elif stack:
                popped.append(stack.pop())
        for kind in op.stack_after:
            if kind is pickletools.markobject:
                marks.append(len(stack))
            else:
                stack.append(max(popped) + 1 if popped else 0)
                deepest = max(deepest, stack[-1])
        if deepest > MAX_NESTING:
            break
    return deepest


def _is_size(value: object, ndim: int | None = None) -> bool:
    return (isinstance(value, (torch.Size, tuple)) and (ndim is None or len(value) == ndim)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value))


def _tensor_problem(key: str, item: object) -> str | None:
    """Why item `key` of `.metadata` is not a plain tensor entry, or None."""
    if isinstance(item, BytesStorageMetadata):
        return (f"its .metadata marks {key!r} as a pickled bytes item, which gridtrain checkpoints never "
                "hold (DCP would unpickle it with torch.load(weights_only=False)): it was crafted, or written "
                "by a gridtrain that stored the optimizer's settings as pickles; gridtrain refuses to read it")
    if not isinstance(item, TensorStorageMetadata):
        return f"its .metadata describes {key!r} as a {type(item).__name__}, not a tensor"
    dtype = getattr(getattr(item, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype) or not _is_size(item.size) or not isinstance(item.chunks, list):
        return f"its .metadata entry for {key!r} lacks a dtype, a size or a list of chunks"
    covered = 0
    for chunk in item.chunks:
        if not (isinstance(chunk, ChunkStorageMetadata) and _is_size(chunk.offsets, len(item.size))
                and _is_size(chunk.sizes, len(item.size))
                and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, item.size))):
            return f"its .metadata gives {key!r} (size {list(item.size)}) a chunk outside it"
        covered += math.prod(chunk.sizes)
    if covered != math.prod(item.size):  # with chunks inside it and apart (DCP refuses overlaps)
        return (f"its .metadata's chunks of {key!r} hold {covered:,} elements, the tensor has "
                f"{math.prod(item.size):,} (a load would leave the rest uninitialized)")
    return None


def _storage_problem(index: object, info: object, files: Mapping[str, int], keys: Mapping[str, object]) -> str | None:
    """Why one entry of `.metadata`'s storage table is not a place inside a listed file, or None."""
    fqn = getattr(index, "fqn", None)
    path = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if fqn not in keys:
        return f"its .metadata stores bytes for {fqn!r}, which it does not describe"
    if not isinstance(path, str) or path not in files:
        return (f"its .metadata reads {fqn!r} from {path!r}, which is not a file of the checkpoint's manifest "
                "(gridtrain reads nothing outside the checkpoint directory)")
    if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
            and offset + length <= files[path]):
        return (f"its .metadata reads {fqn!r} at bytes {offset!r}+{length!r} of {path}, which has "
                f"{files[path]:,} bytes")
    if getattr(info, "transform_descriptors", None):
        return (f"its .metadata asks to transform {fqn!r} on reading ({info.transform_descriptors}), which "
                "gridtrain never writes")
    return None


def metadata_problem(metadata: object, files: Mapping[str, int]) -> str | None:
    """Why `metadata` is not the metadata of a plain gridtrain checkpoint whose files (name: bytes)
    are `files`, or None."""
    if not isinstance(metadata, Metadata):
        return f"its .metadata holds a {type(metadata).__name__}, not DCP's Metadata"
    keys, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(keys, dict) or not isinstance(storage, dict):
        return "its .metadata lacks the table of tensors or of where they are stored"
    if not isinstance(metadata.storage_meta, (StorageMeta, type(None))):
        return f"its .metadata's storage_meta is a {type(metadata.storage_meta).__name__}"
    for key, item in keys.items():
        if not isinstance(key, str):
            return f"its .metadata names a tensor by a {type(key).__name__}, not a string"
        if problem := _tensor_problem(key, item):
            return problem
    for index, info in storage.items():
        if problem := _storage_problem(index, info, files, keys):
            return problem
    for key, item in keys.items():
        missing = next((c for c in item.chunks if MetadataIndex(key, c.offsets) not in storage), None)
        if missing is not None:
            return f"its .metadata stores no bytes for the chunk of {key!r} at {list(missing.offsets)}"
    return None


class SafeReader(FileSystemReader):
    """DCP's file reader for a checkpoint someone else may have written: `.metadata` is read once,
    through MetadataUnpickler, checked against the manifest (module docstring) and kept, so DCP
    loads from exactly what was checked. Raises UntrustedCheckpointError."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.checkpoint = Path(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank files gridtrain never writes
            raise UntrustedCheckpointError("it has no global .metadata (gridtrain writes one)")
        if self._metadata is None:
            self._metadata = self._read_checked()
        self._metadata.storage_meta = self._metadata.storage_meta or StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _read_checked(self) -> Metadata:
        manifest, problem = read_manifest(self.checkpoint)
        if manifest is None:
            raise UntrustedCheckpointError(f"it cannot be verified: {problem}")
        files = {name: entry["bytes"] for name, entry in manifest["files"].items()}
        if ".metadata" not in files:
            raise UntrustedCheckpointError("its manifest does not list .metadata")
        try:
            data = read_input(self.checkpoint / ".metadata", "its .metadata", files[".metadata"],
                              error=UntrustedCheckpointError)
            if len(data) != files[".metadata"]:
                raise UntrustedCheckpointError("its .metadata is not the file its manifest lists")
            if nesting(data) > MAX_NESTING:
                raise UntrustedCheckpointError(f"its .metadata nests objects more than {MAX_NESTING} deep, which "
                                               "no DCP checkpoint does: it was crafted, and gridtrain refuses to read it")
            metadata = MetadataUnpickler(io.BytesIO(data)).load()
            problem = metadata_problem(metadata, files)
        except UserError as err:
            raise UntrustedCheckpointError(str(err)) from None
        except UntrustedCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever a crafted pickle makes a reader raise
            raise UntrustedCheckpointError(f"its .metadata cannot be read ({type(err).__name__}: {err})"[:500]) from None
        if problem:
            raise UntrustedCheckpointError(problem)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, item by item, each tensor's bytes checked (`tensor_blob_problem`) before
        torch.load(weights_only=True) unpacks them."""
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            with open(self.checkpoint / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(blob))  # SafeLoadPlanner refuses
                continue
            target = planner.resolve_tensor(item).detach()
            meta = self._metadata.state_dict_metadata[item.storage_index.fqn]
            want = math.prod(self._chunk_sizes(item)) * meta.properties.dtype.itemsize
            if problem := tensor_blob_problem(blob, want):
                raise UntrustedCheckpointError(f"its shard {info.relative_path} holds {item.storage_index.fqn!r} "
                                               f"{problem}")
            tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
            if target.size() != tensor.size():
                raise UntrustedCheckpointError(f"its {item.storage_index.fqn!r} has shape {list(tensor.size())} "
                                               f"where {list(target.size())} was asked for")
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _chunk_sizes(self, item: Any) -> tuple[int, ...]:
        """The stored chunk's sizes (the whole chunk DCP reads, before it narrows)."""
        meta = self._metadata.state_dict_metadata[item.storage_index.fqn]
        chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(item.storage_index.offset))
        return tuple(chunk.sizes)


def tensor_blob_problem(blob: bytes, expected_bytes: int) -> str | None:
    """Why one stored tensor (torch.save's zip) is not plain: torch.save stores every entry
    uncompressed, so a compressed entry can only be a bomb (a few MB that inflate to GBs in
    torch.load); and its data record must hold at most the chunk's bytes. None when plain."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        return f"in a form torch.save does not write ({err})"
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED:
            return f"compressed ({entry.filename}: {entry.compress_size:,} bytes inflating to {entry.file_size:,})"
        if "/data/" in entry.filename and entry.file_size > expected_bytes:
            return f"as {entry.file_size:,} bytes where the chunk has {expected_bytes:,}"
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner that never unpickles a bytes item (the metadata check refuses them first;
    this is the second lock on the same door)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UntrustedCheckpointError(f"it holds a pickled bytes item ({read_item.dest_index.fqn!r}), which "
                                       "gridtrain refuses to unpickle")


def check_metadata(path: str | Path) -> SafeReader:
    """A SafeReader of checkpoint directory `path` whose metadata has been read and checked (raise
    UntrustedCheckpointError if it cannot be); pass it on to dcp.load."""
    reader = SafeReader(path)
    reader.read_metadata()
    return reader


def flat_shapes(state: Mapping[str, Any], prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Every tensor of a nested state dict by DCP's flattened key ("model.norm.weight"), with its
    global shape (a DTensor's whole shape, not its shard's)."""
    out: dict[str, tuple[int, ...]] = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            out.update(flat_shapes(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = tuple(value.shape)
    return out


def fit_problems(metadata: Metadata, wanted: Mapping[str, tuple[int, ...]], limit: int = 4) -> list[str]:
    """How a checkpoint's tensors differ from the `wanted` shapes (flattened key: shape): the keys
    it lacks and the shapes that differ, at most `limit` of them and a count of the rest."""
    keys = metadata.state_dict_metadata
    problems = [f"{key} is missing" if key not in keys else
                f"{key} is {list(keys[key].size)} there, {list(shape)} here"
                for key, shape in wanted.items() if key not in keys or tuple(keys[key].size) != tuple(shape)]
    if len(problems) > limit:
        problems = problems[:limit] + [f"{len(problems) - limit} more"]
    return problems
