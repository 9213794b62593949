"""The Hugging Face form of gridtrain's model: transformers `LlamaForCausalLM` names, config and weights.

Two conventions differ between the codebases:
- RoPE pairs. gridtrain rotates interleaved pairs (x[2i], x[2i+1]) of each head, as Meta's reference
  code does; transformers rotates halves (x[i], x[i + head_dim/2]) (`rotate_half`). The models agree
  once the rows of wq and wk are permuted within each head, which is what transformers'
  convert_llama_weights_to_hf.py `permute` does. wv and wo stay: q.k is unchanged when q and k
  have the same dimensions permuted.
- Names. `layers.N.attention.wq.weight` is `model.layers.N.self_attn.q_proj.weight`; w1, w3, w2 are
  gate_proj, up_proj, down_proj; the tied output head is not stored (transformers ties it on load).

This module is the mapping (names, shapes, configs); gridtrain.train.hf_run reads and writes
runs and Hugging Face directories with it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Container
from typing import Any

import torch

from gridtrain.errors import UserError
from gridtrain.model.args import ModelArgs
from gridtrain.validate import model_problems

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


# config.json's keys gridtrain reads, by the JSON type LlamaConfig gives them. None (null) is
# accepted where transformers writes one; a count must be a JSON integer: 2.0 is refused with "2".
_KEY_KINDS = {
    "hidden_size": "count", "intermediate_size": "count", "num_hidden_layers": "count",
    "num_attention_heads": "count", "num_key_value_heads": "count", "head_dim": "count", "vocab_size": "count",
    "max_position_embeddings": "count", "rms_norm_eps": "number", "rope_theta": "number",
    "partial_rotary_factor": "number", "tie_word_embeddings": "switch", "attention_bias": "switch",
    "mlp_bias": "switch", "model_type": "text", "hidden_act": "text", "rope_parameters": "object",
    "rope_scaling": "object",
}
_NULLABLE = {"num_key_value_heads", "head_dim", "rope_theta", "rope_parameters", "rope_scaling"}
# The keys of a rope_parameters (or rope_scaling) object; each may be null (then absent).
_ROPE_KINDS = {"rope_type": "text", "type": "text", "rope_theta": "number", "factor": "number",
               "low_freq_factor": "number", "high_freq_factor": "number", "original_max_position_embeddings": "count"}
_EXPECTED = {"count": 'a JSON integer (a count is written 2, not 2.0 or "2")', "number": "a finite JSON number",
             "switch": "true or false", "text": "a JSON string", "object": "a JSON object (or null)"}
# gridtrain's model keys (as ModelArgs.validate names them) and config.json's.
_HF_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_dim": "intermediate_size",
            "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta"}


def _is_kind(kind: str, value: object) -> bool:
    if kind == "count":
        return type(value) is int  # not bool, not float
    if kind == "number":
        try:
            return type(value) in (int, float) and math.isfinite(value)
        except OverflowError:  # an integer past float's range
            return False
    return type(value) is {"switch": bool, "text": str, "object": dict}[kind]


def _shown(value: object) -> str:
    """A value as config.json spells it ("2" is a string, 2.0 a float), cut short when long."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_type(value: object) -> str:
    return {dict: "an object", list: "an array (a list)", str: "a string", bool: "true or false",
            type(None): "null"}.get(type(value), "a number")


def _type_problems(cfg: dict[str, Any], kinds: dict[str, str], nullable: Container[str],
                   where: str = "") -> list[str]:
    return [f"{where}{key} = {_shown(cfg[key])} is not {_EXPECTED[kind]}" for key, kind in kinds.items()
            if key in cfg and not (cfg[key] is None and key in nullable) and not _is_kind(kind, cfg[key])]


