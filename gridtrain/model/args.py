"""Model shapes: the `ModelArgs` dataclass and the named presets.

Presets are plain functions returning `ModelArgs`. The Llama 3 shapes follow the Llama 3 paper
(Table 3) and Meta's reference code: the FFN width is derived from `dim` with Llama's rounding
rule (see `ffn_hidden_dim`), the vocabulary is 128,256, RoPE theta is 500,000.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Callable


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

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

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
        if self.dim % self.n_heads:
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

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.output

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


PRESETS: dict[str, Callable[[], ModelArgs]] = {
    "tiny": tiny,
    "small": small,
    "bench-6l": bench_6l,
    "m26": m26,
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "llama3-405b": llama3_405b,
}

FIELD_NAMES = tuple(f.name for f in fields(ModelArgs))


def model_args(preset: str, **overrides: object) -> ModelArgs:
    """The preset's shape with the given fields replaced (None values are ignored)."""
    if preset not in PRESETS:
        raise KeyError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[preset](), **given)
