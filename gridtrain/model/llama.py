"""The Llama 3 architecture for one device: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Nothing here knows about parallelism; gridtrain applies it from outside (gridtrain/parallel).
Module and parameter names follow the common Llama layout (`layers.{i}.attention.wq`, ...), so
tensor-parallel plans and checkpoint converters can address them by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gridtrain.model.args import ModelArgs


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Complex rotations e^{i t w_k}, shape (max_seq_len, head_dim / 2).

    With `rope_scaling`, low frequencies are divided by 8 and the middle band interpolated, as in
    Llama 3.1 (factor 8, low/high frequency factors 1 and 4, original context 8192).
    """
    half = args.head_dim // 2
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / args.head_dim))
    if args.rope_scaling:
        freqs = _llama31_scale(freqs)
    t = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def _llama31_scale(freqs: torch.Tensor, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                   original_context: int = 8192) -> torch.Tensor:
    wavelen = 2 * math.pi / freqs
    low_wavelen, high_wavelen = original_context / low, original_context / high
    smooth = (original_context / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(middle, blended, scaled)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    # x: (B, T, n_heads, head_dim); freqs: (T, head_dim / 2) complex
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = xc * freqs[None, :, None, :]
    return torch.view_as_real(rotated).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Heads are inferred (-1) so the same code runs on a tensor-parallel shard of the heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, n_heads, head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        # freqs covers the model's whole context; slice to T here, where the sequence is whole
        # even when sequence parallelism splits it outside attention.
        q, k = apply_rope(q, freqs[:T]), apply_rope(k, freqs[:T])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_heads * head_dim)
        return self.wo(out)

    def reset_parameters(self, out_std: float, std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(w.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.wo.weight, std=out_std, a=-3 * out_std, b=3 * out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def reset_parameters(self, out_std: float, std: float) -> None:
        for w in (self.w1, self.w3):
            nn.init.trunc_normal_(w.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.w2.weight, std=out_std, a=-3 * out_std, b=3 * out_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        # Output projections shrink with depth (GPT-2 / torchtitan "depth init").
        self._out_std = args.init_std / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self, std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.reset_parameters(self._out_std, std)
        self.feed_forward.reset_parameters(self._out_std, std)


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size).

    Stages of a pipeline keep only some of these modules: any of `tok_embeddings`, `norm` and
    `output` may be None, and `layers` is a ModuleDict keyed by the global layer index, so a
    stage holding layers 8..15 keeps their names (and checkpoint keys).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", rope_frequencies(args), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # The residual stream is fp32 in every precision mode: autocast computes matmuls in
        # bf16/fp16 and the residual adds promote back to fp32. An embedding stored or gathered
        # in bf16 would otherwise start a bf16 stream (a no-op when it is fp32 already).
        h = self.tok_embeddings(tokens).float() if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter (and rebuild RoPE tables): call after `to_empty()`."""
        if seed is not None:
            torch.manual_seed(seed)
        std = self.args.init_std
        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            # `to_empty()` materialises each module's parameters separately: tie them again.
            self.output.weight = self.tok_embeddings.weight
        self.freqs_cis = rope_frequencies(self.args).to(self.freqs_cis.device)
        if self.tok_embeddings is not None:
            # A tied matrix is also the output head, so it gets the head's small scale.
            emb_std = std if self.args.tie_embeddings else 1.0
            nn.init.normal_(self.tok_embeddings.weight, std=emb_std)
        for layer in self.layers.values():
            layer.reset_parameters(std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_embeddings:
            # Small logits at the start, so the loss begins at ln(vocab_size) (GPT-2's init).
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)
