"""Hugging Face interchange: a gridtrain run as a transformers `LlamaForCausalLM` directory, and back.

Two conventions differ between the codebases:
- RoPE pairs. gridtrain rotates interleaved pairs (x[2i], x[2i+1]) of each head, as Meta's reference
  code does; transformers rotates halves (x[i], x[i + head_dim/2]) (`rotate_half`). The models agree
  once the rows of wq and wk are permuted within each head, which is what transformers'
  convert_llama_weights_to_hf.py `permute` does. wv and wo stay: q.k is unchanged when q and k
  have the same dimensions permuted.
- Names. `layers.N.attention.wq.weight` is `model.layers.N.self_attn.q_proj.weight`; w1, w3, w2 are
  gate_proj, up_proj, down_proj; the tied output head is not stored (transformers ties it on load).

Files are safetensors and DCP checkpoints only: nothing here unpickles but DCP's .metadata,
through untrusted.SafeReader (DCP's metadata classes and nothing else).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from gridtrain.config import CheckpointConfig, ModelConfig, TrainConfig, load_config
from gridtrain.errors import UserError
from gridtrain.model.args import PRESETS, ModelArgs
from gridtrain.model.llama import Transformer
from gridtrain.rundir import run_record
from gridtrain.train import checkpoint
from gridtrain.train.manifest import verify
from gridtrain.train.untrusted import SafeReader, UntrustedCheckpointError, check_metadata
from gridtrain.train.optim import build_optimizer, set_lr
from gridtrain.train.precision import Precision
from gridtrain.train.build import build_model

# The constants of gridtrain.model.llama._llama31_scale (Llama 3.1), in transformers' spelling.
LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GRIDTRAIN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class InterchangeError(UserError, ValueError):
    """A run or Hugging Face directory that cannot be converted; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------
# Configs


def hf_config(args: ModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """config.json of the transformers LlamaConfig describing this model exactly."""
    rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, **LLAMA31_ROPE} if args.rope_scaling \
        else {"rope_type": "default", "rope_theta": args.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.dim, "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        # transformers 5 reads rope_parameters; rope_theta and rope_scaling are the 4.x spelling,
        # kept for older readers (5.x accepts them and they agree).
        "rope_parameters": rope, "rope_theta": args.rope_theta,
        "rope_scaling": rope if args.rope_scaling else None,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": args.init_std, "dtype": dtype, "torch_dtype": dtype,
        # gridtrain's tokenizers are not Llama's: no bos/eos ids are claimed.
        "bos_token_id": None, "eos_token_id": None,
    }


def _read_rope(cfg: dict[str, Any], problems: list[str]) -> tuple[float, bool]:
    """(rope_theta, Llama 3.1 scaling) from either spelling of the RoPE settings."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, False
    if rope_type != "llama3":
        problems.append(f"rope_type {rope_type!r}: gridtrain implements 'default' RoPE and Llama 3.1's "
                        "'llama3' scaling only")
        return theta, False
    # transformers falls back to max_position_embeddings for the original context.
    got = {k: params.get(k, cfg.get("max_position_embeddings")) if k.startswith("original")
           else params.get(k) for k in LLAMA31_ROPE}
    if any(got[k] is None or float(got[k]) != v for k, v in LLAMA31_ROPE.items()):
        problems.append(f"llama3 RoPE scaling with {got}: gridtrain implements Llama 3.1's "
                        f"{LLAMA31_ROPE} only")
    return theta, True


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """The gridtrain shape of a transformers Llama config.json; InterchangeError lists together
    everything gridtrain's model cannot represent (biases, other activations, other RoPE)."""
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    problems = [f"config.json lacks {key!r}" for key in required if key not in cfg]
    if cfg.get("model_type") != "llama":
        problems.append(f"model_type {cfg.get('model_type')!r}: gridtrain reads 'llama' "
                        "(LlamaForCausalLM) only")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r}: gridtrain's MLP is SwiGLU (silu)")
    problems += [f"{key} = true: gridtrain's linear layers have no bias"
                 for key in ("attention_bias", "mlp_bias") if cfg.get(key)]
    if cfg.get("quantization_config"):
        problems.append("quantization_config: gridtrain reads unquantized weights only")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append(f"partial_rotary_factor {cfg['partial_rotary_factor']}: gridtrain rotates "
                        "whole heads")
    theta, scaling = _read_rope(cfg, problems)
    if problems:
        raise InterchangeError("unsupported Hugging Face config:\n" + "\n".join(f"  - {p}" for p in problems))
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, dim // heads) or dim % heads:
        raise InterchangeError(f"head_dim {cfg.get('head_dim')} with hidden_size {dim} and {heads} heads: "
                               "gridtrain needs head_dim = hidden_size / num_attention_heads")
    # Missing optional keys take LlamaConfig's defaults.
    args = ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                     n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
                     ffn_dim=cfg["intermediate_size"], norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     rope_theta=theta, rope_scaling=scaling,
                     max_seq_len=cfg.get("max_position_embeddings", 2048),
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    if errors := args.validate():
        raise InterchangeError("unsupported Hugging Face config:\n" + "\n".join(f"  - {e}" for e in errors))
    return args


