"""Process-group start-up for a run launched by torchrun (or a world of one without it)."""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gridtrain.train.device import pick_device

log = logging.getLogger("gridtrain")

# Each rank keeps a ring buffer of its last collectives (gloo and NCCL alike): the accounting reads
# it every step, and it is what a hung run dumps. Must be set before the first process group.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20000")


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def init_world(timeout_s: float = 600.0) -> World:
    """Join the process group torchrun describes in the environment (gloo on CPU, NCCL for
    CUDA tensors); a plain `python -m gridtrain train` is a world of one with no process group."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device = pick_device()
    if world_size > 1 and not dist.is_initialized():
        backend = "gloo" if device.type == "cpu" else f"cpu:gloo,{device.type}:nccl"
        if device.type != "cpu":
            torch.accelerator.set_device_index(device.index)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = attempt_store(world_size, timeout)
        dist.init_process_group(backend, timeout=timeout, store=store,
                                **({"rank": rank, "world_size": world_size} if store else {}))
    return World(rank, world_size, local_rank, local_world, device)


def attempt_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun the agent hosts the store and, by default, keeps it across restarts while
    torch prefixes nothing per attempt: a restarted rank could read a dead peer's address from
    the previous attempt (gloo then fails with "Connection refused"). On one node every rank
    sees the same restart count, so each attempt gets its own prefix; across nodes the counts
    differ (only the failed node counts), so there the store must not be shared at all:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which `gridtrain train --nproc` sets. None: env://."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and \
            int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) != world_size:
        log.warning("torchrun restarts across nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every "
                    "node's environment: a shared store makes restarted ranks read stale addresses")
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"gridtrain/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (an all-reduce MAX of one int64 over the world)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def from_rank0(value: object) -> object:
    """Rank 0's `value` on every rank (a broadcast of one pickled object over the world)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown(finished: bool = False) -> None:
    """Leave the process group. After a finished run every rank first waits for the others:
    a rank that tears its gloo connections down while a peer still completes the last collective
    makes that peer abort ("terminate called without an active exception", seen in about one run
    in eight on this machine without the barrier). The barrier is itself such a collective: a
    rank can leave it while a peer still finishes it (the same abort, once in some 20 runs of 4
    ranks with it), so the ranks then also answer a roll call in the job's store, which holds no
    gloo connection, before any of them tears its connections down."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
            roll_call(f"gridtrain/finished/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        dist.destroy_process_group()


def roll_call(key: str, timeout_s: float = 60.0) -> None:
    """Wait until every rank of the default group has answered `key` in its store (answer_roll_call)."""
    answer_roll_call(dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), key,
                     timeout_s)


def answer_roll_call(store: dist.Store, rank: int, world: int, key: str, timeout_s: float = 60.0) -> None:
    """Add this rank to `key` in `store` and wait until all `world` ranks have (at most `timeout_s`; a
    peer gone by then is gone, and this rank leaves anyway). Rank 0 then also waits until every other
    rank has seen the count and left (`key`/left): `gridtrain train --nproc` runs without torchrun's
    agent store, so rank 0's process hosts the store, and a peer still polling it when rank 0 exits
    would fail its finished run ("Connection was likely closed")."""
    deadline = time.monotonic() + timeout_s
    _count_to(store, key, world, deadline)
    if rank == 0:
        _count_to(store, f"{key}/left", world, deadline)
    else:
        _add(store, f"{key}/left", 1)


def _count_to(store: dist.Store, key: str, world: int, deadline: float) -> None:
    """Add one to `key` and poll it until it reaches `world`, the deadline passes or the store is gone."""
    count = _add(store, key, 1)
    while count is not None and count < world and time.monotonic() < deadline:
        time.sleep(0.01)
        count = _add(store, key, 0)


def _add(store: dist.Store, key: str, value: int) -> int | None:
    """store.add; None when the store is gone (its host left after the roll call or its deadline)."""
    try:
        return store.add(key, value)
    except dist.DistError as err:
        log.debug("roll call: the store is gone (%s)", err)
        return None
