"""The training loop: data, model, optimizer, precision, accumulation, validation, checkpoints.

One optimizer step reads the global batch [step * B, (step + 1) * B) of the deterministic sample
order, in `accum` micro-batches of `micro_batch` sequences; each micro-batch's loss is divided
by `accum`, so the accumulated gradient is the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gridtrain.checks import validate
from gridtrain.config import Config
from gridtrain.data.sampler import BatchReader, ValReader
from gridtrain.data.shards import TokenStore, ensure_prepared
from gridtrain.model.args import ModelArgs
from gridtrain.model.llama import Transformer
from gridtrain.model.stats import count_parameters, flops_per_token
from gridtrain.parallel.apply import parallelize
from gridtrain.plan.hardware import peak_flops
from gridtrain.train import checkpoint
from gridtrain.train.device import device_name, memory_gib, pick_device
from gridtrain.train.metrics import MetricsWriter
from gridtrain.train.optim import build_optimizer, lr_at, set_lr
from gridtrain.train.precision import Precision

log = logging.getLogger("gridtrain")


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


def build_data(cfg: Config) -> Data:
    cache = Path(cfg.data.cache_dir).expanduser()
    prepared = ensure_prepared(cfg.data.corpus, cfg.data.tokenizer, cache, cfg.data.val_fraction,
                               cfg.train.seed)
    store = TokenStore(prepared, "train")
    val = ValReader(TokenStore(prepared, "val"), cfg.data.seq_len) if cfg.train.val_every else None
    return Data(BatchReader(store, cfg.data.seq_len, cfg.train.seed), val, store.num_tokens)


class Trainer:
    """Single-process trainer (a world of one); later layouts reuse its step and bookkeeping."""

    def __init__(self, cfg: Config) -> None:
        validate(cfg)
        self.cfg, t = cfg, cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = pick_device()
        self.args = cfg.model.args()
        self.data = build_data(cfg)
        self.model = build_model(self.args, t.seed, self.device)
        parallelize(self.model, t.activation_checkpointing, t.compile)
        self.optimizer = build_optimizer(self.model, t)
        self.precision = Precision(t, self.device)
        self.global_batch = cfg.global_batch_seqs
        self.accum = self.global_batch // t.micro_batch
        self.tokens_per_step = self.global_batch * cfg.data.seq_len
        counts = count_parameters(self.model)
        self.num_params = counts.total
        self.flops_per_token = flops_per_token(self.args, cfg.data.seq_len, counts)
        self.peak = peak_flops(self.device, device_name(self.device), t.precision)
        self.step = 0
        self.ckpt_dir = cfg.checkpoint_dir
        if cfg.checkpoint.resume:
            self.resume()

    # -- state -------------------------------------------------------------------------------

    def trainer_state(self) -> dict[str, torch.Tensor]:
        """Everything besides model and optimizer that an exact resume needs, as tensors."""
        return {"step": torch.tensor(self.step), "samples": torch.tensor(self.step * self.global_batch),
                "rng": torch.get_rng_state(), **self.precision.state_dict()}

    def save(self) -> Path:
        path = checkpoint.save(self.ckpt_dir, self.step, self.model, self.optimizer,
                               self.trainer_state(), self.cfg.checkpoint.keep)
        log.info("saved checkpoint %s", path)
        return path

    def resume(self) -> None:
        path = checkpoint.latest_checkpoint(self.ckpt_dir)
        if path is None:
            log.info("--resume: no checkpoint in %s, starting from step 0", self.ckpt_dir)
            return
        state = checkpoint.load(path, self.model, self.optimizer, self.trainer_state())
        self.step = int(state["step"])
        samples = int(state["samples"])
        if samples != self.step * self.global_batch:
            raise ValueError(f"checkpoint {path} consumed {samples} samples in {self.step} steps, "
                             f"which is not {self.step} x train.global_batch ({self.global_batch}): "
                             "resume with the global batch the run was saved with")
        torch.set_rng_state(state["rng"])
        self.precision.load_state_dict(state)
        log.info("resumed from %s at step %d (sample offset %d)", path, self.step, samples)

    # -- one step ----------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns its metrics."""
        t, start = self.cfg.train, time.perf_counter()
        lr = lr_at(self.step, t)
        set_lr(self.optimizer, lr)
        first = self.step * self.global_batch
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            inputs, targets = self.data.train.read(first + micro * t.micro_batch, t.micro_batch)
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with self.precision.autocast():
                logits = self.model(inputs)
            loss = loss_fn(logits, targets) / self.accum
            self.precision.backward(loss)
            loss_sum += loss.detach()
        self.precision.unscale_(self.optimizer)
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        stepped = self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        loss_value = loss_sum.item()  # synchronises, so the step time below is honest
        seconds = time.perf_counter() - start
        tokens_per_s = self.tokens_per_step / seconds
        metrics = {"loss/train": loss_value, "grad/norm": grad_norm.item(), "lr": lr,
                   "throughput/tokens_per_s": tokens_per_s, "time/step_s": seconds,
                   "mfu_pct": 100 * self.flops_per_token * tokens_per_s / self.peak,
                   "flops/achieved_TFLOPs": self.flops_per_token * tokens_per_s / 1e12,
                   "optim/skipped_steps": float(not stepped), **memory_gib(self.device)}
        if t.precision == "fp16":
            metrics["precision/loss_scale"] = self.precision.loss_scale
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the first `val_batches` micro-batches of the held-out split."""
        self.model.eval()
        total, count = 0.0, 0
        for inputs, targets in self.data.val.batches(self.cfg.train.micro_batch, self.cfg.train.val_batches):
            with self.precision.autocast():
                logits = self.model(inputs.to(self.device))
            total += loss_fn(logits, targets.to(self.device)).item() * targets.numel()
            count += targets.numel()
        self.model.train()
        loss = total / count
        return {"loss/val": loss, "loss/val_ppl": math.exp(min(loss, 50.0))}

    # -- the run -----------------------------------------------------------------------------

    def describe(self) -> str:
        c, a = self.cfg, self.args
        return (f"model {c.model.preset}: {self.num_params / 1e6:.2f}M parameters, {a.n_layers} layers, "
                f"dim {a.dim}, {a.n_heads} heads / {a.n_kv_heads} KV, ffn {a.hidden_dim}, vocab "
                f"{a.vocab_size} | {self.flops_per_token / 1e6:.1f} MFLOP/token\n"
                f"batch: micro {c.train.micro_batch} x accumulation {self.accum} x data-parallel 1 = "
                f"{self.global_batch} sequences = {self.tokens_per_step:,} tokens per step; "
                f"{c.train.steps} steps = {c.train.steps * self.tokens_per_step / 1e6:.1f}M tokens "
                f"({self.data.tokens / 1e6:.1f}M in the training split)\n"
                f"device {self.device} ({device_name(self.device)}, {torch.get_num_threads()} threads), "
                f"precision {c.train.precision}, peak {self.peak / 1e12:.2f} TFLOP/s for MFU")

    def should(self, interval: int) -> bool:
        return interval > 0 and (self.step % interval == 0 or self.step == self.cfg.train.steps)

    def run(self) -> dict[str, float]:
        """Train to `train.steps`; returns the last step's metrics (with validation if run)."""
        cfg = self.cfg
        log.info("%s", self.describe())
        writer = MetricsWriter(Path(cfg.run_dir), cfg.train.steps, self.step, cfg.metrics.tensorboard,
                               cfg.metrics.progress)
        metrics: dict[str, float] = {}
        if self.step == 0 and self.data.val is not None:
            writer.write(0, self.evaluate())
        try:
            while self.step < cfg.train.steps:
                metrics = self.train_step()
                if self.should(cfg.train.val_every) and self.data.val is not None:
                    metrics.update(self.evaluate())
                writer.write(self.step, metrics, echo=self.should(cfg.metrics.log_every) or "loss/val" in metrics)
                writer.advance(metrics["loss/train"])
                if self.should(cfg.checkpoint.interval):
                    self.save()
        finally:
            writer.close()
        return metrics
