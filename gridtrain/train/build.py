"""What a Trainer is built from: the model (initialised from the seed), the loss, the data readers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from gridtrain.config import Config
from gridtrain.data.mix_spec import parse_mix
from gridtrain.data.mixture import MIX_BLOCK, MixtureReader
from gridtrain.data.sampler import BatchReader, ValReader
from gridtrain.data.shards import TokenStore, ensure_prepared
from gridtrain.model.args import ModelArgs
from gridtrain.model.documents import document_ids
from gridtrain.model.llama import Transformer
from gridtrain.checkpoint.state import InvalidCheckpointError
from gridtrain.train.distributed import World


def build_model(args: ModelArgs, seed: int, device: torch.device) -> Transformer:
    """Build on the meta device, then materialise and initialise from the seed: the same weights
    whatever the device, and no memory spent on a throw-away default initialisation."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens, computed in fp32 whatever the autocast precision."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


Batch = tuple[torch.Tensor, ...]
"""Inputs and targets (B, T), and with data.doc_mask each token's document (with_documents)."""


def with_documents(read: Callable[[int, int], Batch], eos_id: int) -> Callable[[int, int], Batch]:
    """`read`, each batch with its document ids read from the end-of-document tokens of its inputs:
    a function of the sequence alone, so every layout sees the same documents."""
    def read_documents(first: int, count: int) -> Batch:
        inputs, targets = read(first, count)
        return inputs, targets, document_ids(inputs, eos_id)

    return read_documents


def restart_positions(parts: list[torch.nn.Module], restart: bool) -> None:
    """Every model part's RoPE positions restart at each document, or not (data.doc_positions)."""
    for part in parts:
        for module in part.modules():
            if isinstance(module, Transformer):
                module.restart_positions = restart


@dataclass
class Data:
    train: BatchReader | MixtureReader
    val: ValReader | None
    tokens: int
    val_sources: dict[str, ValReader] = field(default_factory=dict)
    """A mixture's validation split per source (empty for one corpus): validation reports each."""

    @property
    def eos_id(self) -> int:
        """The end-of-document token (one tokenizer serves every source of a mixture)."""
        return (self.train.stores[0] if isinstance(self.train, MixtureReader) else self.train.store).eos_id

    @property
    def mixture(self) -> MixtureReader | None:
        return self.train if isinstance(self.train, MixtureReader) else None

    def attention_span(self, seq_len: int) -> float:
        """data.doc_mask's keys per query over an epoch of the training split (data/doc_span.py), a
        mixture's sources weighted as it draws them."""
        from gridtrain.data.doc_span import mixture_span, store_span

        if self.mixture is None:
            return store_span(self.train.store, seq_len)
        spans = [store_span(store, seq_len) for store in self.mixture.stores]
        return mixture_span(spans, [float(q) for q in self.mixture.mix.quota])

    def position(self, samples: int) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the data beside the sample offset: a mixture's samples per source."""
        if self.mixture is None:
            return {}
        return {"mix_quota": torch.from_numpy(self.mixture.mix.quota.copy()),
                "mix_samples": torch.from_numpy(self.mixture.consumed(samples))}

    def check_position(self, state: dict[str, torch.Tensor], samples: int, path: Path) -> None:
        """Refuse a checkpoint whose mixture position is not this mixture's at its sample offset."""
        if self.mixture is None:
            return
        saved = state["mix_quota"].tolist(), state["mix_samples"].tolist()
        here = self.mixture.mix.quota.tolist(), self.mixture.consumed(samples).tolist()
        if saved != here:
            raise InvalidCheckpointError(
                f"checkpoint {path} mixes its sources {saved[0]} per {MIX_BLOCK} samples and had read {saved[1]} of "
                f"them by sample {samples}; this data.mix mixes {here[0]} and reads {here[1]}: resume with the "
                "data.mix (sources, order, weights) the run was saved with")

    wait_s: float = 0.0
    """Seconds spent reading batches since the last metrics()."""

    def timed(self, read: Callable[[int, int], Batch]) -> Callable[[int, int], Batch]:
        """`read`, its time added to wait_s: everything between asking for a batch and holding it
        (the reader runs in the training process, so its time is the step's wait)."""

        def timed_read(first: int, count: int) -> Batch:
            start = time.perf_counter()
            try:
                return read(first, count)
            finally:
                self.wait_s += time.perf_counter() - start

        return timed_read

    def metrics(self, samples: int) -> dict[str, float]:
        """The step's wait for data (time/data_wait_s, then reset), and a mixture's epochs per source
        after `samples` global samples."""
        wait, self.wait_s = self.wait_s, 0.0
        return {"time/data_wait_s": wait, **({} if self.mixture is None else self.mixture.epochs(samples))}


def prepared_data(cfg: Config) -> Path:
    """The run's token shards, prepared first if they are not (ensure_prepared); a mixture's first source's."""
    return prepared_sources(cfg)[0][1]


def prepared_sources(cfg: Config) -> list[tuple[str, Path, float]]:
    """(name, prepared directory, weight) of data.corpus, or of each source of data.mix; prepared first
    if they are not."""
    d = cfg.data
    prepare = partial(ensure_prepared, tokenizer_spec=d.tokenizer, cache_dir=Path(d.cache_dir).expanduser(),
                      val_fraction=d.val_fraction, seed=cfg.train.seed, column=d.text_column)
    if d.mix is None:
        return [("", prepare(d.corpus), 1.0)]
    return [(s.name, prepare(s.path), s.weight) for s in parse_mix(d.mix)]


def val_reader(cfg: Config, prepared: Path) -> ValReader:
    return ValReader(TokenStore(prepared, "val"), cfg.data.seq_len)


def build_data(cfg: Config, world: World) -> Data:
    """Token shards (prepared once, by rank 0, while the others wait) and the readers."""
    if world.rank == 0:
        sources = prepared_sources(cfg)
    if world.distributed:
        dist.barrier()
    if world.rank != 0:
        sources = prepared_sources(cfg)
    stores = [TokenStore(path, "train") for _, path, _ in sources]
    vals = {name: val_reader(cfg, path) for name, path, _ in sources} if cfg.train.val_every else {}
    tokens = sum(store.num_tokens for store in stores)
    if cfg.data.mix is None:
        return Data(BatchReader(stores[0], cfg.data.seq_len, cfg.train.seed), vals.get(""), tokens)
    names, weights = [name for name, _, _ in sources], [weight for _, _, weight in sources]
    mixture = MixtureReader(stores, names, weights, cfg.data.seq_len, cfg.train.seed)
    return Data(mixture, next(iter(vals.values()), None), tokens, vals)


def scalar(t: torch.Tensor) -> torch.Tensor:
    """A loss or norm as a plain tensor (loss parallel returns a replicated DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
