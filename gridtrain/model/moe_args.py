"""The shape and routing of a mixture-of-experts feed-forward: `MoEArgs` (no torch).

A token's feed-forward output is the weighted sum of the `top_k` routed experts its router picks
(Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch, Fedus et al. 2022), plus the shared
experts every token passes through (DeepSeekMoE, Dai et al. 2024). Each expert is a SwiGLU of
width `expert_ffn_dim`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

RouterScore = Literal["softmax", "sigmoid"]
"""How router logits become scores: softmax over the experts (Mixtral, Qwen3) or a sigmoid per
expert (DeepSeek-V3)."""
ROUTER_SCORES: tuple[str, ...] = get_args(RouterScore)

Balance = Literal["aux_loss", "bias", "none"]
"""Load balance: the auxiliary loss (Switch / GShard form), the auxiliary-loss-free expert bias
(DeepSeek-V3, Wang et al. 2024), or none."""
BALANCES: tuple[str, ...] = get_args(Balance)

GROUPED_MM_MULTIPLE = 8
"""torch._grouped_mm needs 16-byte strides: dim and expert_ffn_dim multiples of 4 in fp32 and of 8
in bf16 and fp16. gridtrain asks for 8, so one shape runs in every precision."""


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int = 8
    """Routed experts per MoE layer (E)."""
    top_k: int = 2
    """Routed experts each token goes to (k)."""
    expert_ffn_dim: int = 128
    """Hidden width of each routed (and shared) expert's SwiGLU."""
    num_shared_experts: int = 0
    """Experts every token passes through, as one SwiGLU of num_shared_experts x expert_ffn_dim."""
    score: RouterScore = "softmax"
    """'softmax' over the experts or 'sigmoid' per expert, computed in fp32."""
    normalize_top_k: bool = True
    """Divide the k chosen scores by their sum (Mixtral, Qwen3, DeepSeek-V3's sigmoid)."""
    route_scale: float = 1.0
    """Multiply the gate values by this (DeepSeek-V3: 2.5)."""
    balance: Balance = "aux_loss"
    """'aux_loss', 'bias' (chooses experts by score + bias, never changes the gate values; updated once
    per optimizer step from the step's global counts) or 'none'."""
    aux_loss_coef: float = 0.01
    """alpha of the auxiliary loss alpha * E * sum_i f_i P_i (f_i: fraction of the k-choices that went
    to expert i, P_i: its mean score); balanced routing gives alpha."""
    bias_update_rate: float = 1e-3
    """gamma of the expert bias: after each step b_i += gamma * sign(mean load - load of expert i)."""
    z_loss_coef: float = 0.0
    """Router z-loss coefficient (ST-MoE, Zoph et al. 2022): coef * mean over tokens of
    logsumexp(router logits)^2; 0 turns it off."""
    capacity_factor: float | None = None
    """None: dropless. Otherwise each expert takes at most ceil(capacity_factor x tokens x k / E) tokens
    of a micro-batch, in token order; the rest of its choices are dropped (the token keeps its residual).
    In training only: validation, `eval` and sampling route dropless, so that a token's output does
    not depend on how many tokens share its forward (a cached decode step holds one)."""
    every: int = 1
    """An MoE feed-forward on every n-th layer from first_dense on; the others are dense."""
    first_dense: int = 0
    """The first layers that stay dense (DeepSeek: 1 to 3)."""
    grouped_mm: bool = True
    """Run the experts through torch._grouped_mm (one kernel for all experts); false: a loop over them.
    Both give the same numbers."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has an MoE feed-forward (DeepSeek's rule)."""
        return layer >= self.first_dense and (layer - self.first_dense) % self.every == 0

    def capacity(self, tokens: int) -> int | None:
        """Assignments one expert takes from a micro-batch of `tokens` (None: dropless)."""
        if self.capacity_factor is None or self.capacity_factor * self.top_k >= self.num_experts:
            return None  # an expert could take every assignment: nothing is ever dropped
        share = self.capacity_factor * tokens * self.top_k / self.num_experts
        return math.ceil(share - 1e-9)  # 1.1 x 50 is 55.00000000000001 in floats, and means 55

    def problems(self, dim: int, n_layers: int) -> list[str]:
        """The broken relations of this MoE shape, each with its fix."""
        errors = []
        for name in ("num_experts", "top_k", "expert_ffn_dim", "every"):
            if getattr(self, name) < 1:
                errors.append(f"model.moe.{name} = {getattr(self, name)} must be >= 1")
        for name in ("num_shared_experts", "first_dense"):
            if getattr(self, name) < 0:
                errors.append(f"model.moe.{name} = {getattr(self, name)} must be >= 0")
        if errors:
            return errors
        if self.top_k > self.num_experts:
            errors.append(f"model.moe.top_k ({self.top_k}) is more than model.moe.num_experts "
                          f"({self.num_experts}): a token cannot go to more experts than there are; "
                          f"set top_k to at most {self.num_experts}")
        if self.top_k == 1 and self.normalize_top_k:
            errors.append("model.moe.top_k = 1 with normalize_top_k makes every gate value route_scale, so the "
                          "language-model loss never trains the router: set model.moe.normalize_top_k = false "
                          "(Switch's top-1 gates by the probability)")
        if self.score not in ROUTER_SCORES:
            errors.append(f"model.moe.score = '{self.score}' is not one of {', '.join(ROUTER_SCORES)}")
        if self.balance not in BALANCES:
            errors.append(f"model.moe.balance = '{self.balance}' is not one of {', '.join(BALANCES)}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            errors.append(f"model.moe.capacity_factor = {self.capacity_factor} must be > 0 (the tokens an expert "
                          "takes, as a multiple of its even share), or left unset for dropless routing")
        for name in ("aux_loss_coef", "bias_update_rate", "z_loss_coef"):
            if not getattr(self, name) >= 0:
                errors.append(f"model.moe.{name} = {getattr(self, name)} must be >= 0")
        if not self.route_scale > 0:
            errors.append(f"model.moe.route_scale = {self.route_scale} must be > 0")
        if self.first_dense >= n_layers:
            errors.append(f"model.moe.first_dense ({self.first_dense}) leaves no MoE layer among model.n_layers "
                          f"({n_layers}): lower it below {n_layers}, or use a dense preset")
        if self.grouped_mm:
            for name, width in (("model.dim", dim), ("model.moe.expert_ffn_dim", self.expert_ffn_dim)):
                if width % GROUPED_MM_MULTIPLE:
                    fit = GROUPED_MM_MULTIPLE * max(1, round(width / GROUPED_MM_MULTIPLE))
                    errors.append(f"{name} = {width} is not a multiple of {GROUPED_MM_MULTIPLE}, which "
                                  f"torch._grouped_mm needs (16-byte strides in bf16): make it {fit}, or set "
                                  "model.moe.grouped_mm = false (a loop over the experts)")
        return errors

    def moe_layers(self, n_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(n_layers))
