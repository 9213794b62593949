"""The Hugging Face form of gridtrain's model: transformers `LlamaForCausalLM` names, config and
weights, and `MixtralForCausalLM`'s for a mixture of experts (its sparse blocks: gridtrain.model.hf_moe).

Two conventions differ between the codebases:
- RoPE pairs. gridtrain rotates interleaved pairs (x[2i], x[2i+1]) of each head, as Meta's reference
  code does; transformers rotates halves (x[i], x[i + head_dim/2]) (`rotate_half`). The models agree
  once the rows of wq and wk are permuted within each head, which is what transformers'
  convert_llama_weights_to_hf.py `permute` does. wv and wo stay: q.k is unchanged when q and k
  have the same dimensions permuted.
- Names. `layers.N.attention.wq.weight` is `model.layers.N.self_attn.q_proj.weight`; w1, w3, w2 are
  gate_proj, up_proj, down_proj; the tied output head is not stored (transformers ties it on load).

This module is the mapping (names, shapes, configs); gridtrain.train.hf_run reads and writes
runs and Hugging Face directories with it. A gridtrain weight is one transformers weight, except a
mixture of experts' stacked ones, which Mixtral stores one per expert (hf_moe.Source says where).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Container, Iterable
from typing import Any

import torch

from gridtrain.errors import UserError
from gridtrain.model.args import ModelArgs
from gridtrain.model.hf_moe import (EXPORTABLE, MIXTRAL_DEFAULTS, MIXTRAL_KEY_KINDS, MIXTRAL_NULLABLE, SAVED,
                                    MixtralLayout, Source, layout_of, mixtral_config_problems, mixtral_keys,
                                    mixtral_problems, moe_from_config, moe_source)
from gridtrain.model.llama import Transformer
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


def export_problems(args: ModelArgs) -> list[str]:
    """What of this shape transformers' Llama (dense) or Mixtral (mixture of experts) layout cannot
    hold; empty when `hf_config` describes it exactly."""
    if args.moe is not None:
        return mixtral_problems(args)
    return ["QK-norm"] if args.qk_norm else []


def export_refusal(args: ModelArgs, what: str) -> InterchangeError:
    """One line: why `what` (a run) does not export, and which shapes do."""
    problems = export_problems(args)
    listed = problems[0] if len(problems) == 1 else f"{', '.join(problems[:-1])} and {problems[-1]}"
    if args.moe is None:
        return InterchangeError(f"{what} has {listed}, which transformers' Llama layout cannot hold: gridtrain "
                                "exports dense models without QK-norm as LlamaForCausalLM")
    return InterchangeError(f"{what} is a mixture of experts with {listed}, which "
                            "transformers' Mixtral (Jiang et al. 2024) cannot hold: gridtrain exports as "
                            f"MixtralForCausalLM those with {EXPORTABLE}")


def hf_config(args: ModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """config.json of the transformers LlamaConfig describing this model exactly, or for a mixture
    of experts the MixtralConfig (exact where `export_problems` finds nothing)."""
    rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, **LLAMA31_ROPE} if args.rope_scaling \
        else {"rope_type": "default", "rope_theta": args.rope_theta}
    config = {
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
    if args.moe is None:
        return config
    del config["attention_bias"], config["mlp_bias"]  # LlamaConfig's, not MixtralConfig's
    return config | mixtral_keys(args.moe)


# config.json's keys gridtrain reads, by the JSON type LlamaConfig gives them. None (null) is
# accepted where transformers writes one; a count must be a JSON integer: 2.0 is refused with "2".
_KEY_KINDS = {
    "hidden_size": "count", "intermediate_size": "count", "num_hidden_layers": "count",
    "num_attention_heads": "count", "num_key_value_heads": "count", "head_dim": "count", "vocab_size": "count",
    "max_position_embeddings": "count", "rms_norm_eps": "number", "rope_theta": "number",
    "partial_rotary_factor": "number", "tie_word_embeddings": "switch", "attention_bias": "switch",
    "mlp_bias": "switch", "model_type": "text", "hidden_act": "text", "rope_parameters": "object",
    "rope_scaling": "object", **MIXTRAL_KEY_KINDS,
}
_NULLABLE = {"num_key_value_heads", "head_dim", "rope_theta", "rope_parameters", "rope_scaling", *MIXTRAL_NULLABLE}
# What LlamaConfig and MixtralConfig assume for a key config.json leaves out (None: the query heads).
_DEFAULTS = {"llama": {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                       "num_key_value_heads": None}, "mixtral": MIXTRAL_DEFAULTS}
# The keys of a rope_parameters (or rope_scaling) object; each may be null (then absent).
_ROPE_KINDS = {"rope_type": "text", "type": "text", "rope_theta": "number", "factor": "number",
               "low_freq_factor": "number", "high_freq_factor": "number", "original_max_position_embeddings": "count"}
_EXPECTED = {"count": 'a JSON integer (a count is written 2, not 2.0 or "2")', "number": "a finite JSON number",
             "switch": "true or false", "text": "a JSON string", "object": "a JSON object (or null)"}
# gridtrain's model keys (as ModelArgs.validate names them) and config.json's.
_HF_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_dim": "intermediate_size",
            "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta", "head_dim": "head_dim",
            "moe.num_experts": "num_local_experts", "moe.top_k": "num_experts_per_tok",
            "moe.expert_ffn_dim": "intermediate_size", "moe.aux_loss_coef": "router_aux_loss_coef"}


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


def _default(cfg: dict[str, Any], key: str) -> Any:
    """config.json's `key`, or what its model_type's config class assumes when it is left out."""
    return cfg.get(key, _DEFAULTS.get(cfg.get("model_type"), _DEFAULTS["llama"])[key])


def _read_rope(cfg: dict[str, Any], problems: list[str]) -> tuple[float, bool]:
    """(rope_theta, Llama 3.1 scaling) from either spelling of the RoPE settings (types checked)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = next((t for t in (params.get("rope_theta"), cfg.get("rope_theta")) if t is not None),
                 _default({"model_type": cfg.get("model_type")}, "rope_theta"))  # null is the default too
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
    if cfg.get("model_type") not in _DEFAULTS:
        problems.append(f"model_type {cfg.get('model_type')!r}: gridtrain reads 'llama' (LlamaForCausalLM) "
                        "and 'mixtral' (MixtralForCausalLM) only")
    elif cfg["model_type"] == "mixtral":
        problems += mixtral_config_problems(cfg)
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
    named = [k for k in dict.fromkeys(re.findall(r"\bmodel\.((?:moe\.)?\w+)", problem)) if k in _HF_KEYS]
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
    dim, heads, head_dim = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("head_dim")
    kv_heads = _default(cfg, "num_key_value_heads")
    moe = moe_from_config(cfg, dim) if cfg["model_type"] == "mixtral" else None
    # intermediate_size is the experts' width in Mixtral; it is also the dense width, which no layer uses.
    return ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                     n_kv_heads=heads if kv_heads is None else kv_heads, vocab_size=cfg["vocab_size"],
                     ffn_dim=cfg["intermediate_size"], norm_eps=float(_default(cfg, "rms_norm_eps")),
                     rope_theta=theta, rope_scaling=scaling, max_seq_len=_default(cfg, "max_position_embeddings"),
                     tie_embeddings=cfg.get("tie_word_embeddings", False),
                     explicit_head_dim=head_dim if head_dim is not None and head_dim * heads != dim else None,
                     moe=moe)


