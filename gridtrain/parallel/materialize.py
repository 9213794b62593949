"""Sharded initialisation: a model built on the meta device and already parallelised gets real
memory for its own shards only, then each shard is filled with its slice of the one-process
initial weights.

The model is never whole on any rank. `model.llama.init_values` yields the full initial value of
one parameter at a time from the seeded global RNG; every rank draws every value (so the RNG
advances identically everywhere and ends where one process's does), copies the part it holds
(a plain tensor whole, a DTensor's local chunk as `distribute_tensor` would place it, with no
communication) and drops the rest. So a rank holds its shards plus one full parameter at a time,
and the weights are the same numbers whatever the layout, bit for bit. (torchtitan initialises
DTensors with DTensor's own random ops, whose numbers depend on the layout, and writes a seed
checkpoint for pipelines; drawing the one-process values keeps every layout's parity with one
process exact, at the cost of each rank drawing the whole model's numbers once.)
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, distribute_tensor

from gridtrain.model.args import ModelArgs
from gridtrain.model.llama import Transformer, init_values

# Prefixes that wrappers put into parameter names (state-dict keys drop them already).
_WRAPPER_PREFIXES = (_CHECKPOINT_PREFIX, "_orig_mod.")


def model_name(name: str) -> str:
    """A parameter's name in the unwrapped model (`layers.0.attention.wq.weight`)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def is_meta(parts: list[nn.Module]) -> bool:
    return any(p.is_meta for part in parts for p in part.parameters())


@torch.no_grad()
def materialize(parts: list[Transformer], args: ModelArgs, seed: int, device: torch.device,
                fake: FakeTensorMode | None = None) -> None:
    """Allocate this rank's shards of `parts` (meta until now) on `device` and initialise them to
    their slices of the one-process initial weights for `seed`; rebuild the RoPE tables. With
    `fake` (a dry run) the shards are fake tensors of that mode: no memory, and no values to fill."""
    own: dict[str, torch.Tensor] = {}
    for part in parts:
        with fake or contextlib.nullcontext():
            part.to_empty(device=device)
            part.after_to_empty()
        own.update((model_name(name), p) for name, p in part.named_parameters())
    if fake is not None:
        return
    for name, value in init_values(args, seed):
        param = own.get(name)
        if param is None:  # another rank's stage
            continue
        if isinstance(param, DTensor):
            value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param = param.to_local()
        param.copy_(value)
