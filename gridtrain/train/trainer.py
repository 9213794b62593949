"""The training loop: data, model, optimizer, precision, accumulation, validation, checkpoints.

One optimizer step reads the global batch [step * B, (step + 1) * B) of the deterministic sample
order; each data-parallel rank reads its slice in `accum` micro-batches of `micro_batch`
sequences. Each micro-batch's loss is divided by the number of micro-batches in the whole global
batch (accum x data-parallel degree) and data parallelism sums the gradients, so the gradient is
that of the mean loss over the global batch, and every micro-batch's backward runs at the scale
one process gives it: in fp16 the same values overflow whatever the layout.

The Trainer runs the step; it delegates the checkpoint policy (`Checkpointer`), the accounting
of a step (`Accountant`), validation (`Evaluator`) and the run's record (`rundir.RunRecord`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from gridtrain.config import Config
from gridtrain.model.stats import build_meta, count_parameters, flops_per_token
from gridtrain.parallel.accounting import CollectiveLog
from gridtrain.parallel.parallelize import ParallelModel, parallelize
from gridtrain.parallel.data_parallel import set_gradient_sync
from gridtrain.parallel.float8 import precompute_scales
from gridtrain.parallel.grads import clip_grad_norm, settle_partial_grads
from gridtrain.parallel.mesh import build_mesh, group
from gridtrain.parallel.tensor_parallel import loss_context
from gridtrain.rundir import OWN, RunRecord, job_id
from gridtrain.runlock import job_dirs
from gridtrain.train.balance import balance_step, reset_routing, set_loss_scale
from gridtrain.train.build import Batch, build_data, loss_fn, restart_positions, scalar, with_documents
from gridtrain.train.calibrate import cpu_peak_flops, peak_flops
from gridtrain.checkpoint.state import InvalidCheckpointError
from gridtrain.checkpoint.checkpointer import Checkpointer
from gridtrain.train.device import device_name, memory_gib
from gridtrain.train.distributed import any_rank, init_world
from gridtrain.train.jobstart import agree_on_run_dir, hold_run_dir
from gridtrain.train.evaluate import Evaluator
from gridtrain.train.metrics import MetricsWriter
from gridtrain.train.optim import build_optimizer, lr_at, set_lr
from gridtrain.train.precision import Precision
from gridtrain.train.resilience import (Guard, ProgressBoard, TrainingDiverged, collective_failure, inject_fault,
                                        is_comm_failure, set_timeouts, slow_down)
from gridtrain.train.step_account import Accountant
from gridtrain.train.stragglers import StragglerWatch
from gridtrain.train.units import run_summary
from gridtrain.validate import validate

log = logging.getLogger("gridtrain")


@dataclass(frozen=True)
class Phase:
    """Where the loop is, for the error a failed collective raises: `step` is the last step any
    rank may have started."""

    step: int
    doing: str


def forward_backward(pmodel: ParallelModel, read: Callable[[int, int], Batch],
                     first: int, local_batch: int, micro_batch: int, micro_batches: int, precision: Precision,
                     tp: int, device: torch.device) -> torch.Tensor:
    """Forward and backward over `local_batch` sequences from sample `first` (`read(first, n)` gives
    inputs and targets, and with data.doc_mask their document ids), in micro-batches of
    `micro_batch` (a pipeline's schedule splits them itself), each loss divided by the global
    batch's `micro_batches`; returns this rank's share of the global batch's mean loss (zero on
    pipeline ranks without the last stage). The caller has begun the step's precision
    (`Precision.begin_step`)."""
    if pmodel.schedule is not None:
        inputs, targets, *docs = read(first, local_batch)
        losses: list[torch.Tensor] = []
        with precision.autocast(), loss_context(tp):
            pmodel.schedule.step(inputs.to(device), target=targets.to(device), losses=losses, return_outputs=False,
                                 **{"doc_ids": d.to(device) for d in docs})
        if not losses:
            return torch.zeros((), device=device)
        return sum(scalar(l).detach() for l in losses) / precision.step_scale
    model, accum = pmodel.parts[0], local_batch // micro_batch
    loss_sum = torch.zeros((), device=device)
    for micro in range(accum):
        set_gradient_sync(model, micro == accum - 1)
        inputs, targets, *docs = read(first + micro * micro_batch, micro_batch)
        with loss_context(tp):
            with precision.autocast():
                logits = model(inputs.to(device), *(d.to(device) for d in docs))
            loss = loss_fn(logits, targets.to(device)) / micro_batches
            precision.backward(loss)
        loss_sum += scalar(loss).detach()
    return loss_sum


class Trainer:
    """Trains one rank's share of the run: any layout of ParallelDims, or a world of one."""

    def __init__(self, cfg: Config) -> None:
        self.dims = validate(cfg)  # before any process group exists
        # Start-up (data preparation on rank 0, the first checkpoint load) may take longer than
        # a training collective should: the run's own timeout is set once it is built.
        self.world = init_world(max(1800.0, cfg.train.collective_timeout_s))
        self.locks = hold_run_dir(job_dirs(cfg), self.world.rank)
        try:
            self.decision, restarted = agree_on_run_dir(cfg, self.world.rank)
            # A restart continues the job's own run, and its injected fault does not fire again.
            self.restarted = restarted or self.decision == OWN
            self.build(cfg)
        except BaseException:
            self.release()  # a start that fails lets the directory go at once
            raise

    def release(self) -> None:
        """Let the run directory go (every save is committed or abandoned)."""
        for lock in self.locks:
            lock.release()

    def build(self, cfg: Config) -> None:
        """Everything of the run but its process group and lock: data, model, optimizer, the
        components, and the resumed state."""
        self.cfg, t = cfg, cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = self.world.device
        self.mesh = build_mesh(self.dims, self.device.type) if self.world.distributed else None
        self.coords = self.dims.coordinates(self.world.rank)
        self.data = build_data(cfg, self.world)
        self.global_batch = cfg.global_batch_seqs
        self.local_batch = cfg.local_batch(self.dims.dp)
        self.accum = cfg.microbatches(self.dims.dp)
        self.micro_batches = self.accum * self.dims.dp  # in the global batch
        # Each loss is a mean over a micro-batch's tokens on this rank, a 1/cp part of them under
        # context parallelism: the global batch's mean is the sum of the shares, each divided by this.
        self.loss_shares = self.micro_batches * self.dims.cp
        self.dp_index = self.coords["dp"]  # among the data-parallel ranks of the step
        self.read = self.data.train.read
        if cfg.data.doc_mask:
            self.read = with_documents(self.read, self.data.eos_id)
        if self.dims.cp > 1:
            from gridtrain.parallel.context_parallel import split_reader

            self.read = split_reader(self.read, self.coords["cp"], self.dims.cp)
        self.read = self.data.timed(self.read)  # the step's wait for data, in its metrics
        self.args = cfg.model.args()
        full = build_meta(self.args)  # parallelize gives each rank memory for its shards only
        counts = count_parameters(full)
        self.num_params = counts.total
        # With data.doc_mask attention works inside documents: MFU counts those FLOPs (plan/documents.py).
        span = self.data.attention_span(cfg.data.seq_len) if cfg.data.doc_mask else None
        self.flops_per_token = flops_per_token(self.args, cfg.data.seq_len, counts, span)
        self.precision = Precision(t, self.device)
        self.pmodel = parallelize(full, cfg, self.dims if self.world.distributed else None, self.mesh,
                                  self.pipeline_loss, self.accum, self.device)
        self.model = self.pmodel.parts[0]
        restart_positions(self.pmodel.parts, cfg.data.doc_positions == "restart")
        self.evaluate = Evaluator(cfg, self.data, self.pmodel, self.precision, self.accum, self.micro_batches,
                                  self.dims.tp, group(self.mesh, "pp"), self.device, group(self.mesh, "cp"))
        self.optimizers = [build_optimizer(part, t, self.mesh, cfg.parallel.zero_stage, self.dims.dp)
                           for part in self.pmodel.parts]
        self.optimizer = self.optimizers[0]
        self.peak = peak_flops(self.device, device_name(self.device), t.precision)
        self.peak_remeasured = False
        self.step = 0
        self.is_writer = (self.coords["dp"] == 0 and self.coords["tp"] == 0 and self.coords["cp"] == 0
                          and self.pmodel.has_last_stage)
        self.comm_log = CollectiveLog(self.mesh.axis_groups()) if self.mesh else None
        self.accountant = Accountant(cfg.metrics.account_every, Path(cfg.run_dir), self.world.rank, self.coords,
                                     self.pmodel, self.comm_log)
        self.guard = Guard(t.max_bad_steps, t.spike_zscore)
        self.stragglers = StragglerWatch(cfg.metrics.straggler_every, self.world.rank, self.world.world_size)
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.checkpoint_dir, self.pmodel.parts, self.optimizers,
                                         self.trainer_state, self.world.distributed, self.world.rank)
        if cfg.checkpoint.resume or self.decision == OWN:
            if self.decision == OWN and self.world.rank == 0:
                log.warning("torchrun restarted the run: resuming from the newest intact checkpoint (job %s "
                            "trains into %s)", job_id() or "of the default --rdzv-id", cfg.run_dir)
            self.resume()
        self.ft = None
        if cfg.fault_tolerance.enabled:
            from gridtrain.train.ft import ReplicaGroups

            self.ft = ReplicaGroups(cfg, self.world.rank, self.world.world_size)
            self.ft.register(self.model, self.optimizer, self.step, self.trainer_state, self.load_trainer_state)
        self.board = None
        if self.mesh:
            set_timeouts(list(self.mesh.axis_groups().values()), t.collective_timeout_s)
            self.board = ProgressBoard(self.world.rank, self.world.world_size)

    # -- state -------------------------------------------------------------------------------

    def trainer_state(self) -> dict[str, torch.Tensor]:
        """Everything besides model and optimizer that an exact resume needs, as tensors."""
        return {"step": torch.tensor(self.step), "samples": torch.tensor(self.step * self.global_batch),
                "rng": torch.get_rng_state(), **self.precision.state_dict(),
                **self.data.position(self.step * self.global_batch)}

    def load_trainer_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take a live replica group's step, RNG and precision state (fault tolerance's rejoin)."""
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])
        self.precision.load_state_dict(state)

    def split_batch(self, live: int, rank: int) -> None:
        """The step's global batch among `live` replica groups of dp ranks, this group `rank`-th
        (fault tolerance: the split follows the quorum)."""
        dp = live * self.dims.dp
        self.dp_index = rank * self.dims.dp + self.coords["dp"]
        self.local_batch = self.global_batch // dp
        self.accum = self.local_batch // self.cfg.train.micro_batch
        self.micro_batches = self.accum * dp
        self.loss_shares = self.micro_batches * self.dims.cp

    def save(self) -> Path | None:
        """Save this step's checkpoint (Checkpointer.save)."""
        return self.checkpointer.save(self.step)

    def resume(self) -> None:
        found = self.checkpointer.resume()
        if found is None:
            return
        path, state = found
        self.step, samples = int(state["step"]), int(state["samples"])
        if self.step != int(path.name.removeprefix("step-")):
            raise InvalidCheckpointError(f"checkpoint {path} holds the state of step {self.step}, not of the step "
                                         "its name says: it was altered; move it aside to resume from the one before")
        if samples != self.step * self.global_batch:
            raise InvalidCheckpointError(
                f"checkpoint {path} consumed {samples} samples in {self.step} steps, which is not {self.step} x "
                f"train.global_batch ({self.global_batch}): resume with the global batch the run was saved with")
        self.data.check_position(state, samples, path)
        torch.set_rng_state(state["rng"])
        self.precision.load_state_dict(state)
        if self.world.rank == 0:
            log.info("resumed from %s at step %d (sample offset %d)", path, self.step, samples)

    # -- one step ----------------------------------------------------------------------------

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of one pipeline micro-batch, divided by the micro-batches of the global batch and
        scaled for fp16 (what its backward starts from)."""
        return self.precision.scaler.scale(loss_fn(logits, targets) / self.loss_shares)

    def forward_backward(self) -> torch.Tensor:
        """Forward and backward over this rank's slice of the step's global batch; returns its share
        of the global batch's mean loss (zero on pipeline ranks without the last stage)."""
        first = self.step * self.global_batch + self.dp_index * self.local_batch
        return forward_backward(self.pmodel, self.read, first, self.local_batch, self.cfg.train.micro_batch,
                                self.loss_shares, self.precision, self.dims.tp, self.device)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the global batch; returns its metrics."""
        if self.ft:
            quorum = self.ft.begin_step(lambda: self.step)  # a rejoining group takes the live step here
            self.split_batch(quorum.live, quorum.rank)
        inject_fault(self.cfg.fault, self.world.rank, self.step + 1, self.restarted)
        if self.board:
            self.board.post(self.step + 1)
        t, start, cpu_start = self.cfg.train, time.perf_counter(), time.process_time()
        lr = lr_at(self.step, t)
        for opt in self.optimizers:
            set_lr(opt, lr)
        account = self.accountant.step(self.step)
        self.precision.begin_step()
        set_loss_scale(self.pmodel.parts, self.precision.step_scale / self.loss_shares)
        with account.forward_backward():
            loss = self.forward_backward()
        slow_down(self.cfg.fault, self.world.rank, self.step + 1, time.process_time() - cpu_start)
        if self.cfg.fault.pause_s and 0 < self.cfg.fault.at_step <= self.step + 1:
            time.sleep(self.cfg.fault.pause_s)
        settle_partial_grads(self.pmodel.parameters())
        for opt in self.optimizers:
            self.precision.unscale_(opt, group(self.mesh, "world"))
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(self.pmodel.parameters(), max_norm, group(self.mesh, "pp")).item()
        account.collectives_done()
        # The global mean loss and norm: every rank sees the same values, so all decide alike.
        loss_value, reporting = self.reduce_loss(loss)
        if self.ft and not self.ft.commit(self.step + 1):
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            reset_routing(self.pmodel.parts)  # (validate refuses fault tolerance beside MoE today)
            return self.train_step()  # a group died inside the step: the live ones run it again
        account.optimizer_begins(reporting)
        # fp16's scaler skips overflowing steps itself (and lowers the scale): the guard sees the loss.
        if self.guard.admit(self.step + 1, loss_value, 0.0 if t.precision == "fp16" else grad_norm):
            stepped = self.precision.step(self.optimizers)
            if stepped and t.float8 == "tensorwise" and self.world.distributed:
                precompute_scales(self.pmodel.parts)  # for FSDP's float8 all-gather: parallel/float8.py
        else:
            stepped = False
            self.precision.skip()
        balance = {} if self.args.moe is None else balance_step(
            self.pmodel.parts, self.data_groups(), self.loss_shares, stepped, self.args.n_layers, group(self.mesh, "pp"))
        accounting = account.finish(self.optimizers)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.step += 1
        self.accountant.write(self.step, accounting)
        stragglers = self.stragglers.observe(self.step, time.process_time() - cpu_start)
        return {**stragglers, "loss/train": loss_value, "grad/norm": grad_norm, "lr": lr, **self.speed(time.perf_counter() - start),
                "optim/skipped_steps": float(not stepped), **self.guard.metrics(), **memory_gib(self.device),
                **accounting, **self.precision.metrics(), **balance, **self.data.metrics(self.step * self.global_batch)}

    def data_groups(self) -> list[dist.ProcessGroup]:
        """The groups over which ranks see different tokens of the same layers: data and context
        parallelism (tensor-parallel ranks route the same tokens; pipeline stages hold other layers)."""
        return [g for g in (group(self.mesh, axis) for axis in ("dp", "cp")) if g is not None]

    def speed(self, seconds: float) -> dict[str, float]:
        tokens_per_s = self.global_batch * self.cfg.data.seq_len / seconds
        achieved = self.flops_per_token * tokens_per_s
        mfu = 100 * achieved / (self.peak * self.world.world_size)
        if mfu > 100 and self.device.type == "cpu" and not self.peak_remeasured:
            # No run computes faster than the peak: the cached one was measured on a busy machine.
            self.peak_remeasured = True
            log.warning("MFU %.0f%% against the cached peak of %.1f GFLOP/s: that peak was measured low (on a "
                        "busy machine?); measuring it again", mfu, self.peak / 1e9)
            self.peak = cpu_peak_flops(self.cfg.train.precision, remeasure=True)
            mfu = 100 * achieved / (self.peak * self.world.world_size)
        return {"throughput/tokens_per_s": tokens_per_s, "time/step_s": seconds, "mfu_pct": mfu,
                "flops/achieved_TFLOPs": achieved / 1e12}

    def reduce_loss(self, loss: torch.Tensor) -> tuple[float, int]:
        """The global batch's mean loss: the ranks' shares summed over data and context
        parallelism, taken from the last pipeline stage; and how many collectives that took."""
        groups = [g for g in (group(self.mesh, axis) for axis in ("pp", "dp", "cp")) if g is not None]
        for axis_group in groups:
            dist.all_reduce(loss, group=axis_group)
        if self.ft:
            self.ft.all_reduce_sum(loss)
        return loss.item(), len(groups)

    # -- the run -----------------------------------------------------------------------------

    def write_record(self) -> None:
        RunRecord(self.cfg, self.dims, device_name(self.device), torch.get_num_threads(), os.cpu_count(),
                  self.peak, "gloo" if self.device.type == "cpu" else "nccl", job_id()).write(Path(self.cfg.run_dir))

    def should(self, interval: int) -> bool:
        return interval > 0 and (self.step % interval == 0 or self.step == self.cfg.train.steps)

    def stop_if_signalled(self) -> None:
        """After a step: when any rank has received SIGTERM or SIGUSR1, every rank saves this step's
        checkpoint and stops (raises Stopped)."""
        if any_rank(self.checkpointer.signals.signum is not None):
            self.checkpointer.stop(self.step)

    def run(self) -> dict[str, float]:
        """Train to `train.steps`; returns the last step's metrics (with validation if run)."""
        cfg, checkpointer = self.cfg, self.checkpointer
        if self.world.rank == 0:
            log.info("%s", run_summary(cfg, self.dims, self.world.num_nodes, self.num_params, self.flops_per_token,
                                       self.data.tokens, self.device, self.peak))
            self.write_record()
        writer = MetricsWriter(Path(cfg.run_dir), cfg.train.steps, self.step, cfg.metrics.tensorboard,
                               cfg.metrics.progress) if self.is_writer else None
        metrics: dict[str, float] = {}
        can_validate = self.data.val is not None
        if self.step == 0 and can_validate:
            val = self.evaluate()
            if writer:
                writer.write(0, val)
        phase = Phase(self.step, "during start-up")
        checkpointer.signals.catch()
        try:
            while self.step < cfg.train.steps:
                phase = Phase(self.step + 1, f"at step {self.step + 1}")
                metrics = self.train_step()
                if self.should(cfg.train.val_every) and can_validate:
                    phase = Phase(self.step, f"while validating after step {self.step}")
                    metrics.update(self.evaluate())
                if writer:
                    writer.write(self.step, metrics, echo=self.should(cfg.metrics.log_every) or "loss/val" in metrics)
                    writer.advance(metrics["loss/train"])
                phase = Phase(self.step, f"after step {self.step} (its stop-signal check or checkpoint save)")
                self.stop_if_signalled()
                checkpointer.after_step(self.step, cfg.train.steps, metrics["time/step_s"])
            checkpointer.check_last_saved(self.step)
        except TrainingDiverged:
            checkpointer.finish()  # every rank stops here together: keep the last good checkpoint
            raise
        except Exception as err:
            if self.world.distributed and is_comm_failure(err):
                raise collective_failure(err, self.world.rank, phase.step, cfg.train.collective_timeout_s,
                                         self.board, self.comm_log, Path(cfg.run_dir), phase.doing) from err
            raise
        finally:
            checkpointer.signals.release()
            if self.ft:
                self.ft.shutdown()
            if writer:
                writer.close()
            self.release()
        return metrics
