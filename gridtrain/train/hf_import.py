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
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from gridtrain.config import CheckpointConfig, ModelConfig, TrainConfig
from gridtrain.config_load import load_config
from gridtrain.inputs import MISSING, file_problem, read_json
from gridtrain.model.args import PRESETS, ModelArgs
from gridtrain.model.hf import (TIED_HEAD_DIFFERS, InterchangeError, check_hf_shape, from_hf_name, from_hf_tensor,
                                hf_config, hf_layer_of, hf_shape, json_type, to_hf_name)
from gridtrain.model.llama import Transformer
from gridtrain.train import checkpoint
from gridtrain.train.hf_run import atomic_dir, require_free, model_shapes
from gridtrain.train.optim import build_optimizer, set_lr
from gridtrain.train.precision import Precision

OWN_FILE_FROM = 1 << 20
"""Tensors of at least this many bytes (1 MiB) are written to checkpoint files of their own."""
JSON_BYTES = 64 * 2**20
"""The largest config.json or safetensors index read (64 MiB; Llama 3 405B's index is 0.1 MiB)."""
INDEX_FILE = "model.safetensors.index.json"
# safetensors' names of the floating-point dtypes a weight may be stored in (converted to fp32).
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one weight of a Hugging Face directory is, and what its header says."""
    file: Path
    shape: tuple[int, ...]
    dtype: str


def _read_json(path: Path) -> Any:
    """config.json or the safetensors index, checked before it is read (a regular file of at most
    JSON_BYTES) and parsed."""
    return read_json(path, str(path), JSON_BYTES, error=InterchangeError)


def _read_config(hf_dir: Path) -> dict[str, Any]:
    config_path = hf_dir / "config.json"
    if not os.path.lexists(config_path):
        raise InterchangeError(f"{hf_dir} has no config.json: give a Hugging Face model directory "
                               "(as written by save_pretrained or `gridtrain export`)")
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise InterchangeError(f"{config_path} is {json_type(config)}, not an object of settings: give a "
                               "transformers config.json (as written by save_pretrained)")
    return config


def _index_files(index: Path) -> list[str]:
    """The shard files a safetensors index names: plain names of files beside it."""
    weight_map = _read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InterchangeError(f"{index} is not a safetensors index: it needs a weight_map object from "
                               "weight names to file names")
    files = sorted(set(weight_map.values()))
    outside = [name for name in files if name in ("", ".", "..") or "/" in name or "\\" in name]
    if outside:
        raise InterchangeError(f"{index} names shard files outside {index.parent} ({outside[:3]}): a shard "
                               "is a plain file name beside the index")
    return files


def _weight_files(hf_dir: Path) -> list[str]:
    index = hf_dir / INDEX_FILE
    indexed = os.path.lexists(index)
    files = _index_files(index) if indexed else sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        raise InterchangeError(f"no *.safetensors in {hf_dir}: gridtrain reads safetensors only "
                               "(a pytorch_model.bin would need unpickling); save it with "
                               "save_pretrained(..., safe_serialization=True)")
    problems = {name: file_problem(hf_dir / name) for name in files}
    missing = [name for name, why in problems.items() if why == MISSING]
    if missing and indexed:
        raise InterchangeError(f"{index.name} names shards missing from {hf_dir}: {missing}")
    for name, why in problems.items():
        if why is not None:
            raise InterchangeError(f"{hf_dir / name} {why}: gridtrain reads weights from safetensors files")
    return files


def _unreadable(path: Path, err: Exception) -> InterchangeError:
    return InterchangeError(f"{path} is not a readable safetensors file ({err}); it may be cut short: copy it again")


def read_headers(hf_dir: Path) -> dict[str, Stored]:
    """Where each weight is, from its file's header (names, shapes, dtypes: no tensor is read)."""
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
    return stored


def read_hf_dir(hf_dir: Path) -> tuple[dict[str, Any], dict[str, Stored]]:
    """config.json, and where each weight is (its file's header: nothing else is read)."""
    return _read_config(hf_dir), read_headers(hf_dir)


def check_headers_fit(stored: dict[str, Stored], args: ModelArgs, hf_dir: Path) -> None:
    """The layer count and the embedding's shape in the headers against config.json's, before
    anything is built from the config (a config of a million layers beside two would otherwise
    build a million-layer model to find out)."""
    layers = {n for name in stored if (n := hf_layer_of(name)) is not None}
    unfit = f"the weights in {hf_dir} do not fit its config.json"
    if len(layers) != args.n_layers:
        raise InterchangeError(f"{unfit}: num_hidden_layers is {args.n_layers:,}, the safetensors headers hold "
                               f"{len(layers):,} layers (model.layers.N.*)")
    embedding = stored.get("model.embed_tokens.weight")
    if embedding is not None and embedding.shape != (args.vocab_size, args.dim):
        raise InterchangeError(f"{unfit}: model.embed_tokens.weight has shape {list(embedding.shape)}, "
                               f"(vocab_size, hidden_size) is [{args.vocab_size}, {args.dim}]")


def _read(stored: Stored, hf_name: str) -> torch.Tensor:
    try:
        with safe_open(stored.file, framework="pt") as f:
            return f.get_tensor(hf_name)
    except Exception as err:  # noqa: BLE001
        raise _unreadable(stored.file, err) from None


def weight_sources(stored: dict[str, Stored], args: ModelArgs, hf_dir: Path) -> dict[str, str]:
    """gridtrain weight name -> the Hugging Face weight it is read from, once every weight of the
    model is found with its shape and a float dtype (a tied head: the embedding, which lm_head, if
    stored, must equal). Only headers are compared until then: the tied head's check reads last."""
    found = {ours: hf_name for hf_name in stored if (ours := from_hf_name(hf_name)) is not None}
    shapes = model_shapes(args)
    head = found.pop("output.weight") if args.tie_embeddings and "output.weight" in found else None
    if head is not None:
        shapes = {**shapes, "lm_head": shapes["tok_embeddings.weight"]}  # checked as the embedding is
        found["lm_head"] = head
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
    found.pop("lm_head", None)
    embedding = found["tok_embeddings.weight"]
    if head is not None and not torch.equal(_read(stored[head], head), _read(stored[embedding], embedding)):
        raise InterchangeError(TIED_HEAD_DIFFERS)
    if args.tie_embeddings:
        found["output.weight"] = embedding
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
    args = hf_shape(config)  # its JSON types
    check_headers_fit(stored, args, hf_dir)  # before anything is built from the config
    check_hf_shape(args, config)  # what `gridtrain train` checks
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
