"""Reading a checkpoint someone else wrote without running their code.

A DCP checkpoint's tensors load through `torch.load(weights_only=True)`, but its `.metadata` is a
pickle, and a manifest's checksums only prove the files are the ones its author wrote: a crafted
`.metadata` whose pickle calls `os.system` would run on `gridtrain export` or a resume. `SafeReader`
reads `.metadata` with an unpickler that admits only the classes DCP's metadata is made of (and
the torch types they hold: sizes, dtypes, the layout and memory-format tags) and refuses anything
else before constructing it. Every checkpoint read in gridtrain goes through it.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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


class UntrustedCheckpointError(RuntimeError):
    """A checkpoint's metadata names something a DCP checkpoint never holds."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UntrustedCheckpointError(
            f"its .metadata asks to load {module}.{name}, which no DCP checkpoint holds: it was crafted or "
            "damaged, and gridtrain refuses to unpickle it (nothing in it was run)")


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read through MetadataUnpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise UntrustedCheckpointError(f"its .metadata holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_metadata(path) -> None:
    """Raise UntrustedCheckpointError if the checkpoint directory's .metadata is not plain DCP
    metadata (read once, before any collective load starts)."""
    SafeReader(path).read_metadata()
