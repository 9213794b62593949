"""Hugging Face interchange of runs: `gridtrain export` writes a run's checkpoint as a transformers
`LlamaForCausalLM` directory, or `MixtralForCausalLM` for a mixture of experts (gridtrain.model.hf
maps the names, the RoPE rows and the config; gridtrain.train.hf_import is `gridtrain import`).

Files are safetensors and DCP checkpoints only: nothing here unpickles but DCP's .metadata,
through untrusted.SafeReader (DCP's metadata classes and nothing else), and a checkpoint's shapes
are compared with the run's config.json before anything is built from either.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import Metadata

from gridtrain.config import Config
from gridtrain.model.args import ModelArgs
from gridtrain.model.hf import (InterchangeError, export_problems, export_refusal, hf_config, hf_source, model_shapes,
                                to_hf_state_dict)
from gridtrain.rundir import RunRecord
from gridtrain.checkpoint import store as checkpoint
from gridtrain.checkpoint.state import read_problem, read_state
from gridtrain.checkpoint.manifest import verify
from gridtrain.checkpoint.untrusted import SafeReader, fit_problems


# ---------------------------------------------------------------------------------------------
# Export


def require_free(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InterchangeError(f"{path} exists and is not an empty directory: choose another or remove it")


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a sibling temp directory that becomes `final` when the block succeeds; a failure
    removes it, so `final` is never half written."""
    require_free(final)
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


def read_run(run_dir: Path) -> tuple[Config, Path]:
    """(configuration, checkpoint directory) from the run's record."""
    cfg = RunRecord.load(run_dir, with_layout=False).config
    return cfg, cfg.checkpoint_dir if cfg.checkpoint.dir else run_dir / "checkpoints"


def find_checkpoint(root: Path, step: int | None = None) -> Path:
    """The newest complete checkpoint under `root`, or that of `step`, verified against its
    manifest (every byte).

    The one place that asks gridtrain.checkpoint.store which checkpoints exist."""
    if step is None:
        path, skipped = checkpoint.latest_valid_checkpoint(root)
        if path is None:
            why = f" ({len(skipped)} found, none intact: {skipped[0][1]})" if skipped else ""
            raise InterchangeError(f"no intact checkpoint in {root}{why}: a run saves one at its end (and "
                                   "along the way with checkpoint.interval); was this one stopped before?")
        return path
    found = dict(checkpoint.list_checkpoints(root))
    if step not in found:
        raise InterchangeError(f"no checkpoint of step {step} in {root}; steps there: {sorted(found) or 'none'}")
    path = found[step]
    problem = verify(path)
    if problem:
        intact = next((s for s, p in reversed(checkpoint.list_checkpoints(root)) if s != step and not verify(p)),
                      None)
        offer = f"; the newest intact one is step {intact} (--step {intact})" if intact is not None else \
            "; no other checkpoint there is intact"
        raise InterchangeError(f"checkpoint {path} is not intact: {problem}{offer}")
    return path


_LAYER_KEY = re.compile(r"^model\.layers\.(\d{1,9})\.")


def shape_problem(metadata: Metadata, args: ModelArgs) -> str | None:
    """Why the model of `args` does not fit a checkpoint's metadata, judged from the layer count
    and the embedding alone (nothing is built from `args` first: a config of a million layers
    is refused at once), or None."""
    layers = {int(m.group(1)) for key in metadata.state_dict_metadata if (m := _LAYER_KEY.match(key))}
    embedding = metadata.state_dict_metadata.get("model.tok_embeddings.weight")
    if len(layers) != args.n_layers:
        return f"it holds {len(layers)} layers, the run's config.json says model.n_layers = {args.n_layers:,}"
    if embedding is None or tuple(embedding.size) != (args.vocab_size, args.dim):
        held = list(embedding.size) if embedding is not None else "no embedding"
        return (f"its embedding is {held}, the run's config.json says vocab_size x dim = "
                f"[{args.vocab_size:,}, {args.dim:,}]")
    return None


def open_checkpoint(root: Path, args: ModelArgs, step: int | None = None) -> tuple[Path, SafeReader]:
    """The run's checkpoint (newest intact, or `step`'s) with a reader whose metadata is checked
    (untrusted.SafeReader) and fits the model of `args`, before anything is allocated; a
    checkpoint that fails is one InterchangeError."""
    path = find_checkpoint(root, step)
    reason, reader = read_problem(path)
    if reader is not None:
        reason = shape_problem(reader.read_metadata(), args)
    if reason is None:
        wanted = {f"model.{k}": tuple(meta.shape) for k, meta in model_shapes(args).items()}
        problems = fit_problems(reader.read_metadata(), wanted)
        reason = f"it does not hold the run's model ({'; '.join(problems)})" if problems else None
    if reason is not None:
        raise InterchangeError(f"refusing checkpoint {path}: {reason}")
    return path, reader


MAX_SHARD_BYTES = 5 * 10**9
"""What transformers' save_pretrained writes per safetensors file by default (5 GB)."""


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


def load_model_weights(reader: SafeReader, args: ModelArgs, shapes: dict[str, torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a checked checkpoint (`open_checkpoint`), or only
    those of `shapes` (a part of model_shapes), read in this one process: DCP reads just the keys
    asked for, and nothing is unpickled."""
    wanted = {k: torch.empty_like(meta, device="cpu") for k, meta in (shapes or model_shapes(args)).items()}
    read_state(reader, {"model": wanted})
    return wanted


def check_expert_bias(reader: SafeReader, args: ModelArgs, path: Path) -> None:
    """Refuse a checkpoint whose expert bias (model.moe.balance 'bias', DeepSeek-V3's balance) is
    nonzero: it takes part in choosing the experts, and Mixtral's router chooses by the softmax alone."""
    if args.moe is None or args.moe.balance != "bias":
        return
    shapes = {k: meta for k, meta in model_shapes(args).items() if k.endswith(".moe.expert_bias")}
    moved = [k for k, bias in load_model_weights(reader, args, shapes).items() if bias.any()]
    if moved:
        raise InterchangeError(f"checkpoint {path} has a nonzero expert bias in {len(moved)} of {len(shapes)} MoE "
                               "layers (model.moe.balance = 'bias', DeepSeek-V3's): it takes part in choosing the "
                               "experts, which transformers' Mixtral router (the top k of the softmax alone) cannot "
                               "hold; runs trained with balance 'aux_loss' or 'none' export")


def export_run(run_dir: Path, out: Path, step: int | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write a run's checkpoint (the newest, or `step`'s) as a transformers Llama directory, or a
    Mixtral one for a mixture of experts: config.json and model.safetensors, or
    model-0000i-of-0000N.safetensors files of at most `max_shard_bytes` with transformers' index
    file. One file's weights are in memory at a time. A shape transformers cannot hold is refused
    before anything is written. Returns `out`."""
    require_free(Path(out))
    cfg, root = read_run(Path(run_dir))
    args = cfg.model.args()
    if export_problems(args):
        raise export_refusal(args, f"{run_dir} (model.preset '{cfg.model.preset}')")
    path, reader = open_checkpoint(root, args, step)
    check_expert_bias(reader, args, path)
    shapes = {k: meta for k, meta in model_shapes(args).items() if hf_source(k, args).names}  # no expert bias
    shards = plan_shards(shapes, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total, dtype = {}, 0, "float32"
    with atomic_dir(Path(out)) as tmp:
        for file, names in zip(files, shards):
            weights = to_hf_state_dict(load_model_weights(reader, args, {k: shapes[k] for k in names}), args)
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
