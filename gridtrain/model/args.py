"""Model shapes: the `ModelArgs` dataclass and the named presets.

Presets are plain functions returning `ModelArgs`. The Llama 3 shapes follow the Llama 3 paper
(Table 3) and Meta's reference code: the FFN width is derived from `dim` with Llama's rounding
rule (see `ffn_hidden_dim`), the vocabulary is 128,256, RoPE theta is 500,000.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from typing import Callable

from gridtrain.model.moe_args import MoEArgs


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 256
    """Width of the residual stream (h)."""
    n_layers: int = 4
    """Number of transformer blocks (L)."""
    n_heads: int = 8
    """Attention query heads; head_dim = dim / n_heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    vocab_size: int = 320
    """Rows of the embedding and output head (at least the tokenizer's vocabulary)."""
    ffn_dim: int | None = None
    """Hidden width of the SwiGLU MLP; None derives it from dim with Llama's rounding."""
    ffn_dim_multiplier: float | None = None
    """Llama's multiplier on the derived FFN width (1.3 for 8B/70B, 1.2 for 405B)."""
    multiple_of: int = 256
    """The derived FFN width is rounded up to a multiple of this."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 500_000.0
    """Base of the rotary position embedding frequencies."""
    rope_scaling: bool = False
    """Llama 3.1 frequency scaling of RoPE for long context (factor 8, original context 8192)."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE tables are built for (the model's context)."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices."""
    explicit_head_dim: int | None = None
    """Width of each attention head where it is not dim / n_heads (Qwen3: 128 beside dim 2048 and 32
    heads); None: dim / n_heads."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE (Qwen3; weights of head_dim)."""
    moe: MoEArgs | None = None
    """Mixture-of-experts feed-forwards (gridtrain.model.moe_args); None: a dense model."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The MLP hidden width actually used."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    def validate(self) -> list[str]:
        """Return the broken relations of this shape (empty when it is consistent)."""
        errors = []
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                errors.append(f"model.{name} = {getattr(self, name)} must be positive")
        if errors:
            return errors
        if self.explicit_head_dim is not None and self.explicit_head_dim <= 0:
            errors.append(f"model.head_dim = {self.explicit_head_dim} must be positive")
        elif self.explicit_head_dim is not None and self.head_dim % 2:
            errors.append(f"model.head_dim = {self.head_dim} must be even for RoPE")
        elif self.explicit_head_dim is None and self.dim % self.n_heads:
            errors.append(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}): "
                f"pick n_heads among {_divisors(self.dim)[:8]}"
            )
        elif self.head_dim % 2:
            errors.append(f"head_dim = model.dim / model.n_heads = {self.dim} / {self.n_heads} = "
                          f"{self.head_dim} must be even for RoPE: choose model.n_heads so that "
                          "dim / n_heads is even")
        if self.n_heads % self.n_kv_heads:
            errors.append(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention: pick n_kv_heads among "
                f"{_divisors(self.n_heads)}"
            )
        if self.n_layers > MAX_LAYERS:
            errors.append(f"model.n_layers = {self.n_layers:,} is past {MAX_LAYERS:,} blocks (Llama 3 405B has 126): "
                          "check the shape")
        if self.ffn_dim is not None and self.ffn_dim <= 0:
            errors.append(f"model.ffn_dim = {self.ffn_dim} must be positive")
        widest = max(self.dim * self.dim, self.dim * self.hidden_dim, self.dim * self.vocab_size)
        if widest > LARGEST_WEIGHT:
            errors.append(f"model.dim ({self.dim:,}) makes a weight of {widest:,} elements (dim x max(dim, "
                          f"ffn {self.hidden_dim:,}, vocab {self.vocab_size:,})), past {LARGEST_WEIGHT:.0e}: no "
                          "device holds it; check the shape")
        if not self.rope_theta > 0:
            errors.append(f"model.rope_theta = {self.rope_theta} must be positive (Llama 3: 500000)")
        if self.moe is not None:
            errors += self.moe.problems(self.dim, self.n_layers)
        return errors


MAX_LAYERS = 10_000
"""Blocks any shape may have: 80 times Llama 3 405B's 126. Every per-tensor walk (building the
model on the meta device, the planner's census of a rank) is linear in it, and a typo of a million
would keep them busy for minutes."""

LARGEST_WEIGHT = 10**13
"""Elements of the largest weight matrix any shape may have (Llama 3 405B's embedding: 2.1e9),
well below where torch's byte counts overflow int64 (about 1e18)."""


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part (`gridtrain model` and the planner count the same way)."""

    embedding: int
    attention: int
    mlp: int
    norms: int
    output: int
    experts: int = 0
    """The routed experts' weights, all of them (MoE; the routers and shared experts count under mlp)."""
    experts_active: int = 0
    """The routed experts' weights one token uses: experts x top_k / num_experts."""

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.output + self.experts

    @property
    def active(self) -> int:
        """Parameters one token passes through: the total less the routed experts it does not use
        (the total for a dense model)."""
        return self.total - self.experts + self.experts_active

    @property
    def non_embedding(self) -> int:
        """Parameters that take part in matmuls: everything but the input embedding lookup."""
        return self.total - self.embedding


def ffn_hidden_dim(dim: int, multiple_of: int, multiplier: float | None) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, times an optional multiplier, rounded up.

    8B: dim 4096, x1.3, multiple_of 1024 -> 14336; 70B: 8192, x1.3, 4096 -> 28672;
    405B: 16384, x1.2, 4096 -> 53248.
    """
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tiny() -> ModelArgs:
    """For unit tests: 2 layers, a few thousand parameters per block."""
    return ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, ffn_dim=160,
                     max_seq_len=256)


def small() -> ModelArgs:
    """The default: ~3.3M parameters, trains in minutes on a laptop CPU with the byte tokenizer."""
    return ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=320, ffn_dim=768,
                     max_seq_len=1024)


def bench_6l() -> ModelArgs:
    """The benchmark's middle shape: dim 256, 6 layers, 16 heads, ffn 768, vocabulary 2048."""
    return ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, ffn_dim=768,
                     max_seq_len=1024)


