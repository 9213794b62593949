"""transformers' Mixtral form of gridtrain's mixture of experts (Mixtral of Experts, Jiang et al. 2024):
which MoE shapes it holds, its config.json keys, and where each expert weight is stored.

Mixtral's sparse block is gridtrain's MoE with a softmax router whose top-k probabilities are divided
by their sum, route_scale 1, no shared experts, experts on every layer and every token reaching its k
experts (no capacity). transformers takes the softmax in fp32 of router logits in the model's dtype;
gridtrain's logits are fp32 in every precision, so in fp32 both pick the same experts. The rest of
the block (attention, norms, RoPE) is Llama's: gridtrain.model.hf maps it.

from_pretrained loads the experts in either of two layouts:
- per expert, as the Hub's Mixtral checkpoints and save_pretrained (which undoes transformers 5's
  fusion on save) store them: `model.layers.N.block_sparse_moe.gate.weight` (E, dim) and
  `...block_sparse_moe.experts.e.w1.weight` (ffn, dim), `w2` (dim, ffn), `w3` (ffn, dim): Mistral's
  names, and exactly the slices e of gridtrain's stacked `moe.experts.w1`, `w2`, `w3`;
- fused, as transformers 5 holds them (its conversion_mapping.py): `model.layers.N.mlp.gate.weight`,
  `mlp.experts.gate_up_proj` (E, 2 ffn, dim), w1 above w3 along dim 1, and `mlp.experts.down_proj`
  (E, dim, ffn), which is w2.
`gridtrain export` writes the first (transformers 4 reads it too); `gridtrain import` reads either,
under either prefix (`block_sparse_moe` or `mlp`: transformers renames one to the other on load).

Only the coefficient of the load-balance loss travels: router_aux_loss_coef is gridtrain's
aux_loss_coef. transformers' loss (load_balancing_loss_func) pools the counts of all layers and counts
a token's k choices k times, E sum_i (k f_i) P_i, where gridtrain adds alpha E sum_i f_i P_i over the
layers; at the same coefficient the two push at different strengths (uniform routing: alpha k against
alpha L). DeepSeek-V3's expert bias takes part in choosing experts, so only a zero bias exports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gridtrain.model.args import ModelArgs
from gridtrain.model.moe_args import GROUPED_MM_MULTIPLE, MoEArgs

# config.json's Mixtral keys gridtrain reads, by JSON type (as gridtrain.model.hf's _KEY_KINDS).
MIXTRAL_KEY_KINDS = {"num_local_experts": "count", "num_experts_per_tok": "count",
                     "router_aux_loss_coef": "number", "router_jitter_noise": "number", "sliding_window": "count"}
MIXTRAL_NULLABLE = {"sliding_window"}
MIXTRAL_DEFAULTS = {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                    "num_key_value_heads": 8, "router_aux_loss_coef": 0.001}
"""What MixtralConfig (transformers 5.23) assumes for a key config.json leaves out."""
EXPORTABLE = ("a softmax router renormalised over its top k, route_scale 1, no shared experts, experts on every "
              "layer (model.moe.every 1, first_dense 0), no capacity (capacity_factor unset) and no QK-norm")
"""The mixture-of-experts shapes transformers' Mixtral holds, as a refusal names them."""


# ---------------------------------------------------------------------------------------------
# Shapes and configs


def mixtral_problems(args: ModelArgs) -> list[str]:
    """What of this mixture-of-experts shape Mixtral's sparse block cannot hold (empty: all of it)."""
    moe = args.moe
    problems = []
    if moe.score != "softmax":
        problems.append(f"{moe.score} router scores")
    if not moe.normalize_top_k:
        problems.append("top-k gates not renormalised (normalize_top_k false)")
    if moe.route_scale != 1.0:
        problems.append(f"gates scaled by route_scale {moe.route_scale}")
    if moe.num_shared_experts:
        problems.append(f"{moe.num_shared_experts} shared expert{'s' if moe.num_shared_experts > 1 else ''}")
    if moe.moe_layers(args.n_layers) < args.n_layers:
        problems.append(f"dense layers (every {moe.every}, first_dense {moe.first_dense})")
    if moe.capacity_factor is not None:
        problems.append(f"tokens dropped past capacity_factor {moe.capacity_factor}")
    if args.qk_norm:
        problems.append("QK-norm")
    return problems


def mixtral_keys(moe: MoEArgs) -> dict[str, Any]:
    """config.json's keys of a Mixtral sparse block beyond Llama's (intermediate_size is the experts')."""
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": moe.expert_ffn_dim, "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coef if moe.balance == "aux_loss" else 0.0,
            "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}


