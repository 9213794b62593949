"""A dry run of one rank of any layout, on this CPU, without the other ranks and without weights.

    gridtrain train --dry-run --world N --rank R [--config ...] [key=value ...]

Rank R of an N-rank job joins a fake process group (torch.distributed's "fake" backend: every
collective returns at once, moving nothing), builds the model on the meta device, splits and
shards it as the real run does (`parallelize`), gives its shards fake tensors (FakeTensorMode:
shapes, dtypes and byte sizes, no memory) and runs one training step through the Trainer's own
forward and backward (`forward_backward`), gradient clipping and optimizer step. What it measures
is the real run's accounting for that rank (StepAccount: bytes per memory bucket, collectives per
mesh axis) plus the peak tensor bytes (LiveBytes), and `gridtrain plan`'s prediction for the
same rank is set beside it (plan/check_run.py, as `gridtrain plan --check` does for a real run).

What a fake step cannot give: time (nothing is computed), and the values themselves (the loss,
the gradient norm): so no step time, and the loss scaler of fp16 is not exercised. The pipeline's
point-to-point sends are counted by the stage hooks, as on a real run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from gridtrain.compat import PIPELINE_STAGE_META
from gridtrain.config import Config, ConfigError
from gridtrain.layout.dims import ParallelDims
from gridtrain.model.stats import build_meta
from gridtrain.parallel.accounting import DispatchedCollectives
from gridtrain.parallel.data_parallel import all_reduce_as_ddp
from gridtrain.parallel.grads import clip_grad_norm, settle_partial_grads
from gridtrain.parallel.mesh import build_mesh, group
from gridtrain.parallel.parallelize import ParallelModel, parallelize
from gridtrain.rundir import RunRecord, differences, saved_record
from gridtrain.train.balance import set_loss_scale
from gridtrain.train.build import loss_fn
from gridtrain.train.dry_routing import balance_collectives, fix_routing
from gridtrain.train.live_bytes import LiveBytes
from gridtrain.train.optim import build_optimizer
from gridtrain.train.precision import Precision
from gridtrain.train.step_account import StepAccount
from gridtrain.train.trainer import forward_backward
from gridtrain.validate import validate

CPU = torch.device("cpu")


@dataclass
class DryRunResult:
    record: dict[str, float]  # the accounting record, as a real run's accounting/rank<r>.jsonl line
    run_dir: Path
    seconds: float


def dry_run(cfg: Config, world: int, rank: int) -> DryRunResult:
    """Run one step of rank `rank` of a `world`-rank job under a fake process group and fake
    tensors; write its run record and accounting line into cfg.run_dir."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dims = validate(cfg, world)
    check_dry_run(cfg, dims, rank)
    start = time.perf_counter()
    forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        record = _step(cfg, dims)
    finally:
        dist.destroy_process_group()
    run_dir = Path(cfg.run_dir)
    RunRecord(cfg, dims, "dry run (fake tensors)", torch.get_num_threads(), os.cpu_count(), None, "fake").write(run_dir)
    path = run_dir / "accounting" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": 1, "rank": rank, **dims.coordinates(rank), **record}) + "\n")
    return DryRunResult(record, run_dir, time.perf_counter() - start)


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions. They are keyed by device meshes, which compare
    by shape and axis names, not by rank: a process that dry-runs a second rank of the same layout
    (the tests do) got the first rank's meshes back from them, and collectives on its groups."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):
        torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()


def check_dry_run(cfg: Config, dims: ParallelDims, rank: int) -> None:
    """What a dry run refuses, before it starts: a rank outside the job, a run_dir that holds a
    real run or another job's dry run (its records would mix), and FP8, whose float8 gathers and
    amax all-reduces the planner's collectives do not model yet, and document masking under a
    pipeline (below). A mixture of experts is routed by a fixed balanced rule (dry_routing.py), its
    grouped matmul in bf16 only; with data.doc_mask each sequence holds DRY_DOCUMENTS documents."""
    problems = []
    if cfg.train.float8 != "none":
        problems.append(f"a dry run of train.float8 = '{cfg.train.float8}' would measure float8 gathers and scale "
                        "all-reduces the planner does not predict yet: dry-run the layout with train.float8 = 'none'")
    if cfg.data.doc_mask and dims.pp > 1:
        problems.append(f"a dry run of data.doc_mask under parallel.pp = {dims.pp} cannot mask: the pipeline schedule "
                        "cuts the document ids into micro-batches as fake tensors, whose values the mask reads: "
                        "dry-run the layout with data.doc_mask = false (the mask changes neither the memory nor "
                        "the collectives: the dry runs of one process, TP 2 and CP 2 measure the same bytes)")
    moe = cfg.model.args().moe
    if moe is not None and moe.grouped_mm and cfg.train.precision != "bf16":
        problems.append(f"a dry run of a mixture of experts in {cfg.train.precision} cannot run torch._grouped_mm on "
                        "fake tensors (its meta kernel takes bf16 only): dry-run it with train.precision = 'bf16', "
                        "or with model.moe.grouped_mm = false (the expert loop)")
    if not 0 <= rank < dims.world_size:
        problems.append(f"--rank {rank} is not a rank of a {dims.world_size}-rank job: give 0 to {dims.world_size - 1}")
    record = saved_record(Path(cfg.run_dir))
    if record is not None:
        if record.get("backend") != "fake":
            problems.append(f"run_dir {cfg.run_dir} holds a training run: give the dry run another --run_dir")
        elif differences(record.get("config", {}), cfg) or record.get("dims") != dataclasses.asdict(dims):
            problems.append(f"run_dir {cfg.run_dir} holds the dry run of another job: give another --run_dir "
                            "(ranks of the same job go into the same one)")
    if problems:
        raise ConfigError(problems)