def m26() -> ModelArgs:
    """26.0M parameters: dim 512, 8 layers, 8 heads, ffn 1408, byte vocabulary padded to 320."""
    return ModelArgs(dim=512, n_layers=8, n_heads=8, vocab_size=320, ffn_dim=1408,
                     max_seq_len=1024)


def llama3_8b() -> ModelArgs:
    """Llama 3 8B (Llama 3 paper, Table 3): 32 layers, dim 4096, FFN 14336, 32 heads, 8 KV heads."""
    return ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256,
                     ffn_dim_multiplier=1.3, multiple_of=1024, max_seq_len=8192)


def llama3_70b() -> ModelArgs:
    """Llama 3 70B: 80 layers, dim 8192, FFN 28672, 64 heads, 8 KV heads."""
    return ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128_256,
                     ffn_dim_multiplier=1.3, multiple_of=4096, max_seq_len=8192)


def llama3_405b() -> ModelArgs:
    """Llama 3 405B: 126 layers, dim 16384, FFN 53248, 128 heads, 8 KV heads."""
    return ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128_256,
                     ffn_dim_multiplier=1.2, multiple_of=4096, max_seq_len=8192)


def tiny_moe() -> ModelArgs:
    """For unit tests: the tiny shape with 8 routed experts of width 32 on both layers, top-2."""
    return replace(tiny(), moe=MoEArgs(num_experts=8, top_k=2, expert_ffn_dim=32))


def small_moe() -> ModelArgs:
    """The small shape with 8 experts of width 384, top-2: a token passes through 2 x 384 = 768
    hidden units, `small`'s dense width, so the two compare at the same active size."""
    return replace(small(), moe=MoEArgs(num_experts=8, top_k=2, expert_ffn_dim=384))


