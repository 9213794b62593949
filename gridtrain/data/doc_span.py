"""The attention span of a prepared corpus under document masking: the keys a query attends to,
sum L_i^2 / T over the documents of each training sequence (plan/documents.py), measured the way
training cuts the token stream (sampler.py: sample i is tokens [i T, (i + 1) T) of the stream,
its documents split where one starts, the token after an end-of-document).

The mean over every sample of an epoch is the expectation of a step's attention FLOPs: the
sampler visits each window once per epoch, and a mixture draws its sources by their quotas, the
weights rounded to samples per block (mix_spec.quotas; every sample is T tokens, so the quotas
average the spans). No torch here: the
planner reads it for `gridtrain plan --doc-len DIR` and `plan --check` of a doc_mask run."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gridtrain.config import Config
from gridtrain.data.corpus import default_corpus
from gridtrain.data.mix_spec import parse_mix, quotas
from gridtrain.data.shards import INDEX_FILE, TokenStore, _cache_name
from gridtrain.errors import MissingInput


def window_span(doc_starts: np.ndarray, num_tokens: int, seq_len: int) -> float:
    """The mean span of the (num_tokens - 1) // seq_len windows of a stream whose documents start
    at `doc_starts`: each window cut at the documents starting inside it, sum of squared pieces
    over all windows, divided by their tokens."""
    windows = (num_tokens - 1) // seq_len
    if windows < 1:
        raise ValueError(f"{num_tokens} tokens hold no sample of seq_len {seq_len}")
    end = windows * seq_len
    inside = doc_starts[(doc_starts > 0) & (doc_starts < end)]
    cuts = np.union1d(inside, np.arange(0, end, seq_len, dtype=np.int64))
    pieces = np.diff(np.append(cuts, end)).astype(np.float64)
    return float((pieces * pieces).sum() / end)


def store_span(store: TokenStore, seq_len: int) -> float:
    """window_span of a split of a prepared directory."""
    return window_span(store.doc_starts, store.num_tokens, seq_len)


def prepared_span(prepared_dir: Path, seq_len: int) -> float:
    """The training split's span at `seq_len`."""
    return store_span(TokenStore(prepared_dir, "train"), seq_len)


def mixture_span(spans: list[float], weights: list[float]) -> float:
    """Sources drawn in proportion to `weights`, T tokens a sample: the weighted mean of their spans."""
    return sum(s * w for s, w in zip(spans, weights)) / sum(weights)


def run_sources(cfg: Config) -> list[tuple[str, Path, float]]:
    """(source, prepared directory, weight) of a run's data.corpus or data.mix sources, where
    training prepared them (shards.ensure_prepared's place), without preparing anything; the
    directory may not exist."""
    d = cfg.data
    cache = Path(d.cache_dir).expanduser()
    named = [(d.corpus, 1.0)] if d.mix is None else [(s.path, s.weight) for s in parse_mix(d.mix)]
    out = []
    for source, weight in named:
        src = Path(source).resolve() if source is not None else default_corpus()
        if not (src / INDEX_FILE).is_file():
            src_dir = cache / _cache_name(src, d.tokenizer, d.val_fraction, cfg.train.seed, d.text_column)
            out.append((str(source or src), src_dir, weight))
        else:
            out.append((str(source), src, weight))
    return out


def run_attention_span(cfg: Config) -> float | None:
    """The span a run's steps attend over (None without data.doc_mask), from its prepared data;
    MissingInput where that data is not on this machine."""
    if not cfg.data.doc_mask:
        return None
    spans, weights = [], []
    for source, prepared, weight in run_sources(cfg):
        if not (prepared / INDEX_FILE).is_file():
            raise MissingInput(f"data.doc_mask: the prepared tokens of {source} are not at {prepared}, so the "
                               "documents' lengths (which set attention's FLOPs) are unknown: run the check where "
                               "the run prepared its data, or prepare it with `gridtrain data prepare`")
        spans.append(prepared_span(prepared, cfg.data.seq_len))
        weights.append(weight)
    return mixture_span(spans, [float(q) for q in quotas(weights)])  # as MixtureReader draws them
