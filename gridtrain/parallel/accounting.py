"""Accounting: bytes each rank holds per memory bucket, and bytes it moves per collective and axis.

Memory buckets, per rank, at rest after an optimizer step:
- parameters, gradients, optimizer state: the local storage of each tensor (a DTensor counts its
  local shard only, so ZeRO-3 over N ranks holds 1/N of the parameter bytes);
- activations: bytes saved for backward up to the first backward, measured with saved-tensor
  hooks, each storage counted once; parameters (saved by matmuls for their input gradient, also
  FSDP's gathered copies) and buffers are excluded.

Collectives come from the flight recorder every rank keeps (TORCH_FR_BUFFER_SIZE, gloo and NCCL
alike), which sees what DDP, FSDP, DTensor and pipelining issue from C++ as well as Python.
Per collective: the payload (all-reduce and reduce-scatter: the full input; all-gather: the full
output; send: the message) and the bytes a rank puts on the wire under the ring algorithm over a
group of N: all-reduce 2(N-1)/N x payload, all-gather and reduce-scatter (N-1)/N x payload,
send and broadcast the payload.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from gridtrain.parallel.parallelize import SELECTIVE_SAVE_OBSERVERS

DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Short": 2,
               "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}


def local_bytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def param_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(local_bytes(p) for p in params)


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(local_bytes(p.grad) for p in params if p.grad is not None)


def optimizer_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Local bytes of every optimizer-state tensor (ZeroRedundancyOptimizer: its own shard)."""
    total = 0
    for opt in optimizers:
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local one here
        for state in inner.state.values():
            total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


class SavedActivations:
    """Context manager: bytes saved for backward from the start until the first backward begins,
    each storage once, parameters excluded. That is what a rank holds at the turn from forward to
    backward: one micro-batch without a pipeline; the warm-up micro-batches of its stages with one
    (1F1B), or all of them (GPipe). Nothing saved is freed before that turn, so a storage address
    seen twice is the same storage."""

    def __init__(self, params: Iterable[torch.Tensor], buffers: Iterable[torch.Tensor] = (),
                 modules: Iterable[torch.nn.Module] = ()) -> None:
        # Parameters and buffers (RoPE tables) are saved by reference, not held for backward.
        # (Collecting FSDP's gathered storages by address instead is unsound: FSDP frees them
        # after each block and the allocator hands the addresses to later activations.) The
        # gathered parameters FSDP registers on `modules` while a block runs are looked up there
        # when something is saved: a matmul saves its gathered weight, which is not an activation.
        self._param_ptrs = {_storage_ptr(p) for p in (*params, *buffers)}
        self._modules = list(modules)
        self._seen: set[tuple[int, int]] = set()
        self._in_backward = False
        self.bytes = 0
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self._in_backward = True
        return t

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        if self._in_backward or local.device.type == "meta":
            return t
        base = local._base if local._base is not None else local
        if isinstance(base, torch.nn.Parameter):  # a parameter or a view of one, such as FSDP's
            return t                              # gathered copy, transposed
        try:
            ptr = _storage_ptr(local)
            key = (ptr, local.untyped_storage().nbytes())
        except RuntimeError:  # a tensor without a plain storage (a wrapper subclass): its own bytes
            self.bytes += local.numel() * local.element_size()
            return t
        if ptr in self._param_ptrs or key in self._seen:
            return t
        # A gathered weight under TP is the plain local tensor of a DTensor parameter: a leaf
        # that needs no gradient (checked first: looking it up costs a pass over the parameters).
        if not (local.is_leaf and not local.requires_grad and self._gathered(ptr)):
            self._seen.add(key)
            self.bytes += key[1]
        return t

    def _gathered(self, ptr: int) -> bool:
        """Whether `ptr` is the storage of a parameter registered on the modules now (FSDP's
        gathered copy while its block runs)."""
        return any(_storage_ptr(p) == ptr for module in self._modules for p in module.parameters())

    def _selective(self, output: object) -> None:
        """Outputs that selective checkpointing keeps in its own cache (parallelize.py)."""
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor):
                self._pack(t)

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        SELECTIVE_SAVE_OBSERVERS.append(self._selective)
        return self

    def __exit__(self, *exc: object) -> None:
        SELECTIVE_SAVE_OBSERVERS.remove(self._selective)
        self._hooks.__exit__(*exc)


