"""Validation of a configuration: every relation checked once, before anything starts.

Each problem names the key, the numbers and the fix; all problems are reported together.
"""

from __future__ import annotations

import importlib.util
import math
import os

from gridtrain.config import Config, ConfigError
from gridtrain.layout.dims import ParallelDims, stage_layer_counts
from gridtrain.layout.experts import expert_data_parallel
from gridtrain.layout.schedules import RUNTIME_SCHEDULES, SCHEDULES
from gridtrain.model.args import PRESETS, ModelArgs
from gridtrain.names import FLOAT8, LR_SCHEDULES, PRECISIONS, RECOMPUTE
from gridtrain.validate_data import check_data
from gridtrain.validate_faults import check_fault_tolerance, check_resilience
from gridtrain.validate_rules import at_least as _at_least, choice as _choice, in_range as _in_range, shape_of


def model_problems(args: ModelArgs, seq_len: int | None = None) -> list[str]:
    """What `gridtrain train` refuses in a model shape (`gridtrain import` applies the same):
    its broken relations, and a rotary table too large to build. `seq_len`: data.seq_len, named
    in the advice."""
    problems = args.validate()
    if not problems and args.max_seq_len * args.head_dim // 2 * 8 > 2**30:  # complex64 per position and pair
        gib = args.max_seq_len * args.head_dim // 2 * 8 / 2**30
        given = f" (data.seq_len is {seq_len})" if seq_len is not None else ""
        problems.append(f"the rotary table, model.max_seq_len ({args.max_seq_len:,}) x head_dim / 2 "
                        f"({args.head_dim // 2:,}) complex numbers, would need {gib:,.1f} GiB per process: lower "
                        f"max_seq_len{given} or head_dim = model.dim / model.n_heads")
    return problems


def _check_model(cfg: Config) -> list[str]:
    if cfg.model.preset not in PRESETS:
        return [f"model.preset = '{cfg.model.preset}' is unknown; choose one of {', '.join(PRESETS)}"]
    try:
        args = cfg.model.args()
    except ValueError as err:
        return [str(err)]
    problems = model_problems(args, cfg.data.seq_len)
    if cfg.data.seq_len > args.max_seq_len:
        problems.append(
            f"data.seq_len ({cfg.data.seq_len}) is longer than the model's context "
            f"model.max_seq_len ({args.max_seq_len}): lower data.seq_len or raise model.max_seq_len")
    return problems


def _check_batch(cfg: Config, dp: int) -> list[str]:
    t, seq_len = cfg.train, cfg.data.seq_len
    problems = _at_least("train.micro_batch", t.micro_batch, 1) + _at_least("data.seq_len", seq_len, 1)
    if t.global_batch_tokens is not None:
        if t.global_batch_tokens <= 0 or seq_len <= 0 or t.global_batch_tokens % seq_len:
            return problems + [
                f"train.global_batch_tokens ({t.global_batch_tokens}) must be a positive multiple of "
                f"data.seq_len ({seq_len}): try {max(1, round(t.global_batch_tokens / max(seq_len, 1))) * seq_len}"]
    elif t.global_batch < 1:
        return problems + [f"train.global_batch = {t.global_batch} must be >= 1"]
    if problems:
        return problems
    per_step = t.micro_batch * dp
    if cfg.global_batch_seqs % per_step:
        fixed = max(1, round(cfg.global_batch_seqs / per_step)) * per_step
        return [f"train.global_batch ({cfg.global_batch_seqs} sequences) must be divisible by "
                f"train.micro_batch ({t.micro_batch}) x data-parallel degree ({dp}) = {per_step}: "
                f"set train.global_batch to {fixed} or choose a micro_batch that divides it"]
    return []


