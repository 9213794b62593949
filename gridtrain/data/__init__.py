"""Data: corpus -> tokenizer -> prepared binary shards -> deterministic batches.

The names below load their module on first use, so that a tokenizing worker process (which
imports gridtrain.data.prepare) does not import torch with the sampler.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "default_corpus": "corpus", "iter_documents": "corpus", "BatchReader": "sampler", "SampleOrder": "sampler",
    "ValReader": "sampler", "TokenStore": "shards", "ensure_prepared": "shards", "prepare": "shards",
    "BPETokenizer": "tokenizer", "ByteTokenizer": "tokenizer", "Tokenizer": "tokenizer", "build_tokenizer": "tokenizer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'gridtrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gridtrain.data.{_WHERE[name]}"), name)
