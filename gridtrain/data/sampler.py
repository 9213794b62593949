"""Deterministic training and validation batches over a TokenStore.

The token stream of N tokens is cut into `(N - 1) // seq_len` non-overlapping windows of
`seq_len + 1` tokens; window i starts at token i * seq_len and gives the sample
(inputs, targets) = (window[:-1], window[1:]). Consecutive windows share one token, so every
token but the first is a target exactly once per epoch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from gridtrain.data.shards import TokenStore


class SampleOrder:
    """The window read at each global sample index g = 0, 1, 2, ... (forever).

    g falls in epoch e = g // num_samples, and maps to window perm_e[g % num_samples], where
    perm_e = np.random.default_rng([seed, e]).permutation(num_samples): every epoch visits every
    window once, in an order that depends only on (seed, e). A `stream` other than 0 (a mixture's
    source) draws from [seed, stream, e] instead.
    """

    def __init__(self, num_samples: int, seed: int, stream: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {num_samples}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.num_samples = num_samples
        self.seed = seed
        self._key = [seed] if stream == 0 else [seed, stream]
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([*self._key, epoch]).permutation(self.num_samples)
            # Keep the previous epoch too: a batch may straddle an epoch boundary.
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = perm
        return perm

    def window(self, g: int) -> int:
        if g < 0:
            raise IndexError(f"global sample index must be non-negative, got {g}")
        epoch, pos = divmod(g, self.num_samples)
        return int(self.permutation(epoch)[pos])

    def windows(self, first: int, count: int) -> np.ndarray:
        """window(g) for g in [first, first + count), as an int64 array."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            g = first + done
            if g < 0:
                raise IndexError(f"global sample index must be non-negative, got {g}")
            epoch, pos = divmod(g, self.num_samples)
            take = min(count - done, self.num_samples - pos)
            out[done:done + take] = self.permutation(epoch)[pos:pos + take]
            done += take
        return out


class BatchReader:
    """Shuffled training samples of `seq_len` tokens, addressed by global sample index.

    The sampler's whole state is one integer kept by the caller, the global sample offset.
    A trainer at optimizer step s with global batch B reads samples [s*B, (s+1)*B); data-parallel
    rank r of D reads the contiguous slice [s*B + r*B/D, s*B + (r+1)*B/D). Which window a global
    index maps to depends only on the seed, never on D or on who reads it, so the D slices
    together are exactly the single-process batch, and a run resumes exactly at step s, even
    with a different number of data-parallel ranks.
    """

    def __init__(self, store: TokenStore, seq_len: int, seed: int) -> None:
        self.store = store
        self.seq_len = seq_len
        self.num_samples = num_windows(store, seq_len)
        self.order = SampleOrder(self.num_samples, seed)

    def read(self, first_sample: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for global samples [first_sample, first_sample + num_samples).

        Both int64 of shape (num_samples, seq_len); targets are inputs shifted left by one.
        """
        windows = self.order.windows(first_sample, num_samples)
        return read_windows(self.store, windows, self.seq_len)


class ValReader:
    """Fixed validation batches: the first windows of the store, in stream order."""

    def __init__(self, store: TokenStore, seq_len: int) -> None:
        self.store = store
        self.seq_len = seq_len
        self.num_samples = num_windows(store, seq_len)

    def batches(self, batch_size: int,
                max_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Up to `max_batches` batches of (inputs, targets); the last is short if the split is."""
        if batch_size < 1 or max_batches < 1:
            raise ValueError(f"batch_size ({batch_size}) and max_batches ({max_batches}) "
                             "must be at least 1")
        total = min(self.num_samples, batch_size * max_batches)
        for first in range(0, total, batch_size):
            windows = np.arange(first, min(first + batch_size, total), dtype=np.int64)
            yield read_windows(self.store, windows, self.seq_len)


def num_windows(store: TokenStore, seq_len: int) -> int:
    """How many samples of `seq_len` tokens the store holds; raises if not even one."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    count = (store.num_tokens - 1) // seq_len
    if count < 1:
        raise ValueError(
            f"the {store.split} split of {store.prepared_dir} has {store.num_tokens} tokens, too "
            f"few for one sample of seq_len={seq_len} (needs {seq_len + 1}): use a larger "
            "corpus, a smaller seq_len, or a larger val_fraction for the val split")
    return count


def read_windows(store: TokenStore, windows: np.ndarray,
                 seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = np.empty((len(windows), seq_len + 1), dtype=np.int64)  # (B, T + 1)
    for row, window in enumerate(windows):
        tokens[row] = store.read(int(window) * seq_len, seq_len + 1)
    inputs = torch.from_numpy(np.ascontiguousarray(tokens[:, :-1]))  # (B, T)
    targets = torch.from_numpy(np.ascontiguousarray(tokens[:, 1:]))  # (B, T)
    return inputs, targets
