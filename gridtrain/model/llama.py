"""The Llama 3 architecture for one device: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Nothing here knows about parallelism; gridtrain applies it from outside (gridtrain/parallel).
Module and parameter names follow the common Llama layout (`layers.{i}.attention.wq`, ...), so
tensor-parallel plans and checkpoint converters can address them by name.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gridtrain.model.args import ModelArgs
from gridtrain.model.documents import Documents, document_attention
from gridtrain.model.moe import MoE


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
    # x: (B, T, n_heads, head_dim); freqs: (T, head_dim / 2) complex, or (B, T, head_dim / 2) when
    # each sequence has its own positions (restarted at each document)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = xc * (freqs[None, :, None, :] if freqs.dim() == 2 else freqs[:, :, None, :])
    return torch.view_as_real(rotated).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        """Causal attention of (B, heads, T, head_dim) queries, keys and values (keys and values at
        the KV heads); None is torch's SDPA (or, with documents, document_attention). Context
        parallelism sets its ring attention here."""

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # Heads are inferred (-1) so the same code runs on a tensor-parallel shard of the heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, n_heads, head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:  # QK-norm (Qwen3): each head's queries and keys, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        # freqs covers the model's whole context; slice to T here, where the sequence is whole
        # even when sequence parallelism splits it outside attention.
        freqs = freqs[:T] if freqs.dim() == 2 else freqs  # per-sequence tables are T long already
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        if self.core is None and docs is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.core is None:
            out = document_attention(q, k, v, docs)
        else:
            out = self.core(q, k, v) if docs is None else self.core(q, k, v, docs=docs)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_heads * head_dim)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Attention, then a dense SwiGLU (`feed_forward`) or, on a mixture-of-experts layer, `moe`."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.moe is not None and args.moe.is_moe_layer(layer_id):
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs, docs=docs)
        return h + self.feed(self.ffn_norm(h))

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        """The block's feed-forward, dense or mixture of experts."""
        return self.moe(x) if hasattr(self, "moe") else self.feed_forward(x)


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
        self.restart_positions = False
        """With document ids, rotate each token by its position in its document (data.doc_positions)."""
        self.chunk_positions: torch.Tensor | None = None
        """The local tokens' positions in the whole sequence (`rotate_at`), None: 0..T-1."""
        self.whole_table: torch.Tensor | None = None
        """The RoPE table of every position, under context parallelism with restarted positions."""

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`doc_ids` (B, T): each token's document in its sequence (documents.document_ids), or
        None: attention stays inside each document, and RoPE positions restart at each when
        `restart_positions`. A tensor, so a pipeline schedule splits it into micro-batches and
        hands each stage its own (the schedule's keyword arguments reach every stage)."""
        docs = None if doc_ids is None else Documents(doc_ids, self.restart_positions)
        # The residual stream is fp32 in every precision mode: autocast computes matmuls in
        # bf16/fp16 and the residual adds promote back to fp32. An embedding stored or gathered
        # in bf16 would otherwise start a bf16 stream (a no-op when it is fp32 already).
        h = self.tok_embeddings(tokens).float() if self.tok_embeddings is not None else tokens
        freqs = self.freqs_cis
        if docs is not None and docs.restart:
            freqs = self.document_rotations(docs)
        for layer in self.layers.values():
            h = layer(h, freqs) if docs is None else layer(h, freqs, docs=docs)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def rotate_at(self, positions: torch.Tensor) -> None:
        """Rotate the tokens by the RoPE angles of `positions`, not of 0..T-1 (a context-parallel
        rank holds chunks of each sequence): the table becomes theirs, still a buffer, so no
        forward gathers or saves a copy of it."""
        self.chunk_positions = positions.to(self.freqs_cis.device)
        self.freqs_cis = self.freqs_cis[self.chunk_positions]

    def document_rotations(self, docs: Documents) -> torch.Tensor:
        """(B, T, head_dim / 2): each local token's rotation at its position in its document (`docs`
        are the whole sequences'; a context-parallel rank holds the tokens at `chunk_positions`,
        and its table is theirs, so the whole table is built once more, kept beside it)."""
        positions = docs.positions().to(self.freqs_cis.device)
        if self.chunk_positions is None:
            return self.freqs_cis[positions]
        if self.whole_table is None:
            self.whole_table = rope_frequencies(self.args).to(self.freqs_cis.device)
        return self.whole_table[positions[:, self.chunk_positions]]

    def after_to_empty(self) -> None:
        """Tie the head to the embedding again (`to_empty()` materialises each module's parameters
        separately) and rebuild the RoPE table, which `to_empty()` leaves uninitialised."""
        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight
        self.freqs_cis = rope_frequencies(self.args).to(self.freqs_cis.device)
        for module in self.modules():
            if isinstance(module, MoE):  # the expert bias starts at 0; the step's counters too
                for buffer in module.buffers(recurse=False):
                    buffer.zero_()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter this module holds (a pipeline stage: its own) to the values
        `init_values` gives them, and rebuild the RoPE table: call after `to_empty()`. (A model
        already parallelised is initialised by `parallel.materialize`, which copies each rank's
        shard of the same values.)"""
        self.after_to_empty()
        own = dict(self.named_parameters())
        for name, value in init_values(self.args, seed):
            if name in own:
                own[name].copy_(value)


def init_values(args: ModelArgs, seed: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full initial value) of every parameter, one at a time, in a fixed order from the
    global RNG seeded with `seed`, on the CPU: the same numbers on every device and whatever part
    of the model a process holds (a process skips the values that are not its own).

    The embedding is N(0, 1) (N(0, init_std) when tied: it is also the output head); q, k, v, w1
    and w3 are normal with std init_std truncated at 3 std; output projections (wo, w2) shrink with
    depth, std init_std / sqrt(2 (layer + 1)) (GPT-2's scaled init, torchtitan's depth init); norms
    are ones; the untied head is truncated normal with std init_std, so the loss starts at
    ln(vocab_size)."""
    if seed is not None:
        torch.manual_seed(seed)
    std, dim, head, kv = args.init_std, args.dim, args.head_dim, args.n_kv_heads * args.head_dim

    def normal(shape: tuple[int, ...], sd: float, truncated: bool = True) -> torch.Tensor:
        return truncated_normal(shape, sd) if truncated else torch.empty(shape).normal_(0.0, sd)

    yield "tok_embeddings.weight", normal((args.vocab_size, dim), std if args.tie_embeddings else 1.0, False)
    for i in range(args.n_layers):
        out_std = std / math.sqrt(2 * (i + 1))
        yield f"layers.{i}.attention_norm.weight", torch.ones(dim)
        yield f"layers.{i}.ffn_norm.weight", torch.ones(dim)
        for name, rows in (("wq", args.n_heads * head), ("wk", kv), ("wv", kv)):
            yield f"layers.{i}.attention.{name}.weight", normal((rows, dim), std)
        yield f"layers.{i}.attention.wo.weight", normal((dim, args.n_heads * head), out_std)
        if args.qk_norm:
            yield f"layers.{i}.attention.q_norm.weight", torch.ones(head)
            yield f"layers.{i}.attention.k_norm.weight", torch.ones(head)
        if args.moe is not None and args.moe.is_moe_layer(i):
            yield from _moe_init(f"layers.{i}.moe.", args, std, out_std, normal)
            continue
        for name in ("w1", "w3"):
            yield f"layers.{i}.feed_forward.{name}.weight", normal((args.hidden_dim, dim), std)
        yield f"layers.{i}.feed_forward.w2.weight", normal((dim, args.hidden_dim), out_std)
    yield "norm.weight", torch.ones(dim)
    if not args.tie_embeddings:
        yield "output.weight", normal((args.vocab_size, dim), std)


def _moe_init(prefix: str, args: ModelArgs, std: float, out_std: float,
              normal: Callable[[tuple[int, ...], float], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """A mixture-of-experts layer's initial values: the router's gate and every expert's w1 and w3
    truncated normal with std init_std, w2 with the depth-scaled std (as the dense MLP's)."""
    moe, dim = args.moe, args.dim
    experts, ffn = moe.num_experts, moe.expert_ffn_dim
    yield prefix + "router.gate.weight", normal((experts, dim), std)
    yield prefix + "experts.w1", normal((experts, ffn, dim), std)
    yield prefix + "experts.w3", normal((experts, ffn, dim), std)
    yield prefix + "experts.w2", normal((experts, dim, ffn), out_std)
    if moe.num_shared_experts:
        shared = moe.num_shared_experts * ffn
        for name in ("w1", "w3"):
            yield prefix + f"shared.{name}.weight", normal((shared, dim), std)
        yield prefix + "shared.w2.weight", normal((dim, shared), out_std)


def truncated_normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
    """N(0, std) truncated at 3 std by redrawing the values outside, whole-tensor draws until none
    is: the numbers `torch.nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std)` gives
    (torch 2.13, bit for bit: the same draws, the same selection), in one spare tensor instead of
    its two and one reused mask, so initialising a parameter takes at most 2.5 times its bytes."""
    value = torch.empty(shape).normal_(0.0, std)
    lo, hi = torch.tensor(-3 * std).item(), torch.tensor(3 * std).item()  # the bounds in fp32, as torch's
    outside = torch.empty(shape, dtype=torch.bool)
    spare = None
    while True:
        torch.gt(value, hi, out=outside).logical_or_(value < lo)
        if not outside.any():
            return value
        spare = torch.empty_like(value) if spare is None else spare
        torch.where(outside, spare.normal_(0.0, std), value, out=value)
