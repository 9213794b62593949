"""Data: corpus -> tokenizer -> prepared binary shards -> deterministic batches."""

from gridtrain.data.corpus import default_corpus, iter_documents
from gridtrain.data.sampler import BatchReader, SampleOrder, ValReader
from gridtrain.data.shards import TokenStore, ensure_prepared, prepare
from gridtrain.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "BPETokenizer", "BatchReader", "ByteTokenizer", "SampleOrder", "TokenStore", "Tokenizer",
    "ValReader", "build_tokenizer", "default_corpus", "ensure_prepared", "iter_documents",
    "prepare",
]
