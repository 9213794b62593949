"""The training loop: data, model, optimizer, precision, accumulation, validation, checkpoints.

One optimizer step reads the global batch [step * B, (step + 1) * B) of the deterministic sample
order; each data-parallel rank reads its slice in `accum` micro-batches of `micro_batch`
sequences. Each micro-batch's loss is divided by the number of micro-batches in the whole global
batch (accum x data-parallel degree) and data parallelism sums the gradients, so the gradient is
that of the mean loss over the global batch, and every micro-batch's backward runs at the scale
one process gives it: in fp16 the same values overflow whatever the layout.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from gridtrain.checks import validate
from gridtrain.config import Config, ConfigError
from gridtrain.model.stats import count_parameters, flops_per_token
from gridtrain.parallel.accounting import (CollectiveLog, SavedActivations, flatten_comm, grad_bytes,
                                          optimizer_bytes, param_bytes)
from gridtrain.parallel.apply import parallelize
from gridtrain.parallel.data import set_gradient_sync
from gridtrain.parallel.grads import clip_grad_norm
from gridtrain.parallel.tensor import loss_context
from gridtrain.train import checkpoint
from gridtrain.train.build import build_data, build_model, loss_fn, scalar
from gridtrain.train.calibrate import peak_flops
from gridtrain.train.device import device_name, memory_gib
from gridtrain.train.distributed import any_rank, init_world
from gridtrain.train.metrics import MetricsWriter
from gridtrain.train.optim import build_optimizer, lr_at, set_lr
from gridtrain.train.units import units_table
from gridtrain.train.precision import Precision
from gridtrain.train.resilience import (Guard, ProgressBoard, StopSignals, TrainingDiverged, auto_interval, collective_failure, inject_fault,
                                        is_comm_failure, restart_count, set_timeouts)

log = logging.getLogger("gridtrain")


class Stopped(Exception):
    """The run saved and stopped on a signal (SIGTERM, SIGUSR1); `signum` gives the exit status."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class Trainer:
    """Trains one rank's share of the run: any layout of ParallelDims, or a world of one."""

    def __init__(self, cfg: Config) -> None:
        self.dims = validate(cfg)  # before any process group exists
        # Start-up (data preparation on rank 0, the first checkpoint load) may take longer than
        # a training collective should: the run's own timeout is set once it is built.
        self.world = init_world(max(1800.0, cfg.train.collective_timeout_s))
        self.cfg, t = cfg, cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = self.world.device
        self.mesh = self.dims.build_mesh(self.device.type) if self.world.distributed else None
        self.coords = self.dims.coordinates(self.world.rank)
        self.args = cfg.model.args()
        self.data = build_data(cfg, self.world)
        self.global_batch = cfg.global_batch_seqs
        self.local_batch = self.global_batch // self.dims.dp
        self.accum = self.local_batch // t.micro_batch
        self.micro_batches = self.accum * self.dims.dp  # in the global batch
        self.tokens_per_step = self.global_batch * cfg.data.seq_len
        full = build_model(self.args, t.seed, self.device)
        counts = count_parameters(full)
        self.num_params = counts.total
        self.flops_per_token = flops_per_token(self.args, cfg.data.seq_len, counts)
        self.precision = Precision(t, self.device)
        self.pmodel = parallelize(full, cfg, self.dims if self.world.distributed else None, self.mesh,
                                  self.pipeline_loss, self.accum, self.device)
        self.model = self.pmodel.parts[0]
        self.check_val_split()
        self.optimizers = [build_optimizer(part, t, self.mesh, cfg.parallel.zero_stage, self.dims.dp)
                           for part in self.pmodel.parts]
        self.optimizer = self.optimizers[0]
        self.peak = peak_flops(self.device, device_name(self.device), t.precision)
        self.step = 0
        self.ckpt_dir = cfg.checkpoint_dir
        self.is_writer = self.coords["dp"] == 0 and self.coords["tp"] == 0 and self.pmodel.has_last_stage
        self.comm_log = CollectiveLog(self.axis_groups()) if self.world.distributed else None
        self.guard = Guard(t.max_bad_steps, t.spike_zscore)
        self.interval = None if cfg.checkpoint.interval == "auto" else cfg.checkpoint.interval
        ckpt_timeout = datetime.timedelta(seconds=cfg.checkpoint.timeout_s)
        self.ckpt_group = dist.new_group(backend="gloo", timeout=ckpt_timeout) if self.world.distributed else None
        self.signals = StopSignals(cfg.checkpoint.signal_grace_s)
        self.unsaved: Exception | None = None
        """The last save's error while on_save_error is 'continue' and no save has succeeded since."""
        self.saver = (checkpoint.AsyncSaver(self.ckpt_dir, cfg.checkpoint.keep, self.ckpt_group, ckpt_timeout)
                      if cfg.checkpoint.async_save else None)
        # Across nodes only the failed node counts a restart: every rank must resume if any does.
        self.restarted = any_rank(restart_count() > 0)
        if cfg.checkpoint.resume or self.restarted:
            if self.restarted and self.world.rank == 0:
                log.warning("torchrun restarted the run: resuming from the newest intact checkpoint")
            self.resume()
        self.board = None
        if self.world.distributed:
            set_timeouts(list(self.axis_groups().values()), t.collective_timeout_s)
            self.board = ProgressBoard(self.world.rank, self.world.world_size)

    def check_val_split(self) -> None:
        """Validation reads whole batches of micro_batch sequences (times the accumulation under a
        pipeline): a split smaller than one would validate nothing and report nan."""
        t = self.cfg.train
        size = t.micro_batch if self.pmodel.schedule is None else t.micro_batch * self.accum
        if self.data.val is not None and t.val_every > 0 and self.data.val.num_samples < size:
            raise ConfigError([
                f"the validation split holds {self.data.val.num_samples} sequences of {self.cfg.data.seq_len} "
                f"tokens, fewer than one validation batch ({size}): raise data.val_fraction, lower "
                "train.micro_batch, or set train.val_every 0"])

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of a mesh axis ('world' for all ranks); None when it has one rank."""
        if self.mesh is None:
            return None
        if axis == "world":
            return dist.group.WORLD
        return self.mesh[axis].get_group() if self.dims.degrees[axis] > 1 else None

    def axis_groups(self) -> dict[str, dist.ProcessGroup]:
        """Process group of each mesh axis with more than one rank, then the flattened ones."""
        groups = {axis: self.mesh[axis].get_group() for axis, n in self.dims.degrees.items() if n > 1}
        if self.dims.dp > 1:
            groups["dp"] = self.mesh["dp"].get_group()
        groups["world"] = dist.group.WORLD
        return groups

    def accounting_due(self) -> bool:
        every = self.cfg.metrics.account_every
        return every > 0 and (self.step == 0 or (self.step + 1) % every == 0)

    # -- state -------------------------------------------------------------------------------

    def trainer_state(self) -> dict[str, torch.Tensor]:
        """Everything besides model and optimizer that an exact resume needs, as tensors."""
        return {"step": torch.tensor(self.step), "samples": torch.tensor(self.step * self.global_batch),
                "rng": torch.get_rng_state(), **self.precision.state_dict()}

    def save(self) -> Path | None:
        """Save a checkpoint and return its path (with checkpoint.async_save: start writing it,
        after committing the previous one, and return None); a failed save leaves the earlier ones
        intact and, by checkpoint.on_save_error, stops the run or is logged and retried at the
        next interval (None)."""
        if self.saver:
            target = checkpoint.step_dir(self.ckpt_dir, self.step)
            started = self.checked(lambda: self.saver.save(self.step, self.pmodel.parts, self.optimizers,
                                                           self.trainer_state()) or target)
            if started and self.world.rank == 0:
                log.info("checkpoint of step %d is being written in the background", self.step)
            return None
        path = self.checked(lambda: checkpoint.save(self.ckpt_dir, self.step, self.pmodel.parts, self.optimizers,
                                                    self.trainer_state(), self.cfg.checkpoint.keep, self.ckpt_group))
        if path and self.world.rank == 0:
            log.info("saved checkpoint %s", path)
        return path

    def checked(self, save: Callable[[], Path | None]) -> Path | None:
        """Run one save (or commit); on CheckpointSaveError apply checkpoint.on_save_error:
        re-raise, or log it and return None."""
        try:
            path = save()
        except checkpoint.CheckpointSaveError as err:
            if self.cfg.checkpoint.on_save_error == "stop":
                raise
            log.error("%s; training goes on (checkpoint.on_save_error = 'continue')", err)
            self.unsaved = err
            return None
        if path:
            self.unsaved = None
        return path

    def commit_written(self) -> None:
        """Commit a background save as soon as every rank has written it (a crash then loses at
        most the steps since it, not a whole interval more)."""
        path = self.checked(self.saver.poll) if self.saver and self.saver.pending else None
        if path and self.world.rank == 0:
            log.info("saved checkpoint %s", path)

    def finish_saves(self) -> None:
        """Commit a checkpoint still being written in the background."""
        path = self.checked(self.saver.wait) if self.saver else None
        if path and self.world.rank == 0:
            log.info("saved checkpoint %s", path)

    def resume(self) -> None:
        path, skipped = checkpoint.latest_valid_checkpoint(self.ckpt_dir, self.ckpt_group)
        if path is None and self.world.rank == 0:
            log.info("resume: no intact checkpoint in %s (%d skipped), starting from step 0",
                     self.ckpt_dir, len(skipped))
        if path is None:
            return
        state = checkpoint.load(path, self.pmodel.parts, self.optimizers, self.trainer_state(), self.ckpt_group)
        self.step = int(state["step"])
        samples = int(state["samples"])
        if samples != self.step * self.global_batch:
            raise ValueError(f"checkpoint {path} consumed {samples} samples in {self.step} steps, "
                             f"which is not {self.step} x train.global_batch ({self.global_batch}): "
                             "resume with the global batch the run was saved with")
        torch.set_rng_state(state["rng"])
        self.precision.load_state_dict(state)
        if self.world.rank == 0:
            log.info("resumed from %s at step %d (sample offset %d)", path, self.step, samples)

    # -- one step ----------------------------------------------------------------------------

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of one pipeline micro-batch, divided by the micro-batches of the global batch and
        scaled for fp16 (what its backward starts from)."""
        return self.precision.scaler.scale(loss_fn(logits, targets) / self.micro_batches)

    def local_batch_range(self) -> int:
        """First global sample index of this data-parallel rank's slice of the current step."""
        return self.step * self.global_batch + self.coords["dp"] * self.local_batch

    def forward_backward(self) -> torch.Tensor:
        """Forward and backward over this rank's slice; returns its share of the global batch's
        mean loss (zero on pipeline ranks without the last stage)."""
        mb, first = self.cfg.train.micro_batch, self.local_batch_range()
        self.precision.begin_step()
        if self.pmodel.schedule is not None:
            inputs, targets = self.data.train.read(first, self.local_batch)
            losses: list[torch.Tensor] = []
            with self.precision.autocast(), loss_context(self.dims.tp):
                self.pmodel.schedule.step(inputs.to(self.device), target=targets.to(self.device),
                                          losses=losses, return_outputs=False)
            if not losses:
                return torch.zeros((), device=self.device)
            return sum(scalar(l).detach() for l in losses) / self.precision.loss_scale
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            set_gradient_sync(self.model, micro == self.accum - 1)
            inputs, targets = self.data.train.read(first + micro * mb, mb)
            with loss_context(self.dims.tp):
                with self.precision.autocast():
                    logits = self.model(inputs.to(self.device))
                loss = loss_fn(logits, targets.to(self.device)) / self.micro_batches
                self.precision.backward(loss)
            loss_sum += scalar(loss).detach()
        return loss_sum

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns its metrics."""
        inject_fault(self.cfg.fault, self.world.rank, self.step + 1, self.restarted)
        if self.board:
            self.board.post(self.step + 1)
        t, start = self.cfg.train, time.perf_counter()
        lr = lr_at(self.step, t)
        for opt in self.optimizers:
            set_lr(opt, lr)
        account = self.accounting_due()
        if account:
            meter = SavedActivations(self.pmodel.parameters(),
                                     [b for part in self.pmodel.parts for b in part.buffers()])
            if self.comm_log:
                self.comm_log.start()
            sent_before = self.pmodel.traffic.send_bytes if self.pmodel.traffic else 0
            with meter:
                loss = self.forward_backward()
            grads = grad_bytes(self.pmodel.parameters())
        else:
            loss = self.forward_backward()
        for opt in self.optimizers:
            self.precision.unscale_(opt, self.group("world"))
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(self.pmodel.parameters(), max_norm, self.group("pp")).item()
        # The step's collectives end here: the loss average below is reporting, not training.
        comm = self.comm_log.since_start() if account and self.comm_log else {}
        # The global mean loss and norm: every rank sees the same values, so all decide alike.
        loss_value = self.reduce_loss(loss)
        # fp16's scaler skips overflowing steps itself (and lowers the scale): the guard sees the loss.
        if self.guard.admit(self.step + 1, loss_value, 0.0 if t.precision == "fp16" else grad_norm):
            stepped = self.precision.step(self.optimizers)
        else:
            stepped = False
            self.precision.skip()
        accounting = {}
        if account:
            sent = self.pmodel.traffic.send_bytes - sent_before if self.pmodel.traffic else None
            accounting = self.account(meter.bytes, grads, sent, comm)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.step += 1
        seconds = time.perf_counter() - start
        tokens_per_s = self.tokens_per_step / seconds
        metrics = {"loss/train": loss_value, "grad/norm": grad_norm, "lr": lr,
                   "throughput/tokens_per_s": tokens_per_s, "time/step_s": seconds,
                   "mfu_pct": 100 * self.flops_per_token * tokens_per_s / (self.peak * self.world.world_size),
                   "flops/achieved_TFLOPs": self.flops_per_token * tokens_per_s / 1e12,
                   "optim/skipped_steps": float(not stepped), **self.guard.metrics(),
                   **memory_gib(self.device), **accounting}
        if t.precision == "fp16":
            metrics["precision/loss_scale"] = self.precision.loss_scale
        return metrics

    def account(self, saved_bytes: int, grads: int, pp_sent: int | None,
                comm: dict[str, dict[str, float]]) -> dict[str, float]:
        """This rank's memory buckets and the step's collectives; also appended to
        <run_dir>/accounting/rank<r>.jsonl, one line per accounted step."""
        record = {"memory/params_bytes": float(param_bytes(self.pmodel.parameters())),
                  "memory/grads_bytes": float(grads),
                  "memory/optimizer_bytes": float(optimizer_bytes(self.optimizers)),
                  "memory/activations_bytes": float(saved_bytes)}
        if self.comm_log:
            record.update(flatten_comm(comm))
        if pp_sent is not None:
            record["comm/pp/send_bytes"] = float(pp_sent)
        path = Path(self.cfg.run_dir) / "accounting" / f"rank{self.world.rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"step": self.step + 1, "rank": self.world.rank, **self.coords, **record}) + "\n")
        return record

    def reduce_loss(self, loss: torch.Tensor) -> float:
        """The global batch's mean loss: the ranks' shares summed over data parallelism, taken
        from the last pipeline stage."""
        if self.world.distributed:
            if self.dims.pp > 1:
                dist.all_reduce(loss, group=self.group("pp"))
            if self.dims.dp > 1:
                dist.all_reduce(loss, group=self.mesh["dp"].get_group())
        return loss.item()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the first `val_batches` micro-batches of the held-out split (through the
        pipeline schedule's forward-only pass when there is one: whole pipeline batches only)."""
        for part in self.pmodel.parts:
            part.eval()
        total, count = torch.zeros(()), torch.zeros(())
        mb, num = self.cfg.train.micro_batch, self.cfg.train.val_batches
        size = mb if self.pmodel.schedule is None else mb * self.accum
        for inputs, targets in self.data.val.batches(size, max(1, num * mb // size)):
            if len(inputs) < size:
                break
            with loss_context(self.dims.tp), self.precision.autocast():
                loss = self.val_loss(inputs.to(self.device), targets.to(self.device))
            if loss is not None:
                total += loss.float().cpu() * targets.numel()
                count += targets.numel()
        for part in self.pmodel.parts:
            part.train()
        if self.dims.pp > 1:  # only the last stage has losses
            both = torch.stack([total, count])
            dist.all_reduce(both, group=self.group("pp"))
            total, count = both[0], both[1]
        loss = (total / count).item()
        return {"loss/val": loss, "loss/val_ppl": math.exp(min(loss, 50.0))}

    def val_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        if self.pmodel.schedule is None:
            return scalar(loss_fn(self.model(inputs), targets))
        losses: list[torch.Tensor] = []
        self.pmodel.schedule.eval(inputs, target=targets, losses=losses)
        if not losses:
            return None
        # Each is scaled and divided by the training step's micro-batch count (pipeline_loss).
        return sum(scalar(l) for l in losses) * self.micro_batches / (len(losses) * self.precision.loss_scale)

    # -- the run -----------------------------------------------------------------------------

    def describe(self) -> str:
        c, a = self.cfg, self.args
        return (f"model {c.model.preset}: {self.num_params / 1e6:.2f}M parameters, {a.n_layers} layers, "
                f"dim {a.dim}, {a.n_heads} heads / {a.n_kv_heads} KV, ffn {a.hidden_dim}, vocab "
                f"{a.vocab_size} | {self.flops_per_token / 1e6:.1f} MFLOP/token | "
                f"{self.data.tokens / 1e6:.1f}M tokens in the training split\n"
                f"device {self.device} ({device_name(self.device)}, {torch.get_num_threads()} threads), "
                f"precision {c.train.precision}, peak {self.peak / 1e12:.2f} TFLOP/s per process for MFU\n"
                + units_table(c, self.dims, self.world.num_nodes))

    def write_config(self) -> None:
        """<run_dir>/config.json: the resolved configuration and layout, for `gridtrain plan --check`."""
        record = {"config": dataclasses.asdict(self.cfg), "world_size": self.world.world_size,
                  "dims": dataclasses.asdict(self.dims), "device": device_name(self.device),
                  "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "peak_flops": self.peak}
        path = Path(self.cfg.run_dir) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, path)  # a kill mid-write leaves the old record, and --resume still works

    def should(self, interval: int) -> bool:
        return interval > 0 and (self.step % interval == 0 or self.step == self.cfg.train.steps)

    def run(self) -> dict[str, float]:
        """Train to `train.steps`; returns the last step's metrics (with validation if run)."""
        cfg = self.cfg
        if self.world.rank == 0:
            log.info("%s", self.describe())
            self.write_config()
        writer = MetricsWriter(Path(cfg.run_dir), cfg.train.steps, self.step, cfg.metrics.tensorboard,
                               cfg.metrics.progress) if self.is_writer else None
        metrics: dict[str, float] = {}
        can_validate = self.data.val is not None
        if self.step == 0 and can_validate:
            val = self.evaluate()
            if writer:
                writer.write(0, val)
        doing = "during start-up"
        self.signals.catch()
        try:
            while self.step < cfg.train.steps:
                doing = f"at step {self.step + 1}"
                metrics = self.train_step()
                if self.should(cfg.train.val_every) and can_validate:
                    doing = f"while validating after step {self.step}"
                    metrics.update(self.evaluate())
                if writer:
                    writer.write(self.step, metrics, echo=self.should(cfg.metrics.log_every) or "loss/val" in metrics)
                    writer.advance(metrics["loss/train"])
                doing = f"while saving the checkpoint of step {self.step}"
                if any_rank(self.signals.signum is not None):
                    self.stop()
                self.commit_written()
                if self.interval is None:
                    self.choose_interval(metrics["time/step_s"])
                elif self.should(self.interval):
                    self.save()
            self.finish_saves()
            if self.unsaved is not None:  # on_save_error 'continue', and the last save failed too
                raise checkpoint.CheckpointSaveError(
                    f"the run trained to step {self.step} but its last checkpoint could not be saved "
                    f"({self.unsaved}); the newest saved one is in {self.ckpt_dir}, if any: free the space "
                    "and run again with --resume")
        except TrainingDiverged:
            self.finish_saves()  # every rank stops here together: keep the last good checkpoint
            raise
        except Exception as err:
            if self.world.distributed and is_comm_failure(err):
                step = self.step + 1 if doing.startswith("at step") else self.step
                raise collective_failure(err, self.world.rank, step, cfg.train.collective_timeout_s,
                                         self.board, self.comm_log, Path(cfg.run_dir), doing) from err
            raise
        finally:
            self.signals.release()
            if writer:
                writer.close()
        return metrics

    def stop(self) -> None:
        """A rank received SIGTERM or SIGUSR1: every rank saves this step's checkpoint and stops."""
        signum = self.signals.signum or signal.SIGTERM
        self.save()
        self.finish_saves()
        raise Stopped(signum, f"stopped by {signal.Signals(signum).name} after step {self.step}; "
                      f"checkpoint {checkpoint.step_dir(self.ckpt_dir, self.step)} saved: continue with "
                      "the same command and --resume")

    def choose_interval(self, step_s: float) -> None:
        """checkpoint.interval = "auto": time a real save now and space the next ones by Daly's
        interval for checkpoint.mtbf_hours (the same on every rank: rank 0's times decide)."""
        start = time.perf_counter()
        self.save()
        self.finish_saves()  # an asynchronous save costs the step it blocks, not just its copy
        times = torch.tensor([time.perf_counter() - start, step_s], dtype=torch.float64)
        if self.world.distributed:
            dist.broadcast(times, src=0)
        self.interval, reason = auto_interval(times[0].item(), times[1].item(), self.cfg.checkpoint.mtbf_hours)
        if self.world.rank == 0:
            log.info("%s", reason)
