"""Hugging Face interchange of runs: `gridtrain export` writes a run's checkpoint as a transformers
`LlamaForCausalLM` directory, `gridtrain import` makes a run from one (gridtrain.model.hf maps the
names, the RoPE rows and the config).

Files are safetensors and DCP checkpoints only: nothing here unpickles but DCP's .metadata,
through untrusted.SafeReader (DCP's metadata classes and nothing else).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from gridtrain.config import CheckpointConfig, ModelConfig, TrainConfig
from gridtrain.config_load import load_config
from gridtrain.model.args import PRESETS, ModelArgs
from gridtrain.model.hf import (InterchangeError, args_from_hf_config, from_hf_state_dict, hf_config,
                                to_hf_state_dict)
from gridtrain.model.llama import Transformer
from gridtrain.rundir import RunRecord
from gridtrain.train import checkpoint
from gridtrain.train.build import build_model
from gridtrain.train.manifest import verify
from gridtrain.train.optim import build_optimizer, set_lr
from gridtrain.train.precision import Precision
from gridtrain.train.untrusted import SafeReader, UntrustedCheckpointError, check_metadata


# ---------------------------------------------------------------------------------------------
# Export


def _require_free(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InterchangeError(f"{path} exists and is not an empty directory: choose another or remove it")


@contextlib.contextmanager
def _atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a sibling temp directory that becomes `final` when the block succeeds; a failure
    removes it, so `final` is never half written."""
    _require_free(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        final.rmdir()
    os.replace(tmp, final)


def read_run(run_dir: Path) -> tuple[ModelArgs, Path]:
    """(model shape, checkpoint directory) from the run's record."""
    cfg = RunRecord.load(run_dir, with_layout=False).config
    return cfg.model.args(), cfg.checkpoint_dir if cfg.checkpoint.dir else run_dir / "checkpoints"


def find_checkpoint(root: Path, step: int | None = None) -> Path:
    """The newest complete checkpoint under `root`, or that of `step`.

    The one place that asks gridtrain.train.checkpoint which checkpoints exist."""
    if step is None:
        path = checkpoint.latest_checkpoint(root)
        if path is None:
            raise InterchangeError(f"no intact checkpoint in {root}: train with --checkpoint.interval N")
    else:
        found = dict(checkpoint.list_checkpoints(root))
        if step not in found:
            raise InterchangeError(f"no checkpoint of step {step} in {root}; steps there: {sorted(found)}")
        path = found[step]
        problem = verify(path)
        if problem:
            raise InterchangeError(f"checkpoint {path} is not intact: {problem}")
    try:
        check_metadata(path)
    except UntrustedCheckpointError as err:
        raise InterchangeError(f"refusing checkpoint {path}: {err}") from None
    return path


MAX_SHARD_BYTES = 5 * 10**9
"""What transformers' save_pretrained writes per safetensors file by default (5 GB)."""


def model_shapes(args: ModelArgs) -> dict[str, torch.Tensor]:
    """The model's weights as meta tensors (names, shapes, dtypes; nothing allocated), a tied head
    left out: the checkpoint holds it under both names, and it is the embedding."""
    with torch.device("meta"):
        model = Transformer(args)
    return {k: v for k, v in model.state_dict().items() if not (args.tie_embeddings and k == "output.weight")}


def plan_shards(shapes: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Consecutive weights grouped into files of at most `max_bytes` (a larger weight alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, meta in shapes.items():
        nbytes = meta.numel() * meta.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def load_model_weights(path: Path, args: ModelArgs, shapes: dict[str, torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a DCP checkpoint, or only those of `shapes` (a part of
    model_shapes), read in this one process: DCP reads just the keys asked for, and .metadata
    through the safe unpickler."""
    wanted = {k: torch.empty_like(meta, device="cpu") for k, meta in (shapes or model_shapes(args)).items()}
    dcp.load({"model": wanted}, storage_reader=SafeReader(path))
    return wanted


def export_run(run_dir: Path, out: Path, step: int | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write a run's checkpoint (the newest, or `step`'s) as a transformers Llama directory:
    config.json and model.safetensors, or model-0000i-of-0000N.safetensors files of at most
    `max_shard_bytes` with transformers' index file. One file's weights are in memory at a time.
    Returns `out`."""
    _require_free(Path(out))
    args, root = read_run(Path(run_dir))
    path = find_checkpoint(root, step)
    shapes = model_shapes(args)
    shards = plan_shards(shapes, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total, dtype = {}, 0, "float32"
    with _atomic_dir(Path(out)) as tmp:
        for file, names in zip(files, shards):
            weights = to_hf_state_dict(load_model_weights(path, args, {k: shapes[k] for k in names}), args)
            tensors = {k: v.contiguous() for k, v in weights.items()}
            save_file(tensors, tmp / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            if "model.embed_tokens.weight" in tensors:
                dtype = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
            del weights, tensors
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")
    return Path(out)


# ---------------------------------------------------------------------------------------------
# Import


def read_hf_dir(hf_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and the weights of all safetensors files (sharded or not) of a HF model dir."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise InterchangeError(f"{hf_dir} has no config.json: give a Hugging Face model directory "
                               "(as written by save_pretrained or `gridtrain export`)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise InterchangeError(f"{config_path} is not readable JSON ({err})") from None
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
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            weights.update(load_file(hf_dir / name))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise InterchangeError(f"{hf_dir / name} is not a readable safetensors file ({err}); it may be "
                                   "cut short: copy it again") from None
    return config, weights


def fresh_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """gridtrain's AdamW with its state materialised as before any step (step 0, zero moments).

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
    """Turn a transformers Llama directory into a gridtrain run: a step-0 checkpoint (weights,
    fresh AdamW state, fresh trainer state) and run_dir/imported.toml. Returns `run_dir`."""
    train = train or TrainConfig()
    hf_dir, run_dir = Path(hf_dir), Path(run_dir).resolve()
    _require_free(run_dir)
    config, weights = read_hf_dir(hf_dir)
    args = args_from_hf_config(config)
    toml = imported_toml(args, run_dir, train)
    model = build_model(args, 0, torch.device("cpu"))  # initialised, then overwritten; ties the head
    try:
        model.load_state_dict(from_hf_state_dict(weights, args), strict=True)
    except RuntimeError as err:  # missing weights, or shapes that do not fit config.json
        raise InterchangeError(f"the weights in {hf_dir} do not fit its config.json: {err}") from None
    optimizer = fresh_optimizer(model, train)
    with _atomic_dir(run_dir) as tmp:
        (tmp / "imported.toml").write_text(toml)
        if hf_config(load_config(tmp / "imported.toml").model.args()) != hf_config(args):
            raise InterchangeError("internal: imported.toml does not reproduce the model's shape")
        checkpoint.save(tmp / "checkpoints", 0, [model], [optimizer], fresh_trainer_state(train),
                        keep=CheckpointConfig().keep)
    return run_dir

