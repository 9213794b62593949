"""Document masking: attention that never crosses a document inside a packed sequence.

Packed sequences hold several documents, each ended by the end-of-document token (Llama 3 masks
attention inside each document for long sequences, Dubey et al. 2024, section 3.4.2). A
`Documents` holds, for each sequence of a micro-batch, its documents as spans of positions, read
from the tokens (`document_ids`), so every layout sees the same ones.

The attention is document-causal: a query sees the earlier keys of its own document. It is computed
with the blocks of gridtrain.model.blockwise (`document_blocks`): one block per (query chunk, key
chunk, document) that meets both, full when the key chunk is earlier, causal on the diagonal, and no
block at all where the mask hides everything, so hidden pairs are skipped, never computed and
discarded. Sequences of a batch with the same documents share their blocks. On an NVIDIA GPU, for
what FlashAttention takes (16-bit, heads up to 256 wide, Ampere or newer) and where torch has its
variable-length FlashAttention (`torch.nn.attention.varlen.varlen_attn`), one call over all
documents of the batch does the same.

RoPE positions may restart at each document (`Documents.positions`, data.doc_positions = 'restart').
"""

from __future__ import annotations

import torch

from gridtrain.model.blockwise import Block, BlockAttention, _cuda_kernel, _nvidia

Span = tuple[int, int]


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) int64: each token's document within its sequence, counted from 0. The end-of-document
    token belongs to the document it ends; the token after it starts the next one."""
    ends = (inputs == eos_id).long()
    return ends.cumsum(1) - ends


def spans_of(ids: list[int]) -> list[Span]:
    """[start, end) of each run of equal ids: [0, 0, 1, 1, 1] -> [(0, 2), (2, 5)]."""
    spans, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or ids[t] != ids[t - 1]:
            spans.append((start, t))
            start = t
    return spans


class Documents:
    """The documents of each sequence of a micro-batch: `ids` (B, T) as document_ids gives them, and
    whether RoPE positions restart at each document (`restart`)."""

    def __init__(self, ids: torch.Tensor, restart: bool = False) -> None:
        self.ids = ids
        self.restart = restart
        self.spans: list[list[Span]] = [spans_of(row) for row in ids.tolist()]
        self._blocks: dict[tuple[tuple[int, ...], tuple[int, ...], int], list[Block]] = {}

    def blocks(self, q_chunks: list[int], k_chunks: list[int], size: int) -> list[Block]:
        """document_blocks of these documents, computed once per micro-batch (every layer reads them)."""
        key = (tuple(q_chunks), tuple(k_chunks), size)
        if key not in self._blocks:
            self._blocks[key] = document_blocks(self.spans, q_chunks, k_chunks, size)
        return self._blocks[key]

    def positions(self) -> torch.Tensor:
        """(B, T) int64: each token's position inside its document."""
        t = torch.arange(self.ids.shape[1], device=self.ids.device).expand_as(self.ids)
        starts = torch.ones_like(self.ids, dtype=torch.bool)
        starts[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]
        first = torch.where(starts, t, torch.zeros_like(t)).cummax(1).values
        return t - first


def document_blocks(spans: list[list[Span]], q_chunks: list[int], k_chunks: list[int], size: int) -> list[Block]:
    """The blocks of document-causal attention between local query chunks and key chunks (each a
    list of the chunks' positions in the whole sequence, every chunk `size` rows, as causal_blocks
    takes them), for sequences whose documents are `spans` (positions in the whole sequence). A
    query chunk meets an earlier key chunk in a full block per document the two share, its own
    chunk in a causal block per document, and later chunks not at all. Consecutive sequences with
    the same documents share their blocks (one block over their rows of the batch)."""
    blocks, b = [], 0
    while b < len(spans):
        end = b + 1
        while end < len(spans) and spans[end] == spans[b]:
            end += 1
        batch = slice(b, end) if (b, end) != (0, len(spans)) else slice(None)
        for i, qa in enumerate(q_chunks):
            for j, kb in enumerate(k_chunks):
                if kb <= qa:
                    blocks += _pair_blocks(spans[b], qa, i, kb, j, size, batch)
        b = end
    return blocks


def _pair_blocks(spans: list[Span], qa: int, i: int, kb: int, j: int, size: int, batch: slice) -> list[Block]:
    """One block per document that meets both query chunk qa (local chunk i) and key chunk kb (j)."""
    q0, k0, blocks = qa * size, kb * size, []
    for start, end in spans:
        qs, qe = max(start, q0), min(end, q0 + size)
        ks, ke = max(start, k0), min(end, k0 + size)
        if qs < qe and ks < ke:
            rows = slice(qs - q0 + i * size, qe - q0 + i * size)
            blocks.append(Block(rows, slice(ks - k0 + j * size, ke - k0 + j * size), kb == qa, batch))
    return blocks


def _varlen() -> object | None:
    """torch's variable-length FlashAttention, where this torch has it (CUDA only)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents,
                      varlen: object) -> torch.Tensor:
    """All documents of the batch as one variable-length causal attention (packed rows)."""
    B, H, T, D = q.shape
    lengths = [e - s for row in docs.spans for s, e in row]
    cu = torch.tensor([0, *lengths], device=q.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    pack = lambda t: t.transpose(1, 2).reshape(B * T, t.shape[1], D)  # noqa: E731
    out = varlen(pack(q), pack(k), pack(v), cu, cu, max(lengths), max(lengths), window_size=(-1, 0),
                 enable_gqa=k.shape[1] != H, scale=D ** -0.5)
    return out.view(B, T, H, D).transpose(1, 2)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents) -> torch.Tensor:
    """Document-causal attention of (B, heads, T, head_dim) queries and keys, values at the KV heads
    (as SDPA with enable_gqa), inside the documents `docs`."""
    # FlashAttention's shapes and GPUs only (what blockwise's per-block kernel choice also checks);
    # elsewhere the blocks below, each on the device's own kernel
    varlen = _varlen() if _nvidia(q) and _cuda_kernel(q) == "flash" else None
    if varlen is not None:
        return _varlen_attention(q, k, v, docs, varlen)
    T = q.shape[2]
    return BlockAttention.apply(q, k, v, docs.blocks([0], [0], T), q.shape[-1] ** -0.5)
