"""What a prepared directory holds: counts per source file, and the document lengths (summary and histogram)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gridtrain.data.shards import SPLITS, TokenStore, load_index

SHOWN_SOURCES = 20
"""Source files listed by name; the rest are summed in one line."""


def document_lengths(prepared_dir: Path) -> np.ndarray:
    """The length in tokens (its eos included) of every document of both splits."""
    lengths = []
    for split in SPLITS:
        store = TokenStore(prepared_dir, split)
        starts = store.doc_starts
        lengths.append(np.diff(np.append(starts, store.num_tokens)))
    return np.concatenate(lengths)


def summary_lines(prepared_dir: Path) -> list[str]:
    """The lines `gridtrain data prepare` ends with and `gridtrain data stats` prints."""
    index = load_index(prepared_dir)
    lines = [f"{prepared_dir}: {index['num_docs']:,} documents, {index['num_tokens']:,} tokens "
             f"({index['dtype']}, tokenizer {index['tokenizer']}, vocabulary {index['vocab_size']:,})"]
    for split in SPLITS:
        info = index["splits"][split]
        lines.append(f"  {split:<5} {info['num_docs']:>12,} documents {info['num_tokens']:>15,} tokens "
                     f"in {len(info['shards'])} shard(s)")
    lines += source_lines(index)
    lengths = document_lengths(prepared_dir)
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    lines.append(f"document length in tokens (eos included): mean {lengths.mean():,.1f}, min {lengths.min():,}, "
                 f"median {p50:,.0f}, p90 {p90:,.0f}, p99 {p99:,.0f}, max {lengths.max():,}")
    return lines + span_lines(prepared_dir)


SPAN_SEQ_LENS = (1024, 2048, 4096, 8192)
"""Sequence lengths at which `data stats` prints the attention span under data.doc_mask."""


def span_lines(prepared_dir: Path) -> list[str]:
    """The attention span under data.doc_mask (data/doc_span.py) of the training split at a few
    sequence lengths: what `gridtrain plan --doc-len DIR` counts."""
    from gridtrain.data.doc_span import store_span

    store = TokenStore(prepared_dir, "train")
    found = {t: store_span(store, t) for t in SPAN_SEQ_LENS if store.num_tokens > t}
    spans = [f"{t:,}: {span:,.1f} ({span / t:.3f} of causal)" for t, span in found.items()]
    if not spans:
        return []
    return [f"with data.doc_mask, keys per query (sum L_i^2 / T over each sequence's documents) at seq "
            f"{'; '.join(spans)}: `gridtrain plan --doc-len {prepared_dir}` plans with them"]


def source_lines(index: dict[str, Any]) -> list[str]:
    sources = index.get("sources") or {}
    if not sources:
        return [f"source {index['source']} (a prepare older than per-source counts)"]
    lines = [f"source {index['source']}: {len(sources):,} file(s), {index.get('empty_docs', 0):,} empty "
             "document(s) skipped"]
    width = min(60, max(len(name) for name in sources))
    ranked = sorted(sources.items(), key=lambda item: -item[1]["tokens"])
    for name, counts in ranked[:SHOWN_SOURCES]:
        lines.append(f"  {name:<{width}} {counts['documents']:>12,} documents {counts['tokens']:>15,} tokens "
                     f"{counts['empty']:>8,} empty")
    rest = ranked[SHOWN_SOURCES:]
    if rest:
        docs, tokens, empty = (sum(c[k] for _, c in rest) for k in ("documents", "tokens", "empty"))
        lines.append(f"  {f'{len(rest):,} more files':<{width}} {docs:>12,} documents {tokens:>15,} tokens "
                     f"{empty:>8,} empty")
    return lines


def histogram_png(prepared_dir: Path, out: Path) -> Path:
    """A PNG histogram of the document lengths (log-spaced bins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = document_lengths(prepared_dir)
    bins = np.unique(np.geomspace(1, max(2, int(lengths.max())) + 1, 50).astype(np.int64))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=bins)
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens, eos included)")
    ax.set_ylabel("documents")
    ax.set_title(f"{prepared_dir.name}: {len(lengths):,} documents, median {np.median(lengths):,.0f} tokens")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
