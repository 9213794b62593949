"""Context parallelism: each sequence split over the `cp` ranks of a group, attention by a ring.

The split (the load balance of Megatron-LM's and PyTorch's context parallelism): a sequence is cut
into 2 x cp chunks and CP rank r holds chunks r and 2cp-1-r, so under a causal mask every rank does
the same work. RoPE positions are the chunks' own (`chunk_positions`).

The attention (`ring_attention`): each rank attends its queries to every rank's keys and values in
turn with the block kernels of gridtrain.model.blockwise, merging partial outputs by log-sum-exp in
fp32 and skipping the blocks the causal mask hides (a query chunk sees earlier key chunks whole, its
own causally). Keys and values move at the KV-head count (grouped-query attention is expanded only
inside a block). Backward is our own: dQ accumulates where the queries are; dK and dV accumulate in
fp32 on the way and reach their owner. Two ways to move keys and values (`parallel.cp_rotate`):

- "ring": after each block, keys and values go to the next rank and come from the previous one
  (isend/irecv pairs, posted before the block is computed so the transfer overlaps it); in backward
  the keys and values travel again with their gradient accumulator, which takes one more hop home.
  gloo's batch_isend_irecv is reported to hang, so each transfer is a plain isend and irecv pair.
  Point-to-point sends are not in gloo's flight recorder: `RingTraffic` counts their bytes.
- "allgather": one all-gather of every rank's keys and values before the blocks (as Llama 3 did,
  Dubey et al. 2024, section 3.3.2), and one all_to_all_single of the gradient accumulators after
  them, which each owner sums (gloo has no reduce-scatter).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

from gridtrain.model.blockwise import Block, Merged, attend_blocks, causal_blocks, grad_blocks
from gridtrain.model.documents import Documents
from gridtrain.model.llama import Attention, Transformer
from gridtrain.model.moe import MoE

ROTATIONS = ("ring", "allgather")


def chunk_ids(rank: int, cp: int) -> list[int]:
    """The two chunks (of 2 x cp) of each sequence that CP rank `rank` holds."""
    return [rank, 2 * cp - 1 - rank]


def split_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the sequence), side by side."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp)], dim=dim)


def unsplit_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's split_sequence (in rank order)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def split_reader(read: Callable[[int, int], tuple[torch.Tensor, ...]], rank: int,
                 cp: int) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    """`read(first, n)` (inputs and targets of n sequences) cut to this CP rank's chunks: every CP
    rank of a batch slice reads the same sequences and keeps its part of each. Document ids (data.doc_mask)
    stay whole: the ring's blocks need every chunk's documents."""
    def read_split(first: int, n: int) -> tuple[torch.Tensor, ...]:
        inputs, targets, *docs = read(first, n)
        return (*split_batch(inputs, targets, rank, cp), *docs)

    return read_split


def split_batch(inputs: torch.Tensor, targets: torch.Tensor, rank: int,
                cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This CP rank's chunks of a batch's inputs and targets."""
    return split_sequence(inputs, rank, cp), split_sequence(targets, rank, cp)


