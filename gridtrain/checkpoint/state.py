"""What a checkpoint holds, and reading it back without trusting it.

`state_of` is the one state dict every save writes: model and optimizer state keyed by global
parameter names (flattened optimizer keys), so any layout can read what any other wrote, and the
trainer's state, all of it tensors. DCP would pickle any other value (the optimizer's lr, betas,
switches), and unpickling is what a crafted checkpoint uses to run its code: the param groups'
numbers are stored as float64 tensors and their switches taken from the live optimizer.

`read_problem` checks a checkpoint before a byte of its tensors is read (untrusted.SafeReader:
DCP's metadata classes only, no pickled item, no file outside the manifest; then its shapes
against the state to fill), and `read_state` loads it with a planner that never unpickles.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, _get_fqns, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

from gridtrain.errors import BadInput
from gridtrain.checkpoint.untrusted import (SafeLoadPlanner, SafeReader, UntrustedCheckpointError, check_metadata,
                                       fit_problems, flat_shapes)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
Group = dist.ProcessGroup | None


class InvalidCheckpointError(BadInput):
    """A checkpoint that does not verify against its manifest, holds what gridtrain never writes,
    or does not fit the state it is to fill: bad input (exit status 2); nothing was loaded."""


def state_of(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
             trainer_state: dict[str, torch.Tensor]) -> dict[str, object]:
    """One state dict for all of this rank's model parts: keys are global parameter names (and
    flattened optimizer keys), so any layout can write and any other can read it. Every value is
    a tensor (`settings_as_tensors`): a checkpoint holds nothing DCP would pickle."""
    model_sd: dict[str, object] = {}
    optim_sd: dict[str, object] = {}
    for part, opt in zip(parts, optimizers):
        model_sd.update(get_model_state_dict(part))
        optim_sd.update(settings_as_tensors(optimizer_state(part, opt)))
    return {"model": model_sd, "optim": optim_sd, "trainer": trainer_state}


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """The optimizer's flattened state dict (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`):
    DCP's for a plain or FSDP optimizer, `zero1_state` for ZeRO-1's."""
    if isinstance(opt, ZeroRedundancyOptimizer):
        return zero1_state(model, opt)
    return get_optimizer_state_dict(model, opt, options=FLAT)


def _fqns(model: nn.Module) -> dict[torch.nn.Parameter, str]:
    """Each parameter's name as DCP's state dicts spell it (wrappers' prefixes left out)."""
    return {p: next(iter(_get_fqns(model, name))) for name, p in model.named_parameters()}


def zero1_state(model: nn.Module, zero: ZeroRedundancyOptimizer) -> dict[str, object]:
    """ZeRO-1's optimizer state, flattened as DCP flattens any optimizer's: this rank's partition
    (the moments and step of the parameters it updates), the param groups' settings for every
    parameter. Its own state_dict would first consolidate every rank's state on one rank (a
    gather of the whole optimizer state, and a refusal on the others); as a DCP state dict each
    rank writes what it holds, and any layout reads the whole tensors back. Parameters not yet
    stepped get their state made first (step 0, zero moments), so a load has tensors to fill."""
    names = _fqns(model)
    out: dict[str, object] = {}
    for group in zero.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for param in group["params"]:
            out.update({f"param_groups.{names[param]}.{k}": v for k, v in settings.items()})
    for group in zero.optim.param_groups:
        for param in group["params"]:
            state = zero.optim.state[param]
            if not state:  # as torch's AdamW makes it on its first step
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                             exp_avg_sq=torch.zeros_like(param))
            out.update({f"state.{names[param]}.{k}": v for k, v in state.items()})
    return out


def set_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, loaded: dict[str, object]) -> None:
    """Put a loaded flattened optimizer state (the optimizer's own keys, settings as tensors)
    into `opt`: through DCP for a plain or FSDP optimizer; for ZeRO-1 the moments were loaded in
    place into its partition (zero1_state hands DCP its own tensors), so only the settings."""
    live = optimizer_state(model, opt)
    settings = settings_from_tensors(loaded, live)
    if not isinstance(opt, ZeroRedundancyOptimizer):
        set_optimizer_state_dict(model, opt, settings, options=StateDictOptions(flatten_optimizer_state_dict=True,
                                                                                strict=False))
        return
    names = _fqns(model)
    for group in opt.param_groups:
        first = names[group["params"][0]]
        group.update({k: settings[f"param_groups.{first}.{k}"] for k in group if k != "params"})


def _settings(optim_sd: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in optim_sd.items() if k.startswith("param_groups.")}


def settings_as_tensors(optim_sd: dict[str, object]) -> dict[str, object]:
    """A flattened optimizer state dict with its param groups' numbers (lr, betas, eps,
    weight_decay) as float64 tensors and its switches (foreach, fused, maximize, ...) left out:
    DCP saves any value that is not a tensor as a pickle, which a reader would have to unpickle.
    The switches are the code's, not the run's: a load takes them from the live optimizer."""
    out = {k: v for k, v in optim_sd.items() if not k.startswith("param_groups.")}
    for key, value in _settings(optim_sd).items():
        numbers = value if isinstance(value, (tuple, list)) else (value,)
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers):
            out[key] = torch.tensor(value, dtype=torch.float64)
    return out


def settings_from_tensors(loaded: dict[str, object], live: dict[str, object]) -> dict[str, object]:
    """The inverse of `settings_as_tensors` against the live optimizer's flattened state dict:
    each stored number back in the live value's type, every other setting the live one's."""
    out = dict(loaded)
    for key, value in _settings(live).items():
        stored = loaded.get(key)
        if not isinstance(stored, torch.Tensor):
            out[key] = value
        elif isinstance(value, (tuple, list)):
            out[key] = type(value)(type(x)(y) for x, y in zip(value, stored.tolist()))
        else:
            out[key] = type(value)(stored.item())
    return out


def _cause(err: BaseException) -> str:
    """The first line of what went wrong inside DCP (a CheckpointException wraps each rank's)."""
    if isinstance(err, CheckpointException) and err.failures:
        inner = next(iter(err.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback) in torch 2.13
        err = getattr(inner, "exc", inner)
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__


def read_problem(path: Path, state: dict[str, object] | None = None) -> tuple[str | None, SafeReader | None]:
    """(None, a checked reader) when checkpoint `path` can be read into `state` (its keys and
    shapes; None: any state), else (why not, None). Reads `.metadata` through the safe reader and
    compares shapes before anything is allocated; never raises for a bad checkpoint."""
    try:
        reader = check_metadata(path)
    except UntrustedCheckpointError as err:
        return str(err), None
    except OSError as err:
        return f"its .metadata cannot be read ({err.strerror or err})", None
    if state is not None and (problems := fit_problems(reader.read_metadata(), flat_shapes(state))):
        return f"it does not hold this model's state ({'; '.join(problems)})", None
    return None, reader


def read_state(reader: SafeReader, state: dict[str, object], group: Group = None) -> None:
    """dcp.load of `state` from a checked reader (collective over `group`), never unpickling; a
    read that fails anyway (a shard cut short, torch.load refusing a tensor) is one
    InvalidCheckpointError naming the cause."""
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise InvalidCheckpointError(f"cannot read checkpoint {reader.checkpoint}: {_cause(err)}") from err
