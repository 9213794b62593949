"""Attention computed block by block and merged by log-sum-exp: causal attention that skips the
blocks its mask hides, in one process, and the arithmetic ring attention is made of
(gridtrain.parallel.context_parallel).

A block is one call of the device's fused attention kernel on some rows of the queries and some
rows of the keys, full or causal; the kernel also returns each query's log-sum-exp of scores
(on CPU `aten._scaled_dot_product_flash_attention_for_cpu`; on CUDA FlashAttention-2's kernel,
`aten._scaled_dot_product_flash_attention`, for 16-bit blocks of heads up to 256 wide, else the
memory-efficient kernel, `aten._scaled_dot_product_efficient_attention`; elsewhere the same
arithmetic written out). No block writes its score matrix out, so ring attention's memory is the
planner's on every device that has a kernel. Outputs of the same queries over disjoint key blocks
merge exactly, in fp32 (the online softmax of Milakov & Gimelshein 2018, as FlashAttention, Dao et
al. 2022, and Ring Attention, Liu et al. 2023, use it):

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i

Backward runs each block's kernel backward with the merged output and log-sum-exp: the kernel's
probabilities exp(s - lse) are then the merged softmax's, and its D = rowsum(dO * O) the merged
output's, so each block's dQ, dK and dV are exactly its share of the whole attention's gradient.

Layout: (batch, heads, sequence, head_dim), as torch's SDPA. Grouped-query attention is expanded to
the query heads block by block (and its key and value gradients summed back over each group).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Block:
    """Queries `q` (rows of the local queries) against keys `k` (rows of the keys), causal or not,
    in the sequences `batch` of the batch (all of them unless a document mask makes the rows
    differ). A causal block's queries and keys are the same positions (torch's top-left mask)."""
    q: slice
    k: slice
    causal: bool
    batch: slice = field(default_factory=lambda: slice(None))


def expand_kv(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """KV heads repeated to the query heads: query head h reads KV head h // (n_heads / kv_heads)."""
    groups = n_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def reduce_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The inverse of expand_kv for gradients: each KV head's gradient summed over its group."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """fp32 attention scores, -inf above the diagonal when causal."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(q, k, causal, scale)
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp() @ v.float()).to(q.dtype), lse


def _math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    p = (_scores(q, k, causal, scale) - lse[..., None]).exp()
    do = dout.float()
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.float().transpose(-2, -1)
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq, dk = (ds @ k.float()) * scale, (ds.transpose(-2, -1) @ q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@functools.lru_cache(maxsize=16)
def _ampere_or_newer(device: torch.device) -> bool:
    return torch.get_device_module(device.type).get_device_capability(device) >= (8, 0)


def _cuda_kernel(q: torch.Tensor) -> str:
    """Which of CUDA's fused kernels takes a block: 'flash' (16-bit, heads a multiple of 8 up to
    256 wide, Ampere or newer: what FlashAttention-2's kernel accepts unpadded) or 'efficient'."""
    flash_shape = q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
    return "flash" if flash_shape and _ampere_or_newer(q.device) else "efficient"


def _nvidia(q: torch.Tensor) -> bool:
    """An NVIDIA GPU (ROCm's devices are 'cuda' too, but their kernels read the log-sum-exp
    otherwise: they take the written-out path)."""
    return q.device.type == "cuda" and torch.version.hip is None


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in q's dtype, fp32 log-sum-exp per query) of one block; k and v have q's heads."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if _nvidia(q) and _cuda_kernel(q) == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    if _nvidia(q):  # its log-sum-exp may be padded past the queries (to 32 rows)
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., : q.shape[-2]]
    return _math_forward(q, k, v, causal, scale)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of one block, given the merged `out` and `lse` of its queries."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if _nvidia(q):
        dout, out = dout.contiguous().to(q.dtype), out.to(q.dtype)
        seed = offset = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: never read
        if _cuda_kernel(q) == "flash":
            s_q, s_k = q.shape[-2], k.shape[-2]
            return aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse.contiguous(), None, None, s_q, s_k, 0.0, causal, seed, offset, scale=scale)
        pad = -q.shape[-2] % 32  # the kernel reads its log-sum-exp padded to 32 rows, as it wrote it
        padded = torch.nn.functional.pad(lse, (0, pad)).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return _math_backward(dout, q, k, v, out, lse, causal, scale)