def _step(cfg: Config, dims: ParallelDims) -> dict[str, float]:
    t = cfg.train
    mesh = build_mesh(dims, "cpu")
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the mesh's own (real) index tensors meet fake ones
    precision = Precision(t, CPU)
    local_batch, accum = cfg.local_batch(dims.dp), cfg.microbatches(dims.dp)
    micro_batches = accum * dims.dp * dims.cp  # the loss shares, as the Trainer divides them

    def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return precision.scaler.scale(loss_fn(logits, targets) / micro_batches)

    pmodel = parallelize(build_meta(cfg.model.args()), cfg, dims, mesh, pipeline_loss, accum, CPU, fake=fake)
    fix_routing(pmodel.parts)
    set_loss_scale(pmodel.parts, 1.0 / micro_batches)
    optimizers = [build_optimizer(part, t, mesh, cfg.parallel.zero_stage, dims.dp) for part in pmodel.parts]
    comm = DispatchedCollectives(mesh.axis_groups())
    account = StepAccount(True, pmodel, comm)
    vocab = cfg.model.args().vocab_size

    docs = dry_documents(cfg, local_batch)

    def read(first: int, n: int) -> tuple[torch.Tensor, ...]:
        shape = (n, cfg.data.seq_len // dims.cp)  # two storages, as the data reader gives them (CP: a rank's chunks)
        return torch.randint(0, vocab, shape), torch.randint(0, vocab, shape), *docs.get(n, ())

    precision.begin_step()  # outside the fake mode: fp16 reads its loss scale
    if pmodel.schedule is not None:
        with fake:
            give_stage_shapes(pmodel, t.micro_batch, cfg.data.seq_len // dims.cp, cfg.model.args().dim,
                              dims.tp if cfg.parallel.sequence_parallel else 1, read, precision.autocast)
    with fake, LiveBytes() as live, comm:
        live.track([pmodel.parameters(), [b for part in pmodel.parts for b in part.buffers()]])
        built = live.live
        with account.forward_backward():
            forward_backward(pmodel, read, 0, local_batch, t.micro_batch, micro_batches, precision, dims.tp, CPU)
        if pmodel.dry_ddp is not None:
            all_reduce_as_ddp(pmodel.parameters(), pmodel.dry_ddp)
        settle_partial_grads(pmodel.parameters())
        for opt in optimizers:  # fp16: the overflow flag's all-reduce, as the Trainer's step makes it
            precision.unscale_(opt, group(mesh, "world"))
        clip_grad_norm(pmodel.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"), group(mesh, "pp"))
        account.collectives_done()
        account.optimizer_begins()
        for opt in optimizers:
            opt.step()
        if cfg.model.args().moe is not None:  # the Trainer's balance step, inside the step's accounting
            data = [g for g in (group(mesh, axis) for axis in ("dp", "cp")) if g is not None]
            balance_collectives(pmodel.parts, data, cfg.model.args().n_layers, group(mesh, "pp"))
        record = account.finish(optimizers)
    record["memory/built_bytes"] = float(built)
    record["memory/peak_bytes"] = float(live.peak)
    return record


DRY_DOCUMENTS = 4
"""Documents per sequence in a dry run of data.doc_mask: equal ones, the last taking the remainder."""


def dry_documents(cfg: Config, local_batch: int) -> dict[int, tuple[torch.Tensor]]:
    """With data.doc_mask, each batch size's document ids (whole sequences, as with_documents gives
    them), real tensors made outside the fake mode: the model reads the documents' spans from them
    (Documents, which a fake tensor cannot answer). Empty without the mask."""
    if not cfg.data.doc_mask:
        return {}
    seq = cfg.data.seq_len
    row = torch.clamp(torch.arange(seq) // max(1, seq // DRY_DOCUMENTS), max=DRY_DOCUMENTS - 1)
    return {n: (row.expand(n, seq).clone(),) for n in {cfg.train.micro_batch, local_batch}}


def give_stage_shapes(pmodel: ParallelModel, micro_batch: int, seq_len: int, dim: int, seq_split: int,
                      read: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                      autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """torch's pipeline stages learn what they receive by asking their neighbours (and vote on it
    with a collective whose answer they read): a fake process group answers nothing. So each of
    this rank's stages is given its shapes as static metadata, found by running it on a fake
    micro-batch: token ids into the first stage, the fp32 residual stream (B x T x dim of the
    rank's T tokens, seq/cp under context parallelism; B x T/tp x dim with sequence parallelism)
    into the others; and the vote is skipped."""
    schedule = pmodel.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        x = read(0, micro_batch)[0] if stage.is_first else torch.empty(micro_batch, seq_len // seq_split, dim)
        with torch.no_grad(), autocast():  # as the step runs it (an MoE's grouped matmul has no fp32 meta kernel)
            y = stage.submod(x)
        # What the stage receives and sends is differentiable: its gradient travels back.
        x, y = (t if not t.is_floating_point() else t.detach().requires_grad_() for t in (x, y))
        if not PIPELINE_STAGE_META:  # torch < 2.13: set inputs skip shape inference, and nothing votes;
            with torch.no_grad(), autocast():  # the outputs are checked against the step's, dtype too
                y = stage.submod(x)
            stage.inputs_meta, stage._outputs_meta = (x,), None
            stage._configure_outputs_meta((y,))
            continue
        from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

        stage._user_meta = _StageMeta(inputs=extract_tensor_metas((x,)), outputs=extract_tensor_metas((y,)),
                                      input_grads=extract_tensor_metas((None if stage.is_first else x,), allow_none=True),
                                      output_grads=extract_tensor_metas((y,), allow_none=True))
    if not PIPELINE_STAGE_META:
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def static(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static