def _read_rope(cfg: dict[str, Any], problems: list[str]) -> tuple[float, bool]:
    """(rope_theta, Llama 3.1 scaling) from either spelling of the RoPE settings (types checked)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = next((t for t in (params.get("rope_theta"), cfg.get("rope_theta")) if t is not None), 10_000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), False
    if rope_type != "llama3":
        problems.append(f"rope_type {rope_type!r}: gridtrain implements 'default' RoPE and Llama 3.1's "
                        "'llama3' scaling only")
        return float(theta), False
    # transformers falls back to max_position_embeddings for the original context.
    got = {k: params.get(k, cfg.get("max_position_embeddings")) if k.startswith("original")
           else params.get(k) for k in LLAMA31_ROPE}
    if any(got[k] is None or got[k] != v for k, v in LLAMA31_ROPE.items()):
        problems.append(f"llama3 RoPE scaling with {got}: gridtrain implements Llama 3.1's "
                        f"{LLAMA31_ROPE} only")
    return float(theta), True


def _config_problems(cfg: dict[str, Any]) -> list[str]:
    """Every key of the wrong JSON type or missing, and everything gridtrain's model cannot
    represent (biases, other activations, other RoPE); a key of the wrong type is not read further."""
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    problems = [f"config.json lacks {key!r}" for key in required if key not in cfg]
    problems += _type_problems(cfg, _KEY_KINDS, _NULLABLE)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(key), dict):
            problems += _type_problems(cfg[key], _ROPE_KINDS, _ROPE_KINDS, where=f"{key}.")
    if problems:
        return problems
    if cfg.get("model_type") != "llama":
        problems.append(f"model_type {cfg.get('model_type')!r}: gridtrain reads 'llama' "
                        "(LlamaForCausalLM) only")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r}: gridtrain's MLP is SwiGLU (silu)")
    problems += [f"{key} = true: gridtrain's linear layers have no bias"
                 for key in ("attention_bias", "mlp_bias") if cfg.get(key)]
    if cfg.get("quantization_config"):
        problems.append("quantization_config: gridtrain reads unquantized weights only")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {cfg['partial_rotary_factor']}: gridtrain rotates "
                        "whole heads")
    _read_rope(cfg, problems)
    return problems


def _with_hf_keys(problem: str) -> str:
    """A gridtrain model problem with the config.json names of the keys it mentions."""
    named = [k for k in dict.fromkeys(re.findall(r"\bmodel\.(\w+)", problem)) if k in _HF_KEYS]
    keys = ", ".join(f"model.{k} is {_HF_KEYS[k]}" for k in named)
    return f"{problem} (in config.json, {keys})" if keys else problem


def _unsupported(problems: list[str]) -> InterchangeError:
    """One line for one problem; a list for several (as ConfigError)."""
    if len(problems) == 1:
        return InterchangeError(f"unsupported Hugging Face config: {problems[0]}")
    return InterchangeError("unsupported Hugging Face config:\n" + "\n".join(f"  - {p}" for p in problems))


def hf_shape(cfg: Any) -> ModelArgs:
    """The gridtrain shape config.json spells, its JSON types checked, its relations not yet
    (check_hf_shape): `gridtrain import` first compares it with the safetensors headers.
    InterchangeError lists together every key of the wrong JSON type and everything gridtrain's
    model cannot represent."""
    if not isinstance(cfg, dict):
        raise InterchangeError(f"config.json is {json_type(cfg)}, not an object of settings: give a "
                               "transformers config.json (as written by save_pretrained)")
    if problems := _config_problems(cfg):
        raise _unsupported(problems)
    theta, scaling = _read_rope(cfg, [])
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    # Missing optional keys take LlamaConfig's defaults.
    return ModelArgs(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=heads,
                     n_kv_heads=heads if kv_heads is None else kv_heads, vocab_size=cfg["vocab_size"],
                     ffn_dim=cfg["intermediate_size"], norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     rope_theta=theta, rope_scaling=scaling,
                     max_seq_len=cfg.get("max_position_embeddings", 2048),
                     tie_embeddings=cfg.get("tie_word_embeddings", False))


def check_hf_shape(args: ModelArgs, cfg: dict[str, Any]) -> ModelArgs:
    """`args` (from hf_shape(cfg)) once it passes the checks `gridtrain train` applies
    (validate.model_problems) and its head_dim is config.json's."""
    if problems := model_problems(args):
        raise _unsupported([_with_hf_keys(p) for p in problems])
    if cfg.get("head_dim") not in (None, args.head_dim):
        raise InterchangeError(f"head_dim {cfg.get('head_dim')} with hidden_size {args.dim} and {args.n_heads} "
                               "heads: gridtrain needs head_dim = hidden_size / num_attention_heads")
    return args


def args_from_hf_config(cfg: Any) -> ModelArgs:
    """The gridtrain shape of a transformers Llama config.json, checked (hf_shape, check_hf_shape)."""
    return check_hf_shape(hf_shape(cfg), cfg)


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


def to_hf_name(name: str) -> str:
    """transformers' name of a gridtrain weight."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _GRIDTRAIN_LAYER.match(name)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise InterchangeError(f"no Hugging Face name for gridtrain parameter {name!r}")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def from_hf_name(name: str) -> str | None:
    """gridtrain's name of a transformers weight; None for a buffer gridtrain recomputes."""
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a buffer older transformers saved
    top = {v: k for k, v in _TOP_NAMES.items()}
    if name in top:
        return top[name]
    layer_names = {v: k for k, v in _LAYER_NAMES.items()}
    match = _HF_LAYER.match(name)
    if not match or match.group(2) not in layer_names:
        raise InterchangeError(f"Hugging Face weight {name!r} has no place in gridtrain's Llama")
    return f"layers.{match.group(1)}.{layer_names[match.group(2)]}"


def hf_layer_of(name: str) -> str | None:
    """The layer number N of a transformers weight `model.layers.N.*`, as written; else None."""
    match = _HF_LAYER.match(name)
    return match.group(1) if match else None


def _rope_heads_of(name: str, args: ModelArgs) -> int | None:
    """The heads whose RoPE rows gridtrain weight `name` holds (wq, wk), else None."""
    match = _GRIDTRAIN_LAYER.match(name)
    return _rope_heads(match.group(2), args) if match else None


def to_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """gridtrain weight `name` in transformers' layout (wq's and wk's rows permuted within heads)."""
    heads = _rope_heads_of(name, args)
    return _rope_rows_to_hf(tensor, heads) if heads else tensor


def from_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The inverse of `to_hf_tensor` (`name` is gridtrain's)."""
    heads = _rope_heads_of(name, args)
    return _rope_rows_from_hf(tensor, heads) if heads else tensor


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """gridtrain names and RoPE layout -> transformers'; a tied output head is left out."""
    return {to_hf_name(name): to_hf_tensor(name, tensor, args) for name, tensor in sd.items()
            if not (name == "output.weight" and args.tie_embeddings)}


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers names and RoPE layout -> gridtrain's (the exact inverse of `to_hf_state_dict`)."""
    out = {}
    for name, tensor in sd.items():
        ours = from_hf_name(name)
        if ours is not None:
            out[ours] = from_hf_tensor(ours, tensor, args)
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        head = out.get("output.weight")
        if head is not None and not torch.equal(head, out["tok_embeddings.weight"]):
            raise InterchangeError(TIED_HEAD_DIFFERS)
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


TIED_HEAD_DIFFERS = "tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
