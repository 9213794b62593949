"""Attention under document masking (data.doc_mask): how many keys a query attends to.

gridtrain counts attention in full, the square of what is attended with no causal halving
(flops.py, PaLM's appendix B): a sequence of T tokens costs 12 L H Q T per token, T keys per
query. With document masking a query attends only inside its own document, so a packed sequence
of documents L_1 + ... + L_n = T computes the squares L_i^2, not T^2. Per token that is the
*attention span*

    span = (L_1^2 + ... + L_n^2) / T        (T when nothing is masked)

and the attention core costs 12 L H Q x span per token. Four documents of 2,048 in 8,192:
span = 4 x 2,048^2 / 8,192 = 2,048, a quarter of the causal 8,192. Causal-halving conventions
(Megatron-LM, torchtitan) halve both sides alike, so the ratio span / T is theirs too.

Convention: MFU counts the masked FLOPs. The scores between documents are not the model's work:
its outputs do not depend on them, gridtrain's blockwise attention (CPU) and a varlen flash kernel
(CUDA) skip them, and a kernel that computed and discarded them would be doing what MFU does not
credit (as with padding). Counting the whole sequence would overstate attention T / span times
(4x above). HFU counts the same span (the kernels' partial blocks at document edges are not
counted, as flash attention's own recomputation is not)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def span_of_documents(lengths: Sequence[int]) -> float:
    """The attention span of one packed sequence of documents of these lengths: sum L_i^2 / sum L_i."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"document lengths must be positive, not {list(lengths)}")
    return sum(n * n for n in lengths) / sum(lengths)


def equal_documents_span(seq_len: int, doc_len: int) -> float:
    """The span of a sequence of `seq_len` tokens packed with documents of `doc_len` tokens each,
    the first starting with the sequence and the last cut where the sequence ends:
    k = seq_len // doc_len whole documents and one of r = seq_len % doc_len tokens,
    span = (k doc_len^2 + r^2) / seq_len (seq_len itself when doc_len >= seq_len).

    An upper bound for gridtrain's sampler, which cuts windows wherever they fall in the token
    stream: a random cut splits one more document, which lowers the expected span by
    doc_len^2 / (3 seq_len) (8% at 2,048 in 8,192). Documents of unequal lengths raise it:
    a token sits in a long document more often (the span tends to E[L^2] / E[L], not E[L]).
    A prepared folder gives the exact figure (gridtrain.data.doc_span)."""
    if seq_len < 1 or doc_len < 1:
        raise ValueError(f"seq_len ({seq_len}) and doc_len ({doc_len}) must be positive")
    whole, rest = divmod(seq_len, doc_len)
    return (whole * doc_len * doc_len + rest * rest) / seq_len


def doc_len_for_span(seq_len: int, span: float) -> int:
    """The shortest document length whose equal_documents_span reaches `span`: what a measured span
    is as one `--doc-len` (the explorer's input). equal_documents_span(T, L) lies in
    [L - L^2 / (4 T), L], so the search starts at `span` and stops within span^2 / (4 T) + 1."""
    length = max(1, math.floor(span))
    while length < seq_len and equal_documents_span(seq_len, length) < span:
        length += 1
    return min(length, seq_len)


def attended(seq_len: int, span: float | None) -> float:
    """Keys per query in the FLOPs: the span under document masking, else the whole sequence."""
    return float(seq_len) if span is None else span


def span_note(seq_len: int, span: float, source: str) -> str:
    """One line for a plan: what the documents do to attention's FLOPs."""
    return (f"data.doc_mask: attention stays inside documents ({source}): span = sum L_i^2 / T = {span:,.1f} keys "
            f"per query of {seq_len:,}, so attention's FLOPs are {span / seq_len:.3f} x the causal sequence's; "
            "MFU and the step time count these (plan/documents.py)")