class Merged:
    """Running fp32 output and log-sum-exp of queries whose key blocks arrive one at a time."""

    def __init__(self, q: torch.Tensor) -> None:
        b, h, s, d = q.shape
        # Laid out (b, s, h, d) as torch's flash kernels return theirs: the caller's transpose
        # back to (b, s, h x d) is then a view, not a copy that the output projection would save.
        self.out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
        self.lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor, batch: slice = slice(None)) -> None:
        old = self.lse[batch, :, rows]
        new = torch.logaddexp(old, lse)
        # exp(-inf - new) is 0 for rows no block has reached yet
        self.out[batch, :, rows] = (self.out[batch, :, rows] * (old - new).exp()[..., None]
                                    + out.float() * (lse - new).exp()[..., None])
        self.lse[batch, :, rows] = new


def attend_blocks(merged: Merged, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[Block],
                  scale: float) -> None:
    """Add the blocks of queries `q` against `k`, `v` (KV heads, expanded here) to `merged`."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    for blk in blocks:
        b = blk.batch
        out, lse = block_forward(q[b, :, blk.q], k[b, :, blk.k], v[b, :, blk.k], blk.causal, scale)
        merged.add(blk.q, out, lse, b)


def grad_blocks(dq: torch.Tensor, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, blocks: list[Block],
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate the blocks' query gradient into `dq` (fp32); return their (dk, dv) in fp32, at
    the KV heads."""
    kv_heads = k.shape[1]
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for blk in blocks:
        b = blk.batch
        g = block_backward(dout[b, :, blk.q], q[b, :, blk.q], k[b, :, blk.k], v[b, :, blk.k],
                           out[b, :, blk.q], lse[b, :, blk.q], blk.causal, scale)
        dq[b, :, blk.q] += g[0].float()
        dk[b, :, blk.k] += g[1].float()
        dv[b, :, blk.k] += g[2].float()
    return reduce_kv(dk, kv_heads), reduce_kv(dv, kv_heads)


def causal_blocks(q_chunks: list[int], k_chunks: list[int], size: int) -> list[Block]:
    """The blocks of causal attention between local query chunks and key chunks (each a list of
    the chunks' positions in the whole sequence, every chunk `size` rows): a query chunk sees the
    earlier key chunks whole, its own causally, and the later ones not at all. Adjacent whole key
    chunks of one query chunk make one block."""
    blocks = []
    for i, qa in enumerate(q_chunks):
        rows = slice(i * size, (i + 1) * size)
        earlier = [j for j, kb in enumerate(k_chunks) if kb < qa]
        for run in _runs(earlier):
            blocks.append(Block(rows, slice(run[0] * size, (run[-1] + 1) * size), False))
        blocks += [Block(rows, slice(j * size, (j + 1) * size), True) for j, kb in enumerate(k_chunks) if kb == qa]
    return blocks


def _runs(positions: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted positions: [0, 1, 3] -> [[0, 1], [3]]."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


class BlockAttention(torch.autograd.Function):
    """Attention of one process over a list of blocks, the rest of the score matrix hidden (causal
    blocks: (chunks + 1) / (2 chunks) of the full attention's kernel work; document blocks:
    gridtrain.model.documents)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[Block],  # noqa: ANN001
                scale: float) -> torch.Tensor:
        merged = Merged(q)
        attend_blocks(merged, q, k, v, blocks, scale)
        out = merged.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, merged.lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = grad_blocks(dq, dout.contiguous(), q, k, v, out, lse, ctx.blocks, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def blockwise_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: int) -> torch.Tensor:
    """Causal attention (as SDPA with is_causal=True and enable_gqa=True) in `chunks` query and key
    chunks; the sequence length must be a multiple of `chunks`."""
    if q.shape[2] % chunks:
        raise ValueError(f"sequence length {q.shape[2]} is not a multiple of {chunks} chunks")
    blocks = causal_blocks(list(range(chunks)), list(range(chunks)), q.shape[2] // chunks)
    return BlockAttention.apply(q, k, v, blocks, q.shape[-1] ** -0.5)