def mixtral_8x7b() -> ModelArgs:
    """Mixtral 8x7B (Jiang et al. 2024): Mistral 7B's attention (32 layers, dim 4096, 32 heads, 8 KV
    heads, vocabulary 32,000, RoPE theta 1e6), 8 experts of FFN 14336 per layer, top-2, softmax
    renormalised over the two; 46.7B parameters, 12.9B active."""
    return ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32_000, ffn_dim=14_336,
                     rope_theta=1e6, max_seq_len=32_768,
                     moe=MoEArgs(num_experts=8, top_k=2, expert_ffn_dim=14_336, aux_loss_coef=0.02))


def qwen3_30b_a3b() -> ModelArgs:
    """Qwen3-30B-A3B (Qwen3 technical report, Yang et al. 2025): 48 layers, dim 2048, 32 query heads
    of 128 (wider than dim / heads), 4 KV heads, QK-norm, 128 experts of FFN 768, top-8, vocabulary
    151,936, untied; 30.5B parameters, 3.3B active."""
    return ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, explicit_head_dim=128, qk_norm=True,
                     vocab_size=151_936, ffn_dim=6144, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40_960,
                     moe=MoEArgs(num_experts=128, top_k=8, expert_ffn_dim=768, aux_loss_coef=0.001))


def qwen3_235b_a22b() -> ModelArgs:
    """Qwen3-235B-A22B (the same report): 94 layers, dim 4096, 64 query heads of 128, 4 KV heads,
    QK-norm, 128 experts of FFN 1536, top-8; 235B parameters, 22B active."""
    return ModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, explicit_head_dim=128, qk_norm=True,
                     vocab_size=151_936, ffn_dim=12_288, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40_960,
                     moe=MoEArgs(num_experts=128, top_k=8, expert_ffn_dim=1536, aux_loss_coef=0.001))


PRESETS: dict[str, Callable[[], ModelArgs]] = {
    "tiny": tiny,
    "small": small,
    "bench-6l": bench_6l,
    "m26": m26,
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "llama3-405b": llama3_405b,
    "tiny-moe": tiny_moe,
    "small-moe": small_moe,
    "mixtral-8x7b": mixtral_8x7b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "qwen3-235b-a22b": qwen3_235b_a22b,
}

DENSE_PRESETS = tuple(name for name, make in PRESETS.items() if make().moe is None)
"""The dense presets."""

FIELD_NAMES = tuple(f.name for f in fields(ModelArgs))


def model_args(preset: str, moe: dict[str, object] | None = None, **overrides: object) -> ModelArgs:
    """The preset's shape with the given fields replaced, and its MoE fields with `moe`'s (None
    values are ignored; MoE fields on a dense preset raise ValueError). Kept per arguments (the
    result is frozen): `validate` asks for it several times, and the parity matrix validates
    84,000 configurations."""
    try:
        return _model_args(preset, tuple(sorted((moe or {}).items())), tuple(sorted(overrides.items())))
    except TypeError:  # a value that cannot be a key (a list): not kept
        return _make_model_args(preset, moe, **overrides)


@functools.lru_cache(maxsize=4096)
def _model_args(preset: str, moe: tuple[tuple[str, object], ...],
                overrides: tuple[tuple[str, object], ...]) -> ModelArgs:
    return _make_model_args(preset, dict(moe), **dict(overrides))


def _make_model_args(preset: str, moe: dict[str, object] | None = None, **overrides: object) -> ModelArgs:
    if preset not in PRESETS:
        raise KeyError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    args = replace(PRESETS[preset](), **given)
    moe_given = {k: v for k, v in (moe or {}).items() if v is not None}
    if moe_given and args.moe is None:
        raise ValueError(f"model.moe.{next(iter(moe_given))} is set, but model.preset '{preset}' is dense: "
                         f"start from a mixture-of-experts preset ({', '.join(n for n in PRESETS if n not in DENSE_PRESETS)}) "
                         "and override its fields")
    return replace(args, moe=replace(args.moe, **moe_given)) if moe_given else args