def _storage_ptr(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    if is_fake(t):  # no address: the storage object stands for it (alive as long as the storage)
        return id(t.untyped_storage())
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return -1


def _kind(profiling_name: str) -> str:
    name = profiling_name.split(":")[-1].lower().replace("allreduce", "all_reduce")
    for kind in ("all_reduce", "reduce_scatter", "all_to_all", "broadcast", "barrier", "send", "recv"):
        if kind in name or kind.replace("_", "") in name:
            return kind
    if "gather" in name:
        return "all_gather"
    return name


def _numel(sizes: list[list[int]]) -> int:
    total = 0
    for shape in sizes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


WIRE_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "broadcast": lambda n: 1.0, "send": lambda n: 1.0, "recv": lambda n: 0.0,
               "barrier": lambda n: 0.0}


class CollectiveLog:
    """Reads this rank's flight recorder and sums the collectives issued since `start()`."""

    def __init__(self, axis_groups: dict[str, dist.ProcessGroup]) -> None:
        # Several axes may share one group (an axis of size 1 is never asked for): first wins.
        self.axis_of: dict[str, str] = {}
        self.axis_size: dict[str, int] = {}
        for axis, group in axis_groups.items():
            self.axis_of.setdefault(group.group_name, axis)
            self.axis_size.setdefault(axis, group.size())
        self._last_id = self._seen = -1

    def axis(self, process_group: list[str]) -> str:
        """The mesh axis of a recorded (name, description) group. Slicing a mesh can create more
        than one group over the same ranks (DTensor's TP under a pipeline or DDP, FSDP's norms):
        those carry the description 'mesh_<axis>'; any other group keeps its number."""
        name, desc = process_group[0], process_group[1] if len(process_group) > 1 else ""
        if name in self.axis_of:
            return self.axis_of[name]
        return desc[len("mesh_"):] if desc.startswith("mesh_") else f"group{name}"

    @staticmethod
    def _entries() -> list[dict]:
        raw = torch._C._distributed_c10d._dump_fr_trace_json(True, False)
        return json.loads(raw).get("entries", [])

    def start(self) -> None:
        entries = self._entries()
        self._last_id = self._seen = entries[-1]["record_id"] if entries else -1

    def skip(self, count: int) -> None:
        """Start again after the next `count` collectives since the last read, leaving them out.
        Reading the recorder costs about a second once it is full (20,000 entries), so a window
        that follows a known number of collectives starts by counting, not by reading."""
        self._last_id = self._seen + count

    def since_start(self) -> dict[str, dict[str, float]]:
        """{axis: {kind_bytes: payload, kind_wire_bytes: ring bytes on the wire, kind_calls: n}}."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        entries = self._entries()
        if entries and entries[0]["record_id"] > self._last_id + 1 >= 1:
            raise RuntimeError(f"the flight recorder holds {len(entries)} collectives, fewer than this step made: "
                               "its oldest were overwritten before they were counted; raise TORCH_FR_BUFFER_SIZE")
        for e in entries:
            self._seen = max(self._seen, e["record_id"])
            if e["record_id"] <= self._last_id:
                continue
            kind = _kind(e["profiling_name"])
            axis = self.axis(e["process_group"])
            n = self.axis_size.get(axis, 1)
            sizes = e["output_sizes"] if kind == "all_gather" else e["input_sizes"]
            dtypes = e["output_dtypes"] if kind == "all_gather" else e["input_dtypes"]
            elem = DTYPE_BYTES.get(dtypes[0], 4) if dtypes else 4
            payload = _numel(sizes) * elem
            out[axis][f"{kind}_bytes"] += payload
            out[axis][f"{kind}_wire_bytes"] += payload * WIRE_FACTOR.get(kind, lambda n: 1.0)(n)
            out[axis][f"{kind}_calls"] += 1
        return {axis: dict(v) for axis, v in out.items()}


    def last(self, count: int = 20) -> list[dict[str, object]]:
        """This rank's last `count` collectives, oldest first, readable: sequence number per group,
        kind, mesh axis, payload bytes, shapes, dtype, seconds since issued and the timeout."""
        now, records = time.time_ns(), []
        for e in self._entries()[-count:]:
            kind = _kind(e["profiling_name"])
            sizes = e["output_sizes"] if kind == "all_gather" else e["input_sizes"]
            dtypes = e["output_dtypes"] if kind == "all_gather" else e["input_dtypes"]
            records.append({"seq": e.get("p2p_seq_id") if e.get("is_p2p") else e["collective_seq_id"],
                            "kind": kind, "axis": self.axis(e["process_group"]),
                            "bytes": _numel(sizes) * (DTYPE_BYTES.get(dtypes[0], 4) if dtypes else 4),
                            "shapes": sizes, "dtype": dtypes[0] if dtypes else None,
                            "age_s": round((now - e["time_created_ns"]) / 1e9, 3),
                            "timeout_ms": e.get("timeout_ms")})
        return records


_FR_DTYPES = {torch.float32: "Float", torch.bfloat16: "BFloat16", torch.float16: "Half", torch.float64: "Double",
              torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
              torch.uint8: "Byte", torch.bool: "Bool"}


def _collective_ops() -> dict[object, tuple[str, Callable]]:
    """op -> (kind, args -> (tensors whose sizes are the payload, process group or its name,
    size multiplier of dim 0)): the collectives FSDP, DDP and DTensor issue, as the flight
    recorder would log them (all-gathers by their output, the rest by their input). Point-to-point
    sends are left to PipelineTraffic, as on a real run."""
    c10d, fn = torch.ops.c10d, torch.ops._c10d_functional
    return {
        c10d._allgather_base_.default: ("all_gather", lambda a: ([a[0]], a[2], 1)),
        c10d.allgather_.default: ("all_gather", lambda a: ([t for ts in a[0] for t in ts], a[2], 1)),
        c10d.allgather_into_tensor_coalesced_.default: ("all_gather", lambda a: (a[0], a[2], 1)),
        c10d._reduce_scatter_base_.default: ("reduce_scatter", lambda a: ([a[1]], a[2], 1)),
        c10d.reduce_scatter_.default: ("reduce_scatter", lambda a: ([t for ts in a[1] for t in ts], a[2], 1)),
        c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", lambda a: (a[1], a[2], 1)),
        c10d.allreduce_.default: ("all_reduce", lambda a: (a[0], a[1], 1)),
        c10d.broadcast_.default: ("broadcast", lambda a: (a[0], a[1], 1)),
        c10d.alltoall_base_.default: ("all_to_all", lambda a: ([a[1]], a[2], 1)),
        fn.all_gather_into_tensor.default: ("all_gather", lambda a: ([a[0]], a[2], a[1])),
        fn.all_gather_into_tensor_coalesced.default: ("all_gather", lambda a: (a[0], a[2], a[1])),
        fn.reduce_scatter_tensor.default: ("reduce_scatter", lambda a: ([a[0]], a[3], 1)),
        fn.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", lambda a: (a[0], a[3], 1)),
        fn.all_reduce.default: ("all_reduce", lambda a: ([a[0]], a[2], 1)),
        fn.all_reduce_.default: ("all_reduce", lambda a: ([a[0]], a[2], 1)),
        fn.all_to_all_single.default: ("all_to_all", lambda a: ([a[0]], a[3], 1)),
        fn.broadcast.default: ("broadcast", lambda a: ([a[0]], a[2], 1)),
    }


class DispatchedCollectives(CollectiveLog, TorchDispatchMode):
    """The same log, kept by watching the collective ops go by instead of reading the flight
    recorder: for a fake process group (a dry run), which has none. The records have the flight
    recorder's fields, so the sums are CollectiveLog's."""

    def __init__(self, axis_groups: dict[str, dist.ProcessGroup]) -> None:
        CollectiveLog.__init__(self, axis_groups)
        TorchDispatchMode.__init__(self)
        self.records: list[dict] = []
        self._ops = _collective_ops()

    def _entries(self) -> list[dict]:  # type: ignore[override]
        return self.records

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor's own collectives come back here as functional ops
        if func in self._ops:
            self._record(*self._ops[func], args)
        return func(*args, **(kwargs or {}))

    def _record(self, kind: str, extract: Callable, args: tuple) -> None:
        tensors, pg, gathered = extract(args)
        if isinstance(pg, str):  # a functional collective names its group
            named = {name: group for group, name in dist.distributed_c10d._world.pg_names.items()}
            pg = named.get(pg)  # None: a group torch made for itself and did not name: its name only
        elif not isinstance(pg, dist.ProcessGroup):
            pg = dist.ProcessGroup.unbox(pg)
        group = [pg.group_name, pg.group_desc] if pg is not None else [extract(args)[1], ""]
        sizes = [list(t.shape) for t in tensors]
        if gathered > 1:  # a functional all-gather is logged by its output, `gathered` times its input
            sizes = [[s[0] * gathered, *s[1:]] for s in sizes]
        dtypes = [_FR_DTYPES.get(t.dtype, str(t.dtype)) for t in tensors]
        self.records.append({"record_id": len(self.records), "profiling_name": f"fake:{kind}",
                             "process_group": group, "input_sizes": sizes,
                             "output_sizes": sizes, "input_dtypes": dtypes, "output_dtypes": dtypes})


def flatten_comm(comm: dict[str, dict[str, float]]) -> dict[str, float]:
    """{axis: {key: v}} -> {'comm/axis/key': v} for the metrics writer."""
    return {f"comm/{axis}/{key}": value for axis, kinds in comm.items() for key, value in kinds.items()}