def chunk_positions(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    """The positions in the whole sequence of this rank's local tokens (for RoPE)."""
    return split_sequence(torch.arange(seq_len), rank, cp, dim=0)


def _blocks(rank: int, owner: int, cp: int, size: int, causal: bool, docs: Documents | None) -> list[Block]:
    """The blocks of this rank's queries against `owner`'s keys (`size` rows a chunk), inside the
    documents `docs` (whole sequences' documents: document_blocks) where given."""
    if docs is not None:
        return docs.blocks(chunk_ids(rank, cp), chunk_ids(owner, cp), size)
    if not causal:
        return [Block(slice(0, 2 * size), slice(0, 2 * size), False)]
    return causal_blocks(chunk_ids(rank, cp), chunk_ids(owner, cp), size)


class RingTraffic:
    """Bytes this rank's ring sends (every isend of `_exchange`), for the step accounting: what the
    flight recorder sees of the collectives, this counts of the ring (and of nothing else)."""

    def __init__(self) -> None:
        self.send_bytes = 0
        self.sends = 0


def _exchange(send: torch.Tensor, group: dist.ProcessGroup,
              traffic: RingTraffic | None) -> tuple[torch.Tensor, list[dist.Work]]:
    """Post the ring's transfer: `send` to the next rank, a tensor like it from the previous one."""
    cp, rank = group.size(), group.rank()
    if traffic is not None:
        traffic.send_bytes += send.numel() * send.element_size()
        traffic.sends += 1
    recv = torch.empty_like(send)
    works = [dist.isend(send, dist.get_global_rank(group, (rank + 1) % cp), group=group),
             dist.irecv(recv, dist.get_global_rank(group, (rank - 1) % cp), group=group)]
    return recv, works


def _gather(kv: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's stacked keys and values, in rank order (one all-gather)."""
    every = [torch.empty_like(kv) for _ in range(group.size())]
    dist.all_gather(every, kv, group=group)
    return every


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries (its two chunks) over the whole sequence's keys and values,
    which the CP group's ranks hold in the same split."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,  # noqa: ANN001
                rotate: str, causal: bool, scale: float, traffic: RingTraffic | None,
                docs: Documents | None = None) -> torch.Tensor:
        cp, rank, size = group.size(), group.rank(), q.shape[2] // 2
        merged = Merged(q)
        kv = torch.stack([k, v]).contiguous()
        if rotate == "allgather":
            for owner, (k_all, v_all) in enumerate(_gather(kv, group)):
                attend_blocks(merged, q, k_all, v_all, _blocks(rank, owner, cp, size, causal, docs), scale)
        else:
            for step in range(cp):
                owner = (rank - step) % cp
                pending = _exchange(kv, group, traffic) if step < cp - 1 else None
                attend_blocks(merged, q, kv[0], kv[1], _blocks(rank, owner, cp, size, causal, docs), scale)
                if pending:
                    _wait(pending[1])
                    kv = pending[0]
        out = merged.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, merged.lse)
        ctx.group, ctx.rotate, ctx.causal, ctx.scale, ctx.traffic = group, rotate, causal, scale, traffic
        ctx.docs = docs
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, docs = ctx.group, ctx.causal, ctx.scale, ctx.docs
        cp, rank, size = group.size(), group.rank(), q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        if ctx.rotate == "allgather":
            grads = []
            for owner, (k_all, v_all) in enumerate(_gather(kv, group)):
                blocks = _blocks(rank, owner, cp, size, causal, docs)
                grads.append(torch.stack(grad_blocks(dq, dout, q, k_all, v_all, out, lse, blocks, scale)))
            received = torch.empty((cp, *grads[0].shape), dtype=torch.float32, device=q.device)
            dist.all_to_all_single(received, torch.stack(grads), group=group)
            dkv = received.sum(0)
        else:
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for step in range(cp):
                owner = (rank - step) % cp
                pending = _exchange(kv, group, ctx.traffic) if step < cp - 1 else None  # overlaps the blocks
                dkv += torch.stack(grad_blocks(dq, dout, q, kv[0], kv[1], out, lse,
                                               _blocks(rank, owner, cp, size, causal, docs), scale))
                # The gradient so far follows its keys and values; after the last block it takes
                # one more hop, home to its owner.
                sent = dkv
                dkv, works = _exchange(sent, group, ctx.traffic)
                _wait(works + (pending[1] if pending else []))
                if pending:
                    kv = pending[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   rotate: str = "ring", causal: bool = True, traffic: RingTraffic | None = None,
                   docs: Documents | None = None) -> torch.Tensor:
    """Context-parallel attention over `group` (see the module docstring). q: (batch, heads,
    2 x chunk, head_dim), this rank's chunks as split_sequence cuts them; k, v the same at the
    KV-head count. Returns this rank's output rows, as SDPA (enable_gqa) would give them, or kept
    inside the documents `docs` of the whole sequences (data.doc_mask)."""
    if rotate not in ROTATIONS:
        raise ValueError(f"cp_rotate {rotate!r} is not one of {ROTATIONS}")
    return RingAttention.apply(q, k, v, group, rotate, causal, q.shape[-1] ** -0.5, traffic, docs)


def apply_context_parallel(parts: list[nn.Module], group: dist.ProcessGroup, seq_len: int, rotate: str,
                           device: torch.device) -> RingTraffic:
    """Make the model parts attend by ring attention over `group` and rotate by the positions of
    this rank's chunks of `seq_len`-token sequences (the trainer gives each rank those chunks,
    split_sequence). Returns the counter of the ring's sends."""
    positions = chunk_positions(seq_len, group.rank(), group.size()).to(device)
    traffic = RingTraffic()
    for part in parts:
        for module in part.modules():
            if isinstance(module, Attention):
                module.core = partial(ring_attention, group=group, rotate=rotate, traffic=traffic)
            if isinstance(module, Transformer):
                module.rotate_at(positions)
            if isinstance(module, MoE):  # its auxiliary loss reads the whole micro-batch's routing
                module.reduce_stats = partial(sum_over, group=group)
    return traffic


def sum_over(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of `t` over `group`, in autograd: its gradient is the sum of the ranks' gradients
    (each rank attaches the same whole-micro-batch loss at 1 / cp of the micro-batch's share)."""
    return dist_nn.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
