"""Replica groups that drop out and rejoin while the others train: HSDP's dp_replicate axis as
torchft replica groups (fault_tolerance.*).

Each of parallel.dp_replicate replica groups is its own torchrun job, FSDP over its dp_shard ranks.
At the start of every step the groups meet at torchft's lighthouse (`Manager.start_quorum`,
synchronous, so the step knows who takes part before it reads data): the quorum's `n` live groups
split the global batch among themselves, group `r` (its rank in the quorum) reading the slice of
data-parallel ranks r*dp_shard .. (r+1)*dp_shard-1 of n*dp_shard. FSDP's reduce-scatter sums the
gradient shards inside the group; its all-reduce hook (torchtitan's wiring) then sums each shard
across the live groups through torchft's managed process group (a gloo group the Manager rebuilds
at every change of quorum), over the bytes of one gradient shard per rank. The step commits only
when every live group finished it (`Manager.should_commit`): a group that dies inside the step
makes the survivors' all-reduce fail, they skip the optimizer step and redo the same step with the
new quorum, so no step is applied twice or lost.

A group that starts while the others train (a restarted one) is behind the quorum's step: torchft
sends it the live peer's state (model and optimizer shards of the same shard rank, and the
trainer's step, RNG and precision state) over its HTTP checkpoint transport before the step runs
(received with torch.load(weights_only=True), not torchft's default weights_only=False: a peer's
bytes are input like a checkpoint's, and no pickle from the wire runs: safe_transport);
nothing is read from a checkpoint.

DDP and ZeRO-1 replicas are refused under fault tolerance (validate_faults.check_fault_tolerance):
torchft's DDP wrapper fails the survivor when a peer dies inside an all-reduce (`assert fut._fut`
in torchft/ddp.py), so the groups are always FSDP (zero_stage 2 or 3) inside.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gridtrain.config import Config

log = logging.getLogger("gridtrain")


@dataclass(frozen=True)
class Quorum:
    """The step's replica groups: `live` of them, this one `rank`-th; `healed`: this group was
    just sent a live peer's state."""

    live: int
    rank: int
    healed: bool


def safe_transport(timeout: timedelta):  # noqa: ANN201 - a torchft CheckpointTransport
    """torchft's HTTP checkpoint transport, whose receiving side loads a peer's state with
    torch.load(weights_only=True): tensors, numbers, strings and containers of them, and no
    pickled callable (torchft's own loads with weights_only=False, for learning-rate schedulers we
    do not send)."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class SafeHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return SafeHTTPTransport(timeout=timeout, num_chunks=0)


def _local(value: Any) -> Any:
    """A state dict with every DTensor replaced by this rank's shard (what the transport sends)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _local(t).detach().clone() for name, t in model.state_dict().items()}


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in model.state_dict().items():
            _local(t).copy_(state[name])


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return _local(opt.state_dict())


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a peer's optimizer shards, wrapping each one as its parameter is (a DTensor shard)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    full: dict[int, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        p = params[int(index)]
        full[index] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False)
                       if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0 else v
                       for k, v in entry.items()}
    opt.load_state_dict({"state": full, "param_groups": state["param_groups"]})


