"""What a Trainer is built from: the model (initialised from the seed), the loss, the data readers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from gridtrain.config import Config
from gridtrain.data.sampler import BatchReader, ValReader
from gridtrain.data.shards import TokenStore, ensure_prepared
from gridtrain.model.args import ModelArgs
from gridtrain.model.llama import Transformer
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


@dataclass
class Data:
    train: BatchReader
    val: ValReader | None
    tokens: int


def prepared_data(cfg: Config) -> Path:
    """The run's token shards, prepared first if they are not (ensure_prepared)."""
    return ensure_prepared(cfg.data.corpus, cfg.data.tokenizer, Path(cfg.data.cache_dir).expanduser(),
                           cfg.data.val_fraction, cfg.train.seed, column=cfg.data.text_column)


def val_reader(cfg: Config, prepared: Path) -> ValReader:
    return ValReader(TokenStore(prepared, "val"), cfg.data.seq_len)


def build_data(cfg: Config, world: World) -> Data:
    """Token shards (prepared once, by rank 0, while the others wait) and the readers."""
    if world.rank == 0:
        prepared = prepared_data(cfg)
    if world.distributed:
        dist.barrier()
    if world.rank != 0:
        prepared = prepared_data(cfg)
    store = TokenStore(prepared, "train")
    val = val_reader(cfg, prepared) if cfg.train.val_every else None
    return Data(BatchReader(store, cfg.data.seq_len, cfg.train.seed), val, store.num_tokens)


def scalar(t: torch.Tensor) -> torch.Tensor:
    """A loss or norm as a plain tensor (loss parallel returns a replicated DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
