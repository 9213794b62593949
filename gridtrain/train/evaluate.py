"""Validation: the mean loss over the first `train.val_batches` micro-batches of the held-out split."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gridtrain.config import Config, ConfigError
from gridtrain.data.sampler import ValReader
from gridtrain.model.documents import document_ids
from gridtrain.parallel.context_parallel import split_batch
from gridtrain.parallel.parallelize import ParallelModel
from gridtrain.parallel.tensor_parallel import loss_context
from gridtrain.train.build import Data, loss_fn, scalar
from gridtrain.train.precision import Precision


def validation_batches(cfg: Config, pipeline_micro_batches: int | None = None) -> tuple[int, int]:
    """(sequences per validation batch, batches): train.val_batches micro-batches, in whole pipeline
    batches of micro_batch x `pipeline_micro_batches` when a pipeline schedule runs them."""
    mb = cfg.train.micro_batch
    size = mb if pipeline_micro_batches is None else mb * pipeline_micro_batches
    return size, max(1, cfg.train.val_batches * mb // size)


class Evaluator:
    """Runs validation on one rank's model parts: through the pipeline schedule's forward-only
    pass when there is one (whole pipeline batches of micro_batch x accumulation sequences only)."""

    def __init__(self, cfg: Config, data: Data, pmodel: ParallelModel, precision: Precision, accum: int,
                 micro_batches: int, tp: int, pp_group: dist.ProcessGroup | None, device: torch.device,
                 cp_group: dist.ProcessGroup | None = None) -> None:
        self.cfg, self.val, self.pmodel, self.precision = cfg, data.val, pmodel, precision
        self.sources = data.val_sources
        self.micro_batches, self.tp, self.pp_group, self.device = micro_batches, tp, pp_group, device
        self.cp_group = cp_group
        self.eos_id = data.eos_id if cfg.data.doc_mask else None
        """Under context parallelism each rank validates its chunks of every sequence."""
        self.size, self.batches = validation_batches(cfg, None if pmodel.schedule is None else accum)
        """Sequences per validation batch, and how many."""
        self.check_split()

    def check_split(self) -> None:
        """A split smaller than one validation batch would validate nothing and report nan."""
        if self.cfg.train.val_every <= 0:
            return
        for name, val in self.readers().items():
            if val.num_samples < self.size:
                raise ConfigError([
                    f"the validation split{f' of {name}' if name else ''} holds {val.num_samples} sequences of "
                    f"{self.cfg.data.seq_len} tokens, fewer than one validation batch ({self.size}): raise "
                    "data.val_fraction, lower train.micro_batch, or set train.val_every 0"])

    def readers(self) -> dict[str, ValReader]:
        """The validation splits by source name: a mixture's each, or the corpus's as ''."""
        return self.sources or ({"": self.val} if self.val is not None else {})

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        for part in self.pmodel.parts:
            part.eval()
        readers = self.readers()
        sums = torch.zeros(len(readers), 2)  # (loss x tokens, tokens) per source
        for i, reader in enumerate(readers.values()):
            sums[i] = self.sums(reader)
        for part in self.pmodel.parts:
            part.train()
        # Only the last stage has losses; each CP rank has those of its chunks.
        for axis_group in (self.pp_group, self.cp_group):
            if axis_group is not None:
                dist.all_reduce(sums, group=axis_group)
        loss = (sums[:, 0].sum() / sums[:, 1].sum()).item()
        metrics = {"loss/val": loss, "loss/val_ppl": math.exp(min(loss, 50.0))}
        if self.sources:
            metrics.update({f"loss/val/{name}": (total / count).item() for name, (total, count) in zip(readers, sums)})
        return metrics

    def sums(self, reader: ValReader) -> torch.Tensor:
        """(sum of the token losses, tokens) over one validation split's batches, on this rank."""
        total, count = torch.zeros(()), torch.zeros(())
        for inputs, targets in reader.batches(self.size, self.batches):
            if len(inputs) < self.size:
                break
            docs = [document_ids(inputs, self.eos_id).to(self.device)] if self.cfg.data.doc_mask else []
            if self.cp_group is not None:  # each rank its chunks; the documents of the whole sequences
                inputs, targets = split_batch(inputs, targets, self.cp_group.rank(), self.cp_group.size())
            with loss_context(self.tp), self.precision.autocast():
                loss = self.loss(inputs.to(self.device), targets.to(self.device), *docs)
            if loss is not None:
                total += loss.float().cpu() * targets.numel()
                count += targets.numel()
        return torch.stack([total, count])

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, *docs: torch.Tensor) -> torch.Tensor | None:
        """The mean loss of a validation batch (`docs`: its document ids, with data.doc_mask)."""
        if self.pmodel.schedule is None:
            return scalar(loss_fn(self.pmodel.parts[0](inputs, *docs), targets))
        losses: list[torch.Tensor] = []
        (self.pmodel.eval_schedule or self.pmodel.schedule).eval(inputs, target=targets, losses=losses,
                                                                 **{"doc_ids": d for d in docs})
        if not losses:
            return None
        # Each is scaled and divided by the training step's loss shares, micro-batches x CP ranks
        # (Trainer.pipeline_loss): undone here, so each CP rank holds the mean over its chunks.
        shares = self.micro_batches * (self.cp_group.size() if self.cp_group is not None else 1)
        return sum(scalar(l) for l in losses) * shares / (len(losses) * self.precision.loss_scale)
