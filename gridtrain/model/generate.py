"""Autoregressive decoding with a key/value cache, on the training model's own weights.

`forward_cached` runs the blocks of a `Transformer` for new positions only, keeping each layer's
keys and values (at the KV-head count, after RoPE) in a `KVCache`: a token then costs one
position's work instead of a forward over the whole sequence. It uses the same modules, in the
same order and precision, as `Transformer.forward`, which stays as it is for training (and is
the cache-less path `generate(..., use_cache=False)` takes).

Sampling follows the usual recipe: temperature 0 is greedy (argmax, deterministic); otherwise the
logits are divided by the temperature, cut to the `top_k` largest and then to the smallest set
whose probability reaches `top_p` (nucleus sampling, Holtzman et al. 2020, "The Curious Case of
Neural Text Degeneration"), and a token is drawn with the caller's generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from gridtrain.model.llama import Attention, Transformer, apply_rope


class KVCache:
    """Keys and values of every layer for up to `max_len` positions of `batch` sequences."""

    def __init__(self, model: Transformer, batch: int, max_len: int) -> None:
        a = model.args
        ref = model.output.weight
        shape = (len(model.layers), batch, a.n_kv_heads, max_len, a.head_dim)
        self.k = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
        self.v = torch.zeros_like(self.k)
        self.length = 0
        """Positions filled so far."""

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def _attend(attn: Attention, x: torch.Tensor, freqs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            start: int) -> torch.Tensor:
    """Attention of the new positions start..start+T-1 over every cached one before them."""
    B, T, _ = x.shape
    q = attn.wq(x).view(B, T, -1, attn.head_dim)
    k = attn.wk(x).view(B, T, -1, attn.head_dim)
    v = attn.wv(x).view(B, T, -1, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    angles = freqs[start:start + T]
    q, k = apply_rope(q, angles), apply_rope(k, angles)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k_cache[:, :, start:start + T] = k
    v_cache[:, :, start:start + T] = v
    keys, values = k_cache[:, :, :start + T], v_cache[:, :, :start + T]
    if start == 0:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    else:  # query i (position start + i) sees keys 0..start + i
        mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return attn.wo(out.transpose(1, 2).reshape(B, T, -1))


def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, T, vocab) of `tokens` (B, T), the positions after those already in `cache`."""
    start, T = cache.length, tokens.shape[1]
    if start + T > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions; {start} + {T} do not fit")
    h = model.tok_embeddings(tokens).float()
    for i, block in enumerate(model.layers.values()):
        h = h + _attend(block.attention, block.attention_norm(h), model.freqs_cis, cache.k[i], cache.v[i], start)
        h = h + block.feed(block.ffn_norm(h))
    cache.length = start + T
    return model.output(model.norm(h))


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    """0: greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p (1: all)."""


GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (dividing by them would overflow the logits)."""


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
               vocab: int | None = None) -> torch.Tensor:
    """The next token of each row of `logits` (B, vocab) -> (B,), among the first `vocab` ids (the
    tokenizer's: the model's vocabulary may be padded beyond it)."""
    if vocab is not None and vocab < logits.shape[-1]:
        logits = logits[..., :vocab]
    if sampling.temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, index = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the ones before it already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        logits = logits.scatter(-1, index, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling = Sampling(),
             generator: torch.Generator | None = None, use_cache: bool = True,
             stop_id: int | None = None, vocab: int | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token of each sequence of `prompt` (B, T), one position at a time, up to
    `max_new_tokens` or until every sequence produced `stop_id`, drawn among the first `vocab` ids. Positions past the model's
    context are refused: the caller cuts the prompt."""
    total = prompt.shape[1] + max_new_tokens
    if total > model.args.max_seq_len:
        raise ValueError(f"{prompt.shape[1]} prompt + {max_new_tokens} new tokens exceed the model's "
                         f"context of {model.args.max_seq_len}")
    cache = KVCache(model, prompt.shape[0], total) if use_cache else None
    tokens, new = prompt, prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        logits = forward_cached(model, new, cache) if cache is not None else model(tokens)
        token = next_token(logits[:, -1], sampling, generator, vocab)
        yield token
        if stop_id is not None:
            done |= token == stop_id
            if bool(done.all()):
                return
        new = token[:, None]
        tokens = torch.cat([tokens, new], dim=1)