def check_hf_shape(args: ModelArgs) -> ModelArgs:
    """`args` (from hf_shape(cfg)) once it passes the checks `gridtrain train` applies
    (validate.model_problems)."""
    if problems := model_problems(args):
        raise _unsupported([_with_hf_keys(p) for p in problems])
    return args


def args_from_hf_config(cfg: Any) -> ModelArgs:
    """The gridtrain shape of a transformers Llama or Mixtral config.json, checked (hf_shape,
    check_hf_shape)."""
    return check_hf_shape(hf_shape(cfg))


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
    """transformers' name of a gridtrain weight of a dense block, or of the embedding, norm or head."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _GRIDTRAIN_LAYER.match(name)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise InterchangeError(f"no Hugging Face name for gridtrain parameter {name!r}")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def hf_source(name: str, args: ModelArgs, layout: MixtralLayout = SAVED) -> Source:
    """Where gridtrain weight `name` is in a transformers state dict (an MoE block's: in `layout`)."""
    match = _GRIDTRAIN_LAYER.match(name)
    if match and match.group(2).startswith("moe.") and args.moe is not None:
        source = moe_source(match.group(1), match.group(2), args.moe.num_experts, layout)
        if source is None:
            raise InterchangeError(f"no Hugging Face name for gridtrain parameter {name!r}")
        return source
    return Source((to_hf_name(name),))


def hf_sources(names: Iterable[str], args: ModelArgs, layout: MixtralLayout = SAVED) -> dict[str, Source]:
    return {name: hf_source(name, args, layout) for name in names}


def hf_shapes(shapes: dict[str, torch.Tensor], sources: dict[str, Source]) -> dict[str, tuple[int, ...]]:
    """transformers' name and shape of each weight stored for gridtrain's `shapes` (meta tensors)."""
    return {hf_name: sources[name].stored_shape(tuple(meta.shape))
            for name, meta in shapes.items() for hf_name in sources[name].names}


def ignored_hf_name(name: str) -> bool:
    """A buffer older transformers saved and gridtrain recomputes (RoPE's inverse frequencies)."""
    return name.endswith("rotary_emb.inv_freq")


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


def model_shapes(args: ModelArgs) -> dict[str, torch.Tensor]:
    """The model's weights and saved buffers (the expert bias) as meta tensors (names, shapes,
    dtypes; nothing allocated), a tied head left out: a checkpoint holds it under both names, and
    it is the embedding."""
    with torch.device("meta"):
        model = Transformer(args)
    return {k: v for k, v in model.state_dict().items() if not (args.tie_embeddings and k == "output.weight")}


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """gridtrain names and RoPE layout -> transformers' (experts one weight each, as save_pretrained
    stores Mixtral); a tied output head and the expert bias (zero, or export refuses) are left out."""
    out = {}
    for name, tensor in sd.items():
        if not (name == "output.weight" and args.tie_embeddings):
            out.update(hf_source(name, args).split(to_hf_tensor(name, tensor, args)))
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """transformers names and RoPE layout -> gridtrain's, the experts in whichever layout `sd` has
    (the exact inverse of `to_hf_state_dict`; the expert bias is zero)."""
    shapes = model_shapes(args)
    sources = hf_sources(shapes, args, layout_of(sd))
    wanted = hf_shapes(shapes, sources)
    head = "lm_head.weight" if args.tie_embeddings and "lm_head.weight" in sd else None
    extra = [name for name in sd if name not in wanted and name != head and not ignored_hf_name(name)]
    missing = [name for name in wanted if name not in sd]
    if extra or missing:
        raise InterchangeError(f"Hugging Face weights with no place in gridtrain's model: {extra}; missing: {missing}")
    if head and not torch.equal(sd[head], sd["model.embed_tokens.weight"]):
        raise InterchangeError(TIED_HEAD_DIFFERS)
    out = {}
    for name, source in sources.items():
        if source.names:
            out[name] = from_hf_tensor(name, source.gather(sd.__getitem__, sd[source.names[0]].dtype), args)
        else:
            out[name] = torch.zeros(shapes[name].shape, dtype=shapes[name].dtype)
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


TIED_HEAD_DIFFERS = "tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
