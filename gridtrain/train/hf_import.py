"""`gridtrain import`: a transformers Llama directory (config.json and safetensors, one file or
several with model.safetensors.index.json) becomes a gridtrain run: a step-0 checkpoint (the
weights, a fresh AdamW's state, a fresh trainer state) and run_dir/imported.toml.

The model is never whole in memory. Only the safetensors headers are read up front (names, shapes,
dtypes: every weight of config.json's model must be there and nothing else). The checkpoint's state
dict is then built on the meta device, and DCP's writer asks for its tensors one at a time
(SavePlanner.resolve_data): a weight is read from its file then, turned into gridtrain's layout
and fp32, written and dropped; an Adam moment is zeros of its shape. Each tensor goes to a file of
its own, because DCP's writer keeps every tensor of a file until it closes it. What the process
holds beyond the interpreter is about two copies of the largest weight (bench/bench_export.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from gridtrain.config import CheckpointConfig, ModelConfig, TrainConfig
from gridtrain.config_load import load_config
from gridtrain.model.args import PRESETS, ModelArgs
from gridtrain.model.hf import (TIED_HEAD_DIFFERS, InterchangeError, args_from_hf_config, from_hf_name,
                                from_hf_tensor, hf_config, to_hf_name)
from gridtrain.model.llama import Transformer
from gridtrain.train import checkpoint
from gridtrain.train.hf_run import atomic_dir, require_free, model_shapes
from gridtrain.train.optim import build_optimizer, set_lr
from gridtrain.train.precision import Precision

OWN_FILE_FROM = 1 << 20
"""Tensors of at least this many bytes (1 MiB) are written to checkpoint files of their own."""
# safetensors' names of the floating-point dtypes a weight may be stored in (converted to fp32).
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one weight of a Hugging Face directory is, and what its header says."""
    file: Path
    shape: tuple[int, ...]
    dtype: str


def _read_config(hf_dir: Path) -> dict[str, Any]:
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise InterchangeError(f"{hf_dir} has no config.json: give a Hugging Face model directory "
                               "(as written by save_pretrained or `gridtrain export`)")
    try:
        return json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise InterchangeError(f"{config_path} is not readable JSON ({err})") from None


def _weight_files(hf_dir: Path) -> list[str]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise InterchangeError(f"{index} is not a safetensors index with a weight_map ({err!r})") from None
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        raise InterchangeError(f"no *.safetensors in {hf_dir}: gridtrain reads safetensors only "
                               "(a pytorch_model.bin would need unpickling); save it with "
                               "save_pretrained(..., safe_serialization=True)")
    missing = [name for name in files if not (hf_dir / name).is_file()]
    if missing:
        raise InterchangeError(f"{index.name} names shards missing from {hf_dir}: {missing}")
    return files


def _unreadable(path: Path, err: Exception) -> InterchangeError:
    return InterchangeError(f"{path} is not a readable safetensors file ({err}); it may be cut short: copy it again")


def read_hf_dir(hf_dir: Path) -> tuple[dict[str, Any], dict[str, Stored]]:
    """config.json, and where each weight is (its file's header: nothing else is read)."""
    config = _read_config(hf_dir)
    stored: dict[str, Stored] = {}
    for name in _weight_files(hf_dir):
        path = hf_dir / name
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    stored[key] = Stored(path, tuple(part.get_shape()), part.get_dtype())
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise _unreadable(path, err) from None
    return config, stored


def _read(stored: Stored, hf_name: str) -> torch.Tensor:
    try:
        with safe_open(stored.file, framework="pt") as f:
            return f.get_tensor(hf_name)
    except Exception as err:  # noqa: BLE001
        raise _unreadable(stored.file, err) from None


def weight_sources(stored: dict[str, Stored], args: ModelArgs, hf_dir: Path) -> dict[str, str]:
    """gridtrain weight name -> the Hugging Face weight it is read from, once every weight of the
    model is found with its shape and a float dtype (a tied head: the embedding, which lm_head, if
    stored, must equal)."""
    found = {ours: hf_name for hf_name in stored if (ours := from_hf_name(hf_name)) is not None}
    shapes = model_shapes(args)
    if args.tie_embeddings and "output.weight" in found:
        embedding, head = "model.embed_tokens.weight", found.pop("output.weight")
        if embedding in stored and not torch.equal(_read(stored[head], head), _read(stored[embedding], embedding)):
            raise InterchangeError(TIED_HEAD_DIFFERS)
    problems = [f"{to_hf_name(name)} is missing" for name in shapes if name not in found]
    problems += [f"{found[name]} is not in the model" for name in found if name not in shapes]
    for name, meta in shapes.items():
        where = stored.get(found.get(name, ""))
        if where and where.shape != tuple(meta.shape):
            problems.append(f"{found[name]} has shape {list(where.shape)}, the model {list(meta.shape)}")
        if where and where.dtype not in FLOAT_DTYPES:
            problems.append(f"{found[name]} is stored as {where.dtype}, not a float type")
    if problems:
        raise InterchangeError(f"the weights in {hf_dir} do not fit its config.json: {'; '.join(problems)}")
    if args.tie_embeddings:
        found["output.weight"] = found["tok_embeddings.weight"]
    return found