class ReplicaGroups:
    """This job's side of the torchft replica groups: its Manager (which talks to the lighthouse),
    the managed process group across groups, and the state a rejoining peer is sent."""

    def __init__(self, cfg: Config, rank: int, world_size: int) -> None:
        # torchft logs each quorum and commit of every rank (its Rust side through RUST_LOG), and on
        # CPU that it cannot reset NCCL's flight recorder: gridtrain's own lines say what changed.
        os.environ.setdefault("RUST_LOG", "warn")
        logging.getLogger("torchft").setLevel(logging.ERROR)
        from torchft import Manager, ProcessGroupGloo

        ft = cfg.fault_tolerance
        self.group, self.groups = ft.replica_group, cfg.parallel.dp_replicate
        timeout = timedelta(seconds=ft.timeout_s)
        self.manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                               checkpoint_transport=safe_transport(timeout),
                               min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=timeout,
                               quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), rank=rank,
                               world_size=world_size, lighthouse_addr=ft.lighthouse,
                               replica_id=f"gridtrain_{ft.replica_group}")
        self.rank, self.quorum_timeout_s = rank, ft.quorum_timeout_s
        self.live = self.groups
        self.short_steps: list[int] = []
        if rank == 0:
            log.info("fault tolerance: replica group %d of %d (FSDP over %d ranks inside), lighthouse %s; the live "
                     "groups split the global batch of %d sequences each step", self.group, self.groups, world_size,
                     ft.lighthouse, cfg.global_batch_seqs)

    def register(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                 trainer_state: Callable[[], dict[str, Any]], load_trainer_state: Callable[[dict[str, Any]], None]) -> None:
        """What a rejoining group is sent, and how it takes it; and the gradient all-reduce across
        groups (FSDP's all-reduce hook on every FSDP module: a sum, the trainer divides the loss).
        `step`: the step this job resumed (from its own checkpoint, under a torchrun restart): a
        group behind the live ones' step takes their state at its first quorum."""
        from torchft.process_group import ManagedProcessGroup

        self.manager.load_state_dict({"step": step, "batches_committed": step * self.groups})
        def state() -> dict[str, Any]:
            return {"model": model_state(model), "optim": optimizer_state(optimizer), "trainer": trainer_state()}

        def load(sd: dict[str, Any]) -> None:
            load_model_state(model, sd["model"])
            load_optimizer_state(optimizer, sd["optim"])
            load_trainer_state(sd["trainer"])

        self.manager.register_state_dict_fn("gridtrain", load, state)
        self.pg = ManagedProcessGroup(self.manager)

        def all_reduce(grad: torch.Tensor) -> None:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.pg)

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(all_reduce)

    def begin_step(self, step_now: Callable[[], int]) -> Quorum:
        """Wait for the quorum of the step after `step_now()` (and, behind it, take a live peer's
        state, step included); log a change in the number of live groups."""
        step = step_now()
        before = self.manager.current_step()
        self.manager.start_quorum()
        if before == 0 and step == 0:  # a fresh job starts with all its groups, or what came in time
            deadline = time.monotonic() + self.quorum_timeout_s
            while self.manager.num_participants() < self.groups and self.manager.current_step() == 0 \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
                self.manager.start_quorum()
        live, rank = self.manager.num_participants(), self.manager.participating_rank()
        if rank is None:
            raise RuntimeError(f"replica group {self.group} takes no part in the quorum of step {step + 1}")
        healed = self.manager.current_step() != before
        if (live != self.live or healed) and self.rank == 0:
            log.warning("fault tolerance: %d of %d replica groups live from step %d%s", live, self.groups,
                        step_now() + 1, " (this group rejoined: it took a live peer's state)"
                        if healed else "")
        self.live = live
        return Quorum(live, rank, healed)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a scalar across the live groups (the loss of the global batch)."""
        self.manager.allreduce(value, reduce_op=dist.ReduceOp.SUM).wait()
        return value

    def commit(self, step: int) -> bool:
        """Whether every live group finished the step (then, and only then, step the optimizer)."""
        ok = self.manager.should_commit()
        if ok and self.live < self.groups:
            self.short_steps.append(step)
        if not ok and self.rank == 0:
            log.warning("fault tolerance: step %d did not complete on every live replica group: redone with the "
                        "next quorum", step)
        return ok

    def shutdown(self) -> None:
        if self.short_steps and self.rank == 0:
            log.info("fault tolerance: steps that ran with fewer than %d replica groups: %s", self.groups,
                     _ranges(self.short_steps))
        self.manager.shutdown(wait=False)


def _ranges(steps: list[int]) -> str:
    """'6-11, 14' for [6, ..., 11, 14]."""
    out: list[str] = []
    for s in sorted(set(steps)):
        if out and int(out[-1].split("-")[-1]) == s - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)