# ---------------------------------------------------------------------------------------------
# State dicts


def _rope_rows_to_hf(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per head, rows (2i, 2i+1) become rows (i, i + head_dim/2): interleaved pairs to halves."""
    rows, cols = w.shape
    return w.view(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_rows_from_hf(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of `_rope_rows_to_hf`."""
    rows, cols = w.shape
    return w.view(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(suffix: str, args: ModelArgs) -> int | None:
    return {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.n_kv_heads}.get(suffix)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """gridtrain names and RoPE layout -> transformers'; a tied output head is left out."""
    out = {}
    for name, tensor in sd.items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = tensor
            continue
        match = _GRIDTRAIN_LAYER.match(name)
        if not match or match.group(2) not in _LAYER_NAMES:
            raise InterchangeError(f"no Hugging Face name for gridtrain parameter {name!r}")
        layer, suffix = match.groups()
        heads = _rope_heads(suffix, args)
        out[f"model.layers.{layer}.{_LAYER_NAMES[suffix]}"] = \
            _rope_rows_to_hf(tensor, heads) if heads else tensor
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers names and RoPE layout -> gridtrain's (the exact inverse of `to_hf_state_dict`)."""
    top = {v: k for k, v in _TOP_NAMES.items()}
    layer_names = {v: k for k, v in _LAYER_NAMES.items()}
    out = {}
    for name, tensor in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older transformers saved; gridtrain recomputes it
        if name in top:
            out[top[name]] = tensor
            continue
        match = _HF_LAYER.match(name)
        if not match or match.group(2) not in layer_names:
            raise InterchangeError(f"Hugging Face weight {name!r} has no place in gridtrain's Llama")
        layer, suffix = match.group(1), layer_names[match.group(2)]
        heads = _rope_heads(suffix, args)
        out[f"layers.{layer}.{suffix}"] = _rope_rows_from_hf(tensor, heads) if heads else tensor
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        head = out.get("output.weight")
        if head is not None and not torch.equal(head, out["tok_embeddings.weight"]):
            raise InterchangeError("tie_word_embeddings is true but lm_head.weight differs from "
                                   "model.embed_tokens.weight")
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


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
    """(model shape, checkpoint directory) from <run_dir>/config.json (rundir.write_record)."""
    config = run_record(run_dir)["config"]
    cfg = load_config(None, {f"model.{k}": v for k, v in config["model"].items()})
    ckpt_dir = config.get("checkpoint", {}).get("dir")
    return cfg.model.args(), Path(ckpt_dir) if ckpt_dir else run_dir / "checkpoints"


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


def load_model_weights(path: Path, args: ModelArgs) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a DCP checkpoint, read in this one process."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    # A tied head is the embedding: read it once (the checkpoint holds it under both names).
    wanted = {k: v for k, v in model.state_dict().items()
              if not (args.tie_embeddings and k == "output.weight")}
    # Reads only these keys (DCP's notice: see checkpoint.py); .metadata through the safe unpickler.
    dcp.load({"model": wanted}, storage_reader=SafeReader(path))
    return wanted


def export_run(run_dir: Path, out: Path, step: int | None = None) -> Path:
    """Write a run's checkpoint (the newest, or `step`'s) as a transformers Llama directory:
    model.safetensors and config.json. Returns `out`."""
    _require_free(Path(out))
    args, root = read_run(Path(run_dir))
    path = find_checkpoint(root, step)
    tensors = {k: v.contiguous() for k, v in to_hf_state_dict(load_model_weights(path, args), args).items()}
    dtype = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    with _atomic_dir(Path(out)) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
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