class StreamingPlanner(DefaultSavePlanner):
    """DCP's planner over a state dict of meta tensors: `model.*` weights are read when DCP writes
    them, any other meta tensor (Adam's moments) is zeros."""

    def __init__(self, stored: dict[str, Stored], sources: dict[str, str], args: ModelArgs) -> None:
        super().__init__()
        self.stored, self.sources, self.args = stored, sources, args

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | Any:
        meta = self.lookup_object(write_item.index)
        if not (isinstance(meta, torch.Tensor) and meta.is_meta):
            return super().resolve_data(write_item)
        name = write_item.index.fqn.removeprefix("model.")
        if name not in self.sources:
            return torch.zeros(meta.shape, dtype=meta.dtype)
        hf_name = self.sources[name]
        tensor = from_hf_tensor(name, _read(self.stored[hf_name], hf_name), self.args)
        return tensor.to(meta.dtype).contiguous()


def fresh_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """gridtrain's AdamW with its state materialised as before any step (step 0, zero moments; on
    a meta model, meta moments).

    DCP's state-dict helper would otherwise fill an empty state by a zero-lr step that records
    step 1, and a resumed run would apply Adam's bias correction of step 2 on its first step."""
    opt = build_optimizer(model, train)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    set_lr(opt, 0.0)
    opt.step()  # zero gradient, zero lr: the weights are untouched
    opt.zero_grad(set_to_none=True)
    set_lr(opt, train.lr)
    for state in opt.state.values():
        state["step"].zero_()
    return opt


def fresh_trainer_state(train: TrainConfig) -> dict[str, torch.Tensor]:
    """Trainer.trainer_state() of a run before its first step. The loss scale is the one fp16
    starts from (fp32 and bf16 runs ignore it)."""
    precision = Precision(dataclasses.replace(train, precision="fp16"), torch.device("cpu"))
    rng = torch.Generator().manual_seed(train.seed).get_state()
    return {"step": torch.tensor(0), "samples": torch.tensor(0), "rng": rng, **precision.state_dict()}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def imported_toml(args: ModelArgs, run_dir: Path, train: TrainConfig) -> str:
    """The TOML config that continues training the imported weights in `run_dir`."""
    same_eps = [name for name, fn in PRESETS.items() if fn().norm_eps == args.norm_eps]
    if not same_eps:
        raise InterchangeError(f"rms_norm_eps {args.norm_eps} cannot be set in a gridtrain config (no "
                               f"model.norm_eps key; the presets use {PRESETS['small']().norm_eps})")
    exact = [name for name in same_eps if hf_config(PRESETS[name]()) == hf_config(args)]
    model = {"preset": (exact or same_eps)[0]}
    for f in dataclasses.fields(ModelConfig):
        if f.name != "preset":
            model[f.name] = args.hidden_dim if f.name == "ffn_dim" else getattr(args, f.name)
    optim = {k: getattr(train, k) for k in ("weight_decay", "beta1", "beta2", "eps")}
    lines = ["# Written by `gridtrain import`: continue with",
             f"#   gridtrain train --config {run_dir / 'imported.toml'} --data.corpus ...",
             f"run_dir = {_toml_value(run_dir)}", "", "[model]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in model.items()]
    lines += ["", "# AdamW's hyperparameters stored in the step-0 checkpoint (a resume restores them).",
              "[train]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in optim.items()]
    lines += ["", "[checkpoint]", "resume = true", ""]
    return "\n".join(lines)


def import_hf(hf_dir: Path, run_dir: Path, train: TrainConfig | None = None) -> Path:
    """Turn a transformers Llama directory into a gridtrain run (see the module docstring).
    Returns `run_dir`; a failure leaves nothing there."""
    train = train or TrainConfig()
    hf_dir, run_dir = Path(hf_dir), Path(run_dir).resolve()
    require_free(run_dir)
    config, stored = read_hf_dir(hf_dir)
    args = args_from_hf_config(config)
    toml = imported_toml(args, run_dir, train)
    sources = weight_sources(stored, args, hf_dir)
    with torch.device("meta"):
        model = Transformer(args)  # names and shapes of the state dict; nothing allocated
    state = checkpoint.state_of([model], [fresh_optimizer(model, train)], fresh_trainer_state(train))
    with atomic_dir(run_dir) as tmp:
        (tmp / "imported.toml").write_text(toml)
        if hf_config(load_config(tmp / "imported.toml").model.args()) != hf_config(args):
            raise InterchangeError("internal: imported.toml does not reproduce the model's shape")
        checkpoint.save_state(tmp / "checkpoints", 0, state, keep=CheckpointConfig().keep,
                              planner=StreamingPlanner(stored, sources, args), own_file_from=OWN_FILE_FROM)
    return run_dir
