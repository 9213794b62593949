"""`gridtrain import`: a transformers Llama or Mixtral directory (config.json and safetensors, one
file or several with model.safetensors.index.json) becomes a gridtrain run: a step-0 checkpoint
(the weights, a fresh AdamW's state, a fresh trainer state, a zero expert bias) and
run_dir/imported.toml.

The model is never whole in memory. Only the safetensors headers are read up front (names, shapes,
dtypes: every weight of config.json's model must be there and nothing else). The checkpoint's state
dict is then built on the meta device, and DCP's writer asks for its tensors one at a time
(SavePlanner.resolve_data): a weight is read from its file then (a Mixtral expert stack: from its
experts' weights, or its half of transformers 5's fused gate_up_proj), turned into gridtrain's
layout and fp32, written and dropped; an Adam moment or the expert bias is zeros of its shape. Each
tensor goes to a file of its own, because DCP's writer keeps every tensor of a file until it closes
it. What the process holds beyond the interpreter is about two copies of the largest weight
(bench/bench_export.py; an expert stack: the stack and its experts' weights).
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

from gridtrain.config import CheckpointConfig, ModelConfig, MoEConfig, TrainConfig
from gridtrain.config_load import load_config
from gridtrain.inputs import MISSING, file_problem, read_json
from gridtrain.model.args import PRESETS, ModelArgs
from gridtrain.model.hf import (TIED_HEAD_DIFFERS, InterchangeError, check_hf_shape, export_problems, from_hf_tensor,
                                hf_config, hf_layer_of, hf_shape, hf_shapes, hf_sources, ignored_hf_name, json_type,
                                model_shapes)
from gridtrain.model.hf_moe import Source, layout_of
from gridtrain.model.llama import Transformer
from gridtrain.checkpoint import store as checkpoint
from gridtrain.train.hf_run import atomic_dir, require_free
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


def weight_sources(stored: dict[str, Stored], args: ModelArgs, hf_dir: Path) -> dict[str, Source]:
    """gridtrain weight name -> the Hugging Face weights it is read from, once every weight of the
    model is found with its shape and a float dtype (a tied head: the embedding, which lm_head, if
    stored, must equal; Mixtral's experts in whichever layout the names show). Only headers are
    compared until then: the tied head's check reads last. The expert bias is read from nowhere."""
    shapes = model_shapes(args)
    sources = hf_sources(shapes, args, layout_of(stored))
    wanted = hf_shapes(shapes, sources)
    embedding = "model.embed_tokens.weight"
    head = "lm_head.weight" if args.tie_embeddings and "lm_head.weight" in stored else None
    if head is not None:
        wanted[head] = wanted[embedding]  # checked as the embedding is
    problems = [f"{name} is missing" for name in wanted if name not in stored]
    problems += [f"{name} is not in the model" for name in stored if name not in wanted and not ignored_hf_name(name)]
    for name, shape in wanted.items():
        where = stored.get(name)
        if where and where.shape != shape:
            problems.append(f"{name} has shape {list(where.shape)}, the model {list(shape)}")
        if where and where.dtype not in FLOAT_DTYPES:
            problems.append(f"{name} is stored as {where.dtype}, not a float type")
    if problems:
        raise InterchangeError(f"the weights in {hf_dir} do not fit its config.json: {'; '.join(problems)}")
    if head is not None and not torch.equal(_read(stored[head], head), _read(stored[embedding], embedding)):
        raise InterchangeError(TIED_HEAD_DIFFERS)
    if args.tie_embeddings:
        sources["output.weight"] = sources["tok_embeddings.weight"]
    return {name: source for name, source in sources.items() if source.names}


class StreamingPlanner(DefaultSavePlanner):
    """DCP's planner over a state dict of meta tensors: `model.*` weights are read when DCP writes
    them, any other meta tensor (Adam's moments, the expert bias) is zeros."""

    def __init__(self, stored: dict[str, Stored], sources: dict[str, Source], args: ModelArgs) -> None:
        super().__init__()
        self.stored, self.sources, self.args = stored, sources, args

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | Any:
        meta = self.lookup_object(write_item.index)
        if not (isinstance(meta, torch.Tensor) and meta.is_meta):
            return super().resolve_data(write_item)
        name = write_item.index.fqn.removeprefix("model.")
        if name not in self.sources:
            return torch.zeros(meta.shape, dtype=meta.dtype)
        tensor = self.sources[name].gather(lambda hf_name: _read(self.stored[hf_name], hf_name), meta.dtype)
        return from_hf_tensor(name, tensor, self.args).contiguous()


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


def pick_preset(args: ModelArgs) -> str:
    """The preset the imported model's keys override: one of the same shape if there is one, else
    the first of its kind (dense, or mixture of experts: model.moe.* keys need one) with its norm
    epsilon, which no key sets."""
    kind = [name for name, make in PRESETS.items() if (make().moe is None) == (args.moe is None)]
    same_eps = [name for name in kind if PRESETS[name]().norm_eps == args.norm_eps]
    if not same_eps:
        used = sorted({PRESETS[name]().norm_eps for name in kind})
        raise InterchangeError(f"rms_norm_eps {args.norm_eps} cannot be set in a gridtrain config (no model.norm_eps "
                               f"key; the {'mixture-of-experts' if args.moe else 'dense'} presets use {used})")
    exact = [name for name in same_eps
             if not export_problems(PRESETS[name]()) and hf_config(PRESETS[name]()) == hf_config(args)]
    return (exact or same_eps)[0]


def model_keys(args: ModelArgs, preset: str) -> dict[str, object]:
    """The model.* keys that make `preset` the imported shape. head_dim is written where either has
    one of its own; the dense width where a layer uses it (every layer of a Mixtral is experts)."""
    keys: dict[str, object] = {"preset": preset}
    for f in dataclasses.fields(ModelConfig):
        if f.name in ("preset", "moe"):
            continue
        if f.name == "head_dim":
            if args.explicit_head_dim is not None or PRESETS[preset]().explicit_head_dim is not None:
                keys["head_dim"] = args.head_dim
        elif f.name == "ffn_dim":
            if args.moe is None or args.moe.moe_layers(args.n_layers) < args.n_layers:
                keys["ffn_dim"] = args.hidden_dim
        else:
            keys[f.name] = getattr(args, f.name)
    return keys


def imported_toml(args: ModelArgs, run_dir: Path, train: TrainConfig) -> str:
    """The TOML config that continues training the imported weights in `run_dir`."""
    model = model_keys(args, pick_preset(args))
    optim = {k: getattr(train, k) for k in ("weight_decay", "beta1", "beta2", "eps")}
    lines = ["# Written by `gridtrain import`: continue with",
             f"#   gridtrain train --config {run_dir / 'imported.toml'} --data.corpus ...",
             f"run_dir = {_toml_value(run_dir)}", "", "[model]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in model.items()]
    if args.moe is not None:
        lines += ["", "[model.moe]"]
        lines += [f"{f.name} = {_toml_value(getattr(args.moe, f.name))}" for f in dataclasses.fields(MoEConfig)]
    lines += ["", "# AdamW's hyperparameters stored in the step-0 checkpoint (a resume restores them).",
              "[train]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in optim.items()]
    lines += ["", "[checkpoint]", "resume = true", ""]
    return "\n".join(lines)


def import_hf(hf_dir: Path, run_dir: Path, train: TrainConfig | None = None) -> Path:
    """Turn a transformers Llama or Mixtral directory into a gridtrain run (see the module docstring).
    Returns `run_dir`; a failure leaves nothing there."""
    train = train or TrainConfig()
    hf_dir, run_dir = Path(hf_dir), Path(run_dir).resolve()
    require_free(run_dir)
    config, stored = read_hf_dir(hf_dir)
    args = hf_shape(config)  # its JSON types
    check_headers_fit(stored, args, hf_dir)  # before anything is built from the config
    check_hf_shape(args)  # what `gridtrain train` checks
    toml = imported_toml(args, run_dir, train)
    sources = weight_sources(stored, args, hf_dir)
    with torch.device("meta"):
        model = Transformer(args)  # names and shapes of the state dict; nothing allocated
    state = checkpoint.state_of([model], [fresh_optimizer(model, train)], fresh_trainer_state(train))
    with atomic_dir(run_dir) as tmp:
        (tmp / "imported.toml").write_text(toml)
        again = load_config(tmp / "imported.toml").model.args()
        if hf_config(again) != hf_config(args) or again.moe != args.moe or again.qk_norm:
            raise InterchangeError("internal: imported.toml does not reproduce the model's shape")
        checkpoint.save_state(tmp / "checkpoints", 0, state, keep=CheckpointConfig().keep,
                              planner=StreamingPlanner(stored, sources, args), own_file_from=OWN_FILE_FROM)
    return run_dir