def mixtral_config_problems(cfg: dict[str, Any]) -> list[str]:
    """What of a Mixtral config.json (its types checked) gridtrain's model cannot represent."""
    problems = [f"config.json lacks {key!r}" for key in ("num_local_experts", "num_experts_per_tok")
                if key not in cfg]
    window, context = cfg.get("sliding_window"), cfg.get("max_position_embeddings",
                                                          MIXTRAL_DEFAULTS["max_position_embeddings"])
    if window is not None and window < context:
        problems.append(f"sliding_window {window} below max_position_embeddings {context}: gridtrain's attention "
                        "sees the whole causal context (Mixtral's config leaves the window null)")
    return problems


def moe_from_config(cfg: dict[str, Any], dim: int) -> MoEArgs:
    """The MoE shape of a Mixtral config.json (checked by mixtral_config_problems): its router and
    experts, the aux-loss balance at router_aux_loss_coef (none at 0), gridtrain's defaults for what
    Mixtral has not (no z-loss, no capacity), and the grouped matmul where the widths allow it.
    router_jitter_noise, a perturbation of training only, has no counterpart and is not kept."""
    coef = float(cfg.get("router_aux_loss_coef", MIXTRAL_DEFAULTS["router_aux_loss_coef"]))
    ffn = cfg["intermediate_size"]
    grouped = dim % GROUPED_MM_MULTIPLE == 0 and ffn % GROUPED_MM_MULTIPLE == 0
    return MoEArgs(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"], expert_ffn_dim=ffn,
                   balance="aux_loss" if coef > 0 else "none", aux_loss_coef=coef, grouped_mm=grouped)


# ---------------------------------------------------------------------------------------------
# Where the weights are


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one gridtrain weight is in a transformers state dict: one weight, the stack along dim 0
    of several (one per expert), or one half along dim 1 of one (`half` 0 or 1: transformers 5's
    fused gate_up_proj). No names: a buffer transformers has not (the expert bias, zero)."""

    names: tuple[str, ...]
    half: int | None = None

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each weight of `names`, for a gridtrain weight of `shape`."""
        if len(self.names) > 1:
            return shape[1:]
        if self.half is not None:
            return (shape[0], 2 * shape[1], *shape[2:])
        return shape

    def split(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored weights of gridtrain weight `tensor` (views of it)."""
        if self.half is not None:
            raise ValueError("a fused gate_up_proj is read, not written: export writes one weight per expert")
        if len(self.names) == 1:
            return {self.names[0]: tensor}
        return dict(zip(self.names, tensor.unbind(0)))

    def gather(self, read: Callable[[str], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The gridtrain weight, in `dtype`, from its stored weights (`read` gives one by name)."""
        parts = [read(name).to(dtype) for name in self.names]
        tensor = torch.stack(parts) if len(parts) > 1 else parts[0]
        return tensor if self.half is None else tensor.chunk(2, dim=1)[self.half]


@dataclasses.dataclass(frozen=True)
class MixtralLayout:
    """How a directory stores the sparse blocks: under `block` (`block_sparse_moe` or `mlp`), one weight
    per expert or fused."""

    block: str = "block_sparse_moe"
    fused: bool = False


SAVED = MixtralLayout()
"""save_pretrained's layout, and `gridtrain export`'s."""


def layout_of(names: Iterable[str]) -> MixtralLayout:
    """The layout of a directory's weights, from their names."""
    names = list(names)
    fused = any(name.endswith(".experts.gate_up_proj") for name in names)
    block = "block_sparse_moe" if any(".block_sparse_moe." in name for name in names) else "mlp"
    return MixtralLayout(block, fused)


def moe_source(layer: str, suffix: str, num_experts: int, layout: MixtralLayout = SAVED) -> Source | None:
    """Where the weight `layers.<layer>.<suffix>` of an MoE block (suffix `moe.*`) is; None: it has no
    place in Mixtral (shared experts, which export refuses first)."""
    block = f"model.layers.{layer}.{layout.block}"
    if suffix == "moe.router.gate.weight":
        return Source((f"{block}.gate.weight",))
    if suffix == "moe.expert_bias":
        return Source(())
    name = suffix.removeprefix("moe.experts.")
    if name not in ("w1", "w2", "w3"):
        return None
    if layout.fused:
        return Source((f"{block}.experts.down_proj",)) if name == "w2" else \
            Source((f"{block}.experts.gate_up_proj",), half=0 if name == "w1" else 1)
    return Source(tuple(f"{block}.experts.{e}.{name}.weight" for e in range(num_experts)))
