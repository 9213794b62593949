"""Bytes of tensor memory a process holds, measured as it runs: a dispatch mode that sees every
storage an op allocates and notices when it is freed or resized.

Used to check by measurement, not by reading the code, that building a layout never holds the
whole model on one rank, and by the dry run to report a rank's peak under fake tensors (a fake
tensor's storage has the byte size the real one would have, and no memory behind it).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while the mode is on (and of those
    passed to `track`). FSDP frees and re-allocates its gathered parameters by resizing their
    storage, so `UntypedStorage.resize_` is followed too.

        with LiveBytes() as live:
            ...
        live.peak, live.live
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage key -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._resize: Callable | None = None
        self._fake_on_entry = None

    def reset_peak(self) -> None:
        """Start the peak afresh from what is alive now (to measure a later phase alone)."""
        self.peak = self.live

    def track(self, tensors: Any) -> None:
        """Count tensors made before the mode was entered (a pytree of them)."""
        tree_map_only(torch.Tensor, self._add, tensors)

    def _add(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):  # its memory is its local shard's
            t = t._local_tensor
        if t.is_meta or (type(t) is not torch.Tensor and not hasattr(t, "fake_mode")):
            return  # no memory behind it, or a wrapper subclass whose inner tensors are seen when made
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs and self._refs[key]() is storage:
            return
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._freed(key))
        self._sizes[key] = 0
        self._set(key, storage.nbytes())

    def _set(self, key: int, nbytes: int) -> None:
        self.live += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here one by one
        out = func(*args, **(kwargs or {}))
        # DTensor's sharding propagation runs ops under a fake mode of its own: not memory.
        if active_fake_mode() is self._fake_on_entry:
            tree_map_only(torch.Tensor, self._add, out)
        return out

    def __enter__(self) -> LiveBytes:
        self._fake_on_entry = active_fake_mode()
        original = self._resize = torch.UntypedStorage.resize_
        live = self

        def resize_(storage: torch.UntypedStorage, size: int) -> None:
            original(storage, size)
            key = id(storage)
            if key in live._refs and live._refs[key]() is storage:
                live._set(key, size)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)