def _check_train(cfg: Config) -> list[str]:
    t = cfg.train
    problems = _at_least("train.steps", t.steps, 1)
    problems += [] if t.lr > 0 else [f"train.lr = {t.lr} must be > 0"]
    problems += _in_range("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0)
    if t.warmup_steps < 0 or (t.steps >= 1 and t.warmup_steps > t.steps):  # steps < 1 is reported alone
        problems.append(f"train.warmup_steps ({t.warmup_steps}) must lie in [0, train.steps "
                        f"({t.steps})]: lower train.warmup_steps or raise train.steps")
    problems += _choice("train.schedule", t.schedule, LR_SCHEDULES)
    if not 0 < t.decay_fraction <= 1:
        problems.append(f"train.decay_fraction = {t.decay_fraction} must lie in (0, 1]")
    problems += _at_least("train.weight_decay", t.weight_decay, 0.0)
    for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0 <= beta < 1:
            problems.append(f"{key} = {beta} must lie in [0, 1)")
    problems += [] if t.eps > 0 else [f"train.eps = {t.eps} must be > 0"]
    problems += _at_least("train.grad_clip", t.grad_clip, 0.0)
    problems += _choice("train.precision", t.precision, PRECISIONS)
    problems += [] if t.loss_scale_init > 0 else [f"train.loss_scale_init = {t.loss_scale_init} must be > 0"]
    problems += _at_least("train.loss_scale_growth_interval", t.loss_scale_growth_interval, 1)
    problems += _choice("train.recompute", t.recompute, RECOMPUTE)
    problems += _at_least("train.val_every", t.val_every, 0) + _at_least("train.val_batches", t.val_batches, 1)
    problems += _at_least("train.sample_tokens", t.sample_tokens, 0)
    if t.threads is not None:
        cores = os.cpu_count() or 1
        problems += _at_least("train.threads", t.threads, 1)
        if t.threads > cores:  # more threads than cores only slows a run; 100,000 crash OpenMP
            problems.append(f"train.threads = {t.threads} is more than this machine's {cores} CPUs: "
                            f"give at most {cores}")
    return problems


def world_size(cfg: Config) -> int:
    """Processes of the run: torchrun's WORLD_SIZE when launched by it, else parallel.nproc."""
    return int(os.environ.get("WORLD_SIZE", cfg.parallel.nproc))


def parallel_dims(cfg: Config, world: int | None = None) -> ParallelDims:
    p = cfg.parallel
    # Under fault tolerance each replica group is its own job: dp_replicate counts the jobs.
    dp_replicate = 1 if cfg.fault_tolerance.enabled else p.dp_replicate
    return ParallelDims.resolve(dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, p.ep,
                                world if world is not None else world_size(cfg), p.zero_stage)


def _check_tp(cfg: Config, tp: int) -> list[str]:
    if tp == 1 or shape_of(cfg) is None:
        if cfg.parallel.sequence_parallel and tp == 1:
            return ["parallel.sequence_parallel needs parallel.tp > 1: raise tp or turn it off"]
        return []
    args, problems = cfg.model.args(), []
    dense_layers = args.moe is None or args.moe.moe_layers(args.n_layers) < args.n_layers
    widths = (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("vocab_size", args.vocab_size))
    for key, value in widths + ((("ffn_dim", args.hidden_dim),) if dense_layers else ()):
        if value % tp:
            fits = [d for d in range(1, tp + 1) if value % d == 0 and d & (d - 1) == 0]
            problems.append(f"parallel.tp ({tp}) must divide model.{key} ({value}), since each "
                            f"tensor-parallel rank takes an equal share: set parallel.tp to {fits[-1]}")
    if args.qk_norm:
        problems.append(f"model.qk_norm normalises each head with one weight, which parallel.tp ({tp}) has not been "
                        "compared with one process beside (each rank would see its heads' share of its gradient): "
                        "set parallel.tp to 1, or model.qk_norm to false")
    if cfg.parallel.sequence_parallel and cfg.data.seq_len % tp:
        problems.append(f"parallel.sequence_parallel splits data.seq_len ({cfg.data.seq_len}) over "
                        f"parallel.tp ({tp}): make seq_len a multiple of {tp}")
    return problems


def _check_pp(cfg: Config, dims: ParallelDims) -> list[str]:
    p = cfg.parallel
    problems = _choice("parallel.pp_schedule", p.pp_schedule, RUNTIME_SCHEDULES)
    problems += _at_least("parallel.pp_virtual_stages", p.pp_virtual_stages, 1)
    if dims.pp == 1 or problems:
        return problems
    schedule = SCHEDULES[p.pp_schedule]
    if schedule.stages_per_rank == 1 and p.pp_virtual_stages != 1:
        problems.append(f"parallel.pp_schedule '{p.pp_schedule}' runs one stage per rank, but "
                        f"parallel.pp_virtual_stages = {p.pp_virtual_stages}: use 'interleaved-1f1b' "
                        "or set pp_virtual_stages to 1")
    if schedule.stages_per_rank == 2 and p.pp_virtual_stages != 2:
        problems.append(f"parallel.pp_schedule '{p.pp_schedule}' needs exactly 2 stages per rank: "
                        "set parallel.pp_virtual_stages to 2")
    if schedule.split_backward and cfg.train.recompute == "selective":
        problems.append(
            f"train.recompute 'selective' cannot run under parallel.pp_schedule "
            f"'{p.pp_schedule}': its backward passes each micro-batch twice (input gradients, then "
            "weight gradients), and torch's selective checkpointing allows one backward through a "
            "recomputed region; use recompute 'full' or 'none', or pp_schedule "
            "'interleaved-1f1b'")
    stages = dims.pp * p.pp_virtual_stages
    if shape_of(cfg) is not None:
        n_layers = cfg.model.args().n_layers
        counts = stage_layer_counts(n_layers, stages, p.pp_fewer_edge_layers)
        if min(counts) < 1:
            problems.append(
                f"model.n_layers ({n_layers}) is too few for parallel.pp ({dims.pp}) x "
                f"pp_virtual_stages ({p.pp_virtual_stages}) = {stages} stages with "
                f"pp_fewer_edge_layers {p.pp_fewer_edge_layers} (layers per stage {counts}): lower pp "
                "or the virtual stages, or add layers")
        if cfg.model.args().tie_embeddings:
            problems.append("model.tie_embeddings cannot be used with parallel.pp > 1: the embedding "
                            "and the output head live on different stages; untie them")
    if dims.dp >= 1 and cfg.global_batch_seqs % (cfg.train.micro_batch * dims.dp) == 0:
        micro = cfg.global_batch_seqs // (cfg.train.micro_batch * dims.dp)
        need = schedule.min_microbatches(stages)
        rounds = max(1, micro // dims.pp)
        if schedule.rounds_of_pp and micro % rounds:
            problems.append(f"parallel.pp_schedule '{p.pp_schedule}' runs micro-batches in {rounds} "
                            f"rounds, which must divide the micro-batches per step ({micro}): set "
                            f"train.global_batch to {rounds * dims.pp * cfg.train.micro_batch * dims.dp}")
        elif micro < need:
            problems.append(
                f"too few micro-batches for parallel.pp_schedule '{p.pp_schedule}': train.global_batch "
                f"({cfg.global_batch_seqs}) / (train.micro_batch ({cfg.train.micro_batch}) x data-parallel "
                f"degree ({dims.dp})) = {micro} < {need} stages: set train.global_batch to "
                f"{need * cfg.train.micro_batch * dims.dp} or lower train.micro_batch")
    return problems


def _check_parallel(cfg: Config, dims: ParallelDims) -> list[str]:
    p = cfg.parallel
    if p.dp_shard < 1 and p.dp_shard != -1:
        return [f"parallel.dp_shard = {p.dp_shard} must be >= 1, or -1 to fill the world with what the "
                "other degrees leave"]
    problems = dims.problems() + _at_least("parallel.nproc", p.nproc, 1)
    problems += _at_least("parallel.pp_fewer_edge_layers", p.pp_fewer_edge_layers, 0)
    if p.pp_fewer_edge_layers > 0 and dims.pp * p.pp_virtual_stages == 1:
        problems.append(f"parallel.pp_fewer_edge_layers = {p.pp_fewer_edge_layers} does nothing with one "
                        "pipeline stage: set parallel.pp > 1 or leave it 0")
    if p.zero_stage not in (0, 1, 2, 3):
        problems.append(f"parallel.zero_stage = {p.zero_stage} is not one of 0, 1, 2, 3")
    if problems:
        return problems
    if p.zero_stage in (0, 1) and dims.dp_shard > 1:
        problems.append(
            f"parallel.zero_stage {p.zero_stage} keeps a full copy on every data-parallel rank, but "
            f"parallel.dp_shard = {dims.dp_shard}: set parallel.dp_replicate to "
            f"{dims.dp_replicate * dims.dp_shard} and dp_shard to 1, or use zero_stage 2 or 3 to shard")
    if p.zero_stage == 1 and (dims.tp > 1 or dims.pp > 1):
        problems.append("parallel.zero_stage 1 shards a plain optimizer over DDP and does not combine "
                        "with tp or pp: use parallel.zero_stage 2 (gradients and optimizer sharded)")
    return problems + _check_tp(cfg, dims.tp) + _check_pp(cfg, dims) + _check_cp(cfg, dims)


def _check_cp(cfg: Config, dims: ParallelDims) -> list[str]:
    """Context parallelism: the split, and what it does not serve yet. It runs with FSDP/HSDP, TP
    (SP included), PP (every schedule) and recomputation: the layouts the parity tests cover."""
    p, t = cfg.parallel, cfg.train
    problems = _choice("parallel.cp_rotate", p.cp_rotate, ("ring", "allgather"))
    if dims.cp == 1 or problems:
        return problems
    chunks = 2 * dims.cp
    if cfg.data.seq_len % chunks:
        fit = max(chunks, cfg.data.seq_len // chunks * chunks)
        problems.append(f"parallel.cp ({dims.cp}) cuts each sequence into 2 x cp = {chunks} equal chunks, "
                        f"which data.seq_len ({cfg.data.seq_len}) does not divide: set data.seq_len to {fit}")
    if p.zero_stage not in (2, 3):
        # DDP and ZeRO-1 replicate over dp_replicate only; the CP ranks of a batch slice must also
        # sum their gradients, which FSDP does by sharding over dp_shard x cp.
        problems.append(f"parallel.cp ({dims.cp}) runs with FSDP, which shards over dp_shard x cp and sums "
                        f"the CP ranks' gradients; parallel.zero_stage {p.zero_stage} does not: set "
                        "parallel.zero_stage to 2 or 3 (dp_shard may stay 1), or parallel.cp to 1")
    if t.compile:
        problems.append(f"parallel.cp ({dims.cp}) attends through its own autograd function with sends inside, "
                        "which train.compile's whole-block graphs cannot hold: set train.compile to false, "
                        "or parallel.cp to 1")
    return problems


FLOAT8_DIM_MULTIPLE = 16
"""torch._scaled_mm's alignment, which torchao's float8 linears need: every dimension a multiple of 16
(gridtrain.parallel.float8 holds the same number; this module imports no torch)."""


def _check_float8(cfg: Config, dims: ParallelDims, installed: bool = True) -> list[str]:
    """FP8 (train.float8) where torchao can apply it, in a layout compared with one process."""
    t, recipe = cfg.train, cfg.train.float8
    if recipe == "none" or _choice("train.float8", recipe, FLOAT8):
        return _choice("train.float8", recipe, FLOAT8)
    problems = []
    if t.precision != "bf16":
        problems.append(f"train.float8 = '{recipe}' runs the block linears in float8 beside bf16 autocast, "
                        f"not beside train.precision = '{t.precision}': set train.precision = 'bf16'")
    if installed and importlib.util.find_spec("torchao") is None:
        problems.append(f"train.float8 = '{recipe}' needs torchao (its float8 training), which is not "
                        "installed: pip install 'gridtrain[fp8]', or set train.float8 = 'none'")
    if dims.pp > 1 or dims.cp > 1 or (cfg.parallel.zero_stage == 1 and dims.dp > 1):
        problems.append(f"train.float8 = '{recipe}' is compared with one process under DDP, ZeRO-2, FSDP and tensor "
                        f"parallelism only, not with parallel.pp ({dims.pp}), parallel.cp ({dims.cp}) or "
                        f"zero_stage 1: set those to 1 (zero_stage to 0, 2 or 3), or train.float8 = 'none'")
    elif dims.tp > 1 and dims.dp > 1 or dims.dp_replicate > 1 and dims.dp_shard > 1 and cfg.parallel.zero_stage >= 2:
        problems.append(f"train.float8 = '{recipe}' is compared with one process over one axis at a time (data "
                        f"parallelism, or tensor parallelism), not parallel.tp ({dims.tp}) beside data-parallel "
                        f"degree {dims.dp} or HSDP: use one of them, or train.float8 = 'none'")
    if t.compile:
        problems.append(f"train.float8 = '{recipe}' beside train.compile = true has not been compared with one "
                        "process (torchao's emulated float8 is not compiled here): set train.compile = false, "
                        "or train.float8 = 'none'")
    if shape_of(cfg) is not None and not model_problems(cfg.model.args()):
        problems += _float8_shape_problems(cfg.model.args(), dims.tp)
    return problems


def _float8_shape_problems(args: ModelArgs, tp: int) -> list[str]:
    """Each block linear's dimensions, per tensor-parallel rank, must be multiples of 16."""
    m, problems = FLOAT8_DIM_MULTIPLE, []
    for key, width in (("dim", args.dim), ("n_kv_heads x head_dim", args.n_kv_heads * args.head_dim),
                       ("n_heads x head_dim", args.n_heads * args.head_dim), ("ffn_dim", args.hidden_dim)):
        if (width // tp) % m:
            per_rank = f" / parallel.tp ({tp}) = {width // tp}" if tp > 1 else ""
            problems.append(f"train.float8 multiplies in float8, which needs every dimension of the block "
                            f"linears a multiple of {m}, and model.{key} = {width}{per_rank} is not: make it "
                            f"a multiple of {m * tp}, or set train.float8 = 'none'")
    return problems


def _check_moe(cfg: Config, dims: ParallelDims) -> list[str]:
    """A mixture-of-experts model where it has been compared with one process: one process, data
    parallelism (DDP, ZeRO-2, FSDP, HSDP), tensor parallelism (experts replicated over it), pipelines,
    context parallelism, and expert parallelism over every data- and context-parallel rank or a
    divisor of them, beside each of those (tests/test_moe_parallel.py); expert parallelism only for
    a mixture of experts."""
    args, p = shape_of(cfg), cfg.parallel
    if args is None or args.moe is None:
        if dims.ep > 1 and args is not None:
            return [f"parallel.ep ({dims.ep}) shards the routed experts of a mixture of experts, and model.preset "
                    f"'{cfg.model.preset}' is dense: use a mixture-of-experts preset, or set parallel.ep to 1"]
        return []
    problems, name = [], f"model.preset '{cfg.model.preset}' (a mixture of experts)"
    if p.zero_stage == 1 and dims.dp > 1:
        problems.append(f"{name} is not compared under parallel.zero_stage 1: use 0 (DDP), 2 or 3")
    if args.moe.capacity_factor is not None and dims.cp > 1:
        problems.append(f"model.moe.capacity_factor ({args.moe.capacity_factor}) keeps each expert's first tokens of "
                        f"a micro-batch, which parallel.cp ({dims.cp}) splits over its ranks: leave capacity_factor "
                        "unset (dropless), or set parallel.cp to 1")
    if dims.ep > 1:
        if args.moe.num_experts % dims.ep:
            problems.append(f"parallel.ep ({dims.ep}) must divide model.moe.num_experts ({args.moe.num_experts}), "
                            f"since each rank holds an equal share of the experts: set parallel.ep to a divisor of "
                            f"{args.moe.num_experts}")
        problems += _check_expert_shards(cfg, dims, args.moe.num_experts)
    if cfg.data.doc_mask and cfg.train.precision == "fp16" and math.prod(dims.degrees.values()) > 1:
        # parity cases zero3.none.none.tied.fp16.full.one.none.moe.ep.doc_mask and none.none.none.tied.fp16.none.
        # many.cp.moe.ep.doc_restart: one token of the first step took another expert than in one process
        problems.append(f"data.doc_mask beside {name} in fp16 is not compared over several ranks: fp16's rounding, "
                        "which differs by layout, moved a token to another expert at a near-tie of the router, a "
                        "difference the parity check cannot tell from an error: use train.precision bf16 or fp32, or "
                        "data.doc_mask = false")
    if cfg.train.compile:
        problems.append(f"{name} routes tokens to experts in data-dependent groups, which train.compile has not "
                        "been compared with: set train.compile = false")
    if cfg.train.float8 != "none":
        problems.append(f"train.float8 = '{cfg.train.float8}' converts the dense linears only, not the stacked "
                        f"experts of {name}: set train.float8 = 'none'")
    return problems


def _check_expert_shards(cfg: Config, dims: ParallelDims, num_experts: int) -> list[str]:
    """FSDP splits each expert weight's dimension 1 (w1 and w3: ffn, w2: dim) over the ranks that hold
    the same experts (gridtrain.layout.experts), evenly or not at all."""
    _, shard = expert_data_parallel(dims, cfg.parallel.zero_stage)
    args = shape_of(cfg)
    widths = {"moe.expert_ffn_dim": args.moe.expert_ffn_dim, "dim": args.dim}
    return [f"model.{key} ({width}) must be a multiple of the {shard} ranks that FSDP shards each expert over "
            f"(dp_shard x cp / ep = {dims.dp_shard} x {dims.cp} / {dims.ep}), which split its dimension 1: set "
            f"model.{key} to a multiple of {shard}, or parallel.ep to {dims.dp_shard * dims.cp}"
            for key, width in widths.items() if shard > 1 and width % shard]


def validate(cfg: Config, world: int | None = None, installed: bool = True) -> ParallelDims:
    """Raise ConfigError listing every broken relation; return the resolved layout. `installed`:
    also what this Python must have installed to run it (torchao for FP8); the planner, which may
    plan on a machine other than the one that trains, leaves it out."""
    dims = parallel_dims(cfg, world)
    problems = _check_model(cfg) + _check_parallel(cfg, dims)
    problems += _check_batch(cfg, max(dims.dp, 1)) + _check_train(cfg) + check_data(cfg)
    problems += check_resilience(cfg, dims) + _check_float8(cfg, dims, installed) + _check_moe(cfg, dims)
    problems += check_fault_tolerance(cfg, dims, installed)
    problems += _at_least("metrics.log_every", cfg.metrics.log_every, 1)
    if not str(cfg.run_dir).strip():
        problems.append("run_dir is empty (it would write into the current directory): give --run_dir DIR")
    if problems:
        raise ConfigError(problems)
    return dims
