"""Weighted mixtures of prepared sources (`data.mix`), addressed by global sample index.

Global samples come in blocks of MIX_BLOCK. Every block holds the same number of samples of each
source, its quota: the weights' share of the block by largest remainder (within 1/MIX_BLOCK of each
weight). Inside block b the sources' places are a permutation drawn from (seed, b). Global sample g
is therefore sample k of source s with s and k functions of (seed, weights, g) alone:

    b, p = divmod(g, MIX_BLOCK);  s = labels_b[p];  k = b * quota_s + (how many of labels_b[:p] are s)

and source s maps its k to a window by its own SampleOrder (its epochs counted on its own). Like
BatchReader, a reader needs no state but the global sample offset: the data-parallel ranks' slices
are the single-process batch, and a resume under any layout reads the same next batches. The
per-source position at an offset (`consumed`) goes into the checkpoint so that a resume under
another mixture is refused instead of silently reading other data.
"""

from __future__ import annotations

import numpy as np
import torch

from gridtrain.data.mix_spec import MIX_BLOCK, quotas  # noqa: F401 (imported from here too)
from gridtrain.data.sampler import SampleOrder, num_windows, read_windows
from gridtrain.data.shards import TokenStore

_MIX_STREAM = 0x4D4958  # 'MIX': keeps the block permutations apart from the sources' own orders


class MixtureOrder:
    """Global sample index -> (source, sample index of that source), as the module docstring says."""

    def __init__(self, weights: list[float], seed: int, block: int = MIX_BLOCK) -> None:
        self.quota = quotas(weights, block)
        self.block, self.seed = block, seed
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """labels[p]: the source of place p of block b; ranks[p]: how many earlier places are that source."""
        found = self._cache.get(b)
        if found is None:
            labels = np.repeat(np.arange(len(self.quota)), self.quota)
            labels = labels[np.random.default_rng([self.seed, _MIX_STREAM, b]).permutation(self.block)]
            ranks = np.empty(self.block, np.int64)
            for s in range(len(self.quota)):
                where = labels == s
                ranks[where] = np.arange(int(where.sum()))
            self._cache = {k: v for k, v in self._cache.items() if k == b - 1}  # a batch may straddle two blocks
            found = self._cache[b] = (labels, ranks)
        return found

    def locate(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(sources, per-source sample indices) of global samples [first, first + count)."""
        g = np.arange(first, first + count, dtype=np.int64)
        sources = np.empty(count, np.int64)
        index = np.empty(count, np.int64)
        for i, gi in enumerate(g):
            b, p = divmod(int(gi), self.block)
            labels, ranks = self._block(b)
            sources[i] = labels[p]
            index[i] = b * self.quota[labels[p]] + ranks[p]
        return sources, index

    def consumed(self, samples: int) -> np.ndarray:
        """How many samples of each source global samples [0, samples) hold."""
        b, p = divmod(samples, self.block)
        labels, _ = self._block(b)
        return b * self.quota + np.bincount(labels[:p], minlength=len(self.quota))


class MixtureReader:
    """Training samples of a mixture, with BatchReader's read(first, count) (the module docstring)."""

    def __init__(self, stores: list[TokenStore], names: list[str], weights: list[float], seq_len: int,
                 seed: int) -> None:
        self.stores, self.names, self.seq_len = stores, names, seq_len
        self.orders = [SampleOrder(num_windows(store, seq_len), seed, stream=i + 1) for i, store in enumerate(stores)]
        self.mix = MixtureOrder(weights, seed)
        self.num_samples = sum(o.num_samples for o in self.orders)

    def read(self, first_sample: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        sources, index = self.mix.locate(first_sample, num_samples)
        inputs = torch.empty(num_samples, self.seq_len, dtype=torch.int64)
        targets = torch.empty(num_samples, self.seq_len, dtype=torch.int64)
        for s, (store, order) in enumerate(zip(self.stores, self.orders)):
            rows = np.flatnonzero(sources == s)
            if len(rows):
                windows = np.asarray([order.window(int(k)) for k in index[rows]], np.int64)
                x, y = read_windows(store, windows, self.seq_len)
                inputs[torch.from_numpy(rows)], targets[torch.from_numpy(rows)] = x, y
        return inputs, targets

    def consumed(self, samples: int) -> np.ndarray:
        return self.mix.consumed(samples)

    def epochs(self, samples: int) -> dict[str, float]:
        """Each source's epochs after global samples [0, samples): its samples read over its windows."""
        return {f"data/epochs/{name}": float(n) / order.num_samples
                for name, n, order in zip(self.names, self.consumed(samples), self.orders)}
