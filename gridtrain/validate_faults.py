"""Validation of what keeps a run alive: checkpoint cadence and policy, guards, timeouts, fault
injection, and torchft's fault-tolerant replica groups."""

from __future__ import annotations

import importlib.util
import math

from gridtrain.config import Config
from gridtrain.layout.dims import ParallelDims
from gridtrain.names import ON_SAVE_ERROR
from gridtrain.validate_rules import at_least as _at_least, choice as _choice, shape_of


def check_resilience(cfg: Config, dims: ParallelDims) -> list[str]:
    """Checkpoint cadence and policy, guards, timeouts and fault injection."""
    c, t, f = cfg.checkpoint, cfg.train, cfg.fault
    if isinstance(c.interval, str):
        problems = [] if c.interval == "auto" else [
            f"checkpoint.interval = '{c.interval}' is neither a number of steps nor 'auto'"]
    else:
        problems = _at_least("checkpoint.interval", c.interval, 0)
    problems += _at_least("checkpoint.keep", c.keep, 1) + _choice("checkpoint.on_save_error", c.on_save_error,
                                                                  ON_SAVE_ERROR)
    if c.timeout_s <= 0:
        problems.append(f"checkpoint.timeout_s = {c.timeout_s} must be > 0")
    if c.mtbf_hours <= 0:
        problems.append(f"checkpoint.mtbf_hours = {c.mtbf_hours} must be > 0")
    if not 0 <= c.signal_grace_s < math.inf:
        problems.append(f"checkpoint.signal_grace_s = {c.signal_grace_s} must be a number of seconds >= 0 "
                        "(0: exit at once on SIGTERM)")
    if t.collective_timeout_s <= 0:
        problems.append(f"train.collective_timeout_s = {t.collective_timeout_s} must be > 0")
    problems += _at_least("train.max_bad_steps", t.max_bad_steps, 1) + _at_least("train.spike_zscore", t.spike_zscore, 0)
    problems += _at_least("metrics.straggler_every", cfg.metrics.straggler_every, 0)
    if not 1 <= f.slow_factor < math.inf:
        problems.append(f"fault.slow_factor = {f.slow_factor} must be >= 1 (2: half speed)")
    for key, rank in (("fault.kill_rank", f.kill_rank), ("fault.hang_rank", f.hang_rank),
                      ("fault.slow_rank", f.slow_rank)):
        if rank != -1 and not 0 <= rank < dims.world_size:
            problems.append(f"{key} = {rank} is not a rank of this world (0..{dims.world_size - 1}): "
                            f"pick one of them, or -1 for none")
        elif rank != -1 and not 0 < f.at_step <= t.steps:
            problems.append(f"{key} = {rank} needs fault.at_step in [1, train.steps ({t.steps})], "
                            f"not {f.at_step}")
    return problems


def check_fault_tolerance(cfg: Config, dims: ParallelDims, installed: bool = True) -> list[str]:
    """torchft replica groups: parallel.dp_replicate jobs of HSDP's shard axis, met at a lighthouse."""
    ft, p, groups = cfg.fault_tolerance, cfg.parallel, cfg.parallel.dp_replicate
    if not 0 <= cfg.fault.pause_s < math.inf:
        return [f"fault.pause_s = {cfg.fault.pause_s} must be a number of seconds >= 0 (0: never)"]
    if not ft.enabled:
        return []
    if installed and importlib.util.find_spec("torchft") is None:
        return ["fault_tolerance.enabled needs torchft, which is not installed: pip install 'gridtrain[ft]'"]
    if not ft.lighthouse.strip():
        return ["fault_tolerance.enabled needs fault_tolerance.lighthouse, the address of a running "
                "torchft_lighthouse (e.g. http://127.0.0.1:29510)"]
    if groups < 2:
        return [f"fault_tolerance.enabled needs parallel.dp_replicate >= 2 replica groups, not {groups}"]
    if not 0 <= ft.replica_group < groups:
        return [f"fault_tolerance.replica_group = {ft.replica_group} is not one of the parallel.dp_replicate "
                f"({groups}) replica groups: pick 0..{groups - 1}"]
    if not 1 <= ft.min_replicas <= groups:
        return [f"fault_tolerance.min_replicas = {ft.min_replicas} must be in [1, parallel.dp_replicate ({groups})]"]
    if ft.quorum_timeout_s <= 0 or ft.timeout_s <= 0:
        return [f"fault_tolerance.quorum_timeout_s ({ft.quorum_timeout_s}) and timeout_s ({ft.timeout_s}) must be > 0"]
    if p.zero_stage < 2:
        return [f"fault_tolerance replica groups run FSDP inside each group (parallel.zero_stage 2 or 3), not "
                f"zero_stage {p.zero_stage}: torchft's DDP wrapper fails the survivor when a peer dies inside "
                "its all-reduce; set parallel.zero_stage to 2"]
    if dims.dp < 2:
        return [f"fault_tolerance needs FSDP inside each replica group, over parallel.dp_shard >= 2 processes, not "
                f"{dims.dp} (its all-reduce hook carries the gradients across groups): set parallel.dp_shard to 2"]
    shape = shape_of(cfg)
    moe = shape is not None and shape.moe is not None
    if dims.tp * dims.cp * dims.pp * dims.ep > 1 or moe or cfg.train.precision == "fp16":
        return [f"fault_tolerance runs dense models (moe: {moe}) over data parallelism (tp {dims.tp}, cp {dims.cp}, "
                f"pp {dims.pp}, ep {dims.ep}) in fp32 or bf16 (not {cfg.train.precision}) only: other layouts are not "
                "compared with one process yet; use a dense model, degrees 1 and fp32 or bf16"]
    for live in range(ft.min_replicas, groups + 1):
        per_step = live * dims.dp * cfg.train.micro_batch
        if cfg.global_batch_seqs % per_step:
            return [f"train.global_batch ({cfg.global_batch_seqs} sequences) must be divisible by {live} live replica "
                    f"groups x dp_shard ({dims.dp}) x train.micro_batch ({cfg.train.micro_batch}) = {per_step}, for "
                    f"every live count from fault_tolerance.min_replicas ({ft.min_replicas}) to {groups}: set it "
                    f"to a multiple of {math.lcm(*range(ft.min_replicas, groups + 1)) * dims.dp * cfg.train.micro_batch}"]
    return []
