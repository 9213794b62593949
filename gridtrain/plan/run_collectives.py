"""The collectives of a gridtrain run as its accounting logs them, per mesh axis, step and rank:
the planner's side of `gridtrain plan --check` for communication (check_run.py sets them beside
the measured bytes) and the dry run's.

Exact for the layouts predict_collectives lists; every other layout composes each axis's
traffic over the rank's own stages (estimate_collectives). Context parallelism's traffic is
exact in both: the ring's sends (or the all-gather and all-to-all) follow from the KV bytes
(comm.ring_attention_payloads), and FSDP under CP shards over dp_shard x cp."""

from __future__ import annotations

from gridtrain.config import Config
from gridtrain.layout.dims import ParallelDims
from gridtrain.layout.schedules import forwards_held, schedule
from gridtrain.model.args import ModelArgs
from gridtrain.plan.axes import fsdp_axis, world_axis
from gridtrain.layout.experts import expert_data_parallel, experts_fsdp_sharded
from gridtrain.plan.census import ep_local, fsdp_local, is_routed_expert, numel, rank_stage_shapes, tp_local
from gridtrain.plan.layout import Layout
from gridtrain.plan.comm import ring_attention_payloads
from gridtrain.plan.float8 import FLOAT8_LINEAR, gathers_float8
from gridtrain.plan.memory import fsdp_gathers, kv_heads_per_rank
from gridtrain.plan.moe_collectives import moe_step_collectives
from gridtrain.plan.shape import from_args


def run_layout(args: ModelArgs, dims: ParallelDims, cfg: Config) -> Layout:
    """The planner's Layout of a gridtrain run (its config.json record)."""
    t, p = cfg.train, cfg.parallel
    zero = p.zero_stage if dims.dp * dims.cp > 1 else 0  # FSDP runs over dp_shard x cp
    return Layout(tp=dims.tp, pp=dims.pp, cp=dims.cp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard,
                  zero_stage=zero, micro_batch=t.micro_batch, seq_len=cfg.data.seq_len,
                  num_microbatches=cfg.microbatches(dims.dp), pp_schedule=p.pp_schedule,
                  pp_virtual_stages=p.pp_virtual_stages if dims.pp > 1 else 1,
                  sequence_parallel=p.sequence_parallel, recompute=t.recompute,
                  fewer_edge_layers=p.pp_fewer_edge_layers, float8=t.float8, ep=dims.ep)


def cp_collectives(args: ModelArgs, dims: ParallelDims, cfg: Config, blocks: int) -> dict[str, float]:
    """Ring attention's payloads over a step: per block of the rank and micro-batch,
    comm.ring_attention_payloads at the rank's KV heads (1/tp of them) and the training dtype."""
    if dims.cp == 1:
        return {}
    t = cfg.train
    kv_width = kv_heads_per_rank(from_args(args), dims.tp) * args.head_dim
    per_layer = ring_attention_payloads(t.micro_batch * cfg.data.seq_len, kv_width, dims.cp,
                                        4 if t.precision == "fp32" else 2, t.recompute != "none",
                                        cfg.parallel.cp_rotate)
    return {f"cp/{kind}_bytes": blocks * cfg.microbatches(dims.dp) * v for kind, v in per_layer.items()}


def _add(out: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    for key, value in more.items():
        out[key] = out.get(key, 0.0) + value
    return out


def predict_collectives(args: ModelArgs, dims: ParallelDims, cfg: Config, pp_rank: int) -> dict[str, float]:
    """Payload bytes per collective and mesh axis in one accounted step, for the layouts whose
    traffic is modelled exactly on CPU (gloo): DDP and ZeRO-1, FSDP (ZeRO 2 and 3, any precision)
    and HSDP, TP with or without SP in fp32, and single-stage pipelines without recomputation;
    every other layout is estimated (estimate_collectives). Keys as in the accounting
    ('dp_shard/all_gather_bytes'). gloo
    specifics: FSDP2 reduces gradients with an all-reduce (gloo has no reduce-scatter); the
    gradient norm all-reduces one fp32 scalar per sharded parameter tensor (DTensor's per-tensor
    norms) or one per pipeline (the squared total over 'pp'); fp16 agrees on overflows with one
    fp32 scalar per optimizer over the world (on the axis that spans it, if one does)."""
    return collectives(args, dims, cfg, pp_rank)[0]


def collectives(args: ModelArgs, dims: ParallelDims, cfg: Config, pp_rank: int,
                gloo: bool = True) -> tuple[dict[str, float], bool]:
    """(predict_collectives' bytes, whether they are exact rather than estimated). These are the
    bytes gloo's flight recorder logs: it has no reduce-scatter (it all-reduces the same tensor)
    and logs tensor parallelism's all-gathers by their input. Without `gloo` (NCCL, or a dry
    run's fake process group, which log every collective as the code issues it), the
    reduce-scatters are reduce-scatters and an all-gather counts what it gathers, tp times."""
    exact = _predict_collectives(args, dims, cfg, pp_rank)
    out = exact or estimate_collectives(args, dims, cfg, pp_rank)
    if out and cfg.train.precision == "fp16" and dims.world_size > 1:
        world = world_axis(dims)
        parts = len(forwards_held(cfg.parallel.pp_schedule, dims.pp, cfg.parallel.pp_virtual_stages
                                  if dims.pp > 1 else 1, 1, pp_rank))
        out[f"{world}/all_reduce_bytes"] = out.get(f"{world}/all_reduce_bytes", 0.0) + 4.0 * parts
    if not gloo:
        if "tp/all_gather_bytes" in out:
            out["tp/all_gather_bytes"] *= dims.tp
        for axis, moved in reduce_scattered(args, dims, cfg, pp_rank).items():
            out[f"{axis}/all_reduce_bytes"] -= moved
            out[f"{axis}/reduce_scatter_bytes"] = moved
            if not out[f"{axis}/all_reduce_bytes"]:
                del out[f"{axis}/all_reduce_bytes"]
    return out, bool(exact)


def reduce_scattered(args: ModelArgs, dims: ParallelDims, cfg: Config, pp_rank: int) -> dict[str, float]:
    """Bytes per axis of the reductions the code issues as reduce-scatters: FSDP's gradients
    (ZeRO 2 and 3, per sync: every micro-batch, or once per step under a pipeline), and under
    sequence parallelism every activation reduction of tensor parallelism (the output of wo and
    w2 forward, the embedding's forward, the head input's backward, one more per recomputed
    block). gloo has no reduce-scatter: it all-reduces the same tensors, and the predictions above
    count them as all-reduces."""
    p = cfg.parallel
    layout = run_layout(args, dims, cfg)
    m, v = layout.num_microbatches, layout.pp_virtual_stages
    parts = rank_stage_shapes(from_args(args), dims.pp, v, p.pp_schedule, p.pp_fewer_edge_layers, pp_rank)
    shapes = data_parallel_shapes({name: s for part in parts for name, s in part.items()}, dims.ep)
    out: dict[str, float] = {}
    axis, shards = fsdp_axis(dims)
    if p.zero_stage in (2, 3) and shards > 1:
        out[axis] = (1 if dims.pp > 1 else m) * sum(fsdp_padded(shapes, dims).values())
    held = {name: s for part in parts for name, s in part.items()}
    if "edp_shard/all_reduce_bytes" in (experts := expert_collectives(args, dims, cfg, held, m, parts)):
        out["edp_shard"] = experts["edp_shard/all_reduce_bytes"]
    if dims.tp > 1 and p.sequence_parallel:
        stages = list(forwards_held(layout.pp_schedule, dims.pp, v, m, pp_rank)) if dims.pp > 1 else [0]
        first, last = 0 in stages, dims.pp * v - 1 in stages
        blocks = len(block_indices(shapes))
        again = blocks if cfg.train.recompute != "none" else 0
        reduced = tp_activation_traffic(blocks, first, last, again, cfg.train.precision, dims.dp * dims.cp > 1,
                                        moe_blocks(shapes))[0]
        out["tp"] = m * reduced * 4 * layout.micro_batch * layout.seq_len // dims.cp * args.dim
    return out


def _predict_collectives(args: ModelArgs, dims: ParallelDims, cfg: Config, pp_rank: int) -> dict[str, float]:
    t, p = cfg.train, cfg.parallel
    recomputed = t.recompute != "none"
    seq, mb, m = cfg.data.seq_len, t.micro_batch, cfg.microbatches(dims.dp)
    parts = rank_stage_shapes(from_args(args), dims.pp, p.pp_virtual_stages, p.pp_schedule,
                              p.pp_fewer_edge_layers, pp_rank)
    held = {name: s for part in parts for name, s in part.items()}
    moe = moe_step_collectives(args, dims, cfg, held)
    shapes = data_parallel_shapes(held, dims.ep)
    total = 4 * sum(numel(s) for s in shapes.values())
    once = 4 * sum(numel(shapes[n]) for names in gathered_once(shapes, args.tie_embeddings) for n in names)
    only = lambda *axes: all(getattr(dims, a) == 1 for a in ("tp", "pp", "dp_replicate", "dp_shard", "cp")
                             if a not in axes)
    activation = 4 * mb * seq * args.dim
    if p.zero_stage in (0, 1) and only("dp_replicate") and dims.ep > 1:
        # Beside expert parallelism, replication is FSDP2 over (dp_replicate, 1): every
        # micro-batch's gradients all-reduced, the experts' not.
        return _add(_add({"dp_replicate/all_reduce_bytes": m * total}, moe), expert_collectives(args, dims, cfg, held, m))
    if p.zero_stage in (0, 1) and only("dp_replicate"):
        return {"dp_replicate/all_reduce_bytes": total, **zero1_broadcast(p.zero_stage, total)}
    axis, shards = fsdp_axis(dims)
    if p.zero_stage in (2, 3) and only("dp_shard", "dp_replicate", "cp") and shards > 1:
        # ZeRO-2 gathers every unit once per micro-batch; ZeRO-3 again in backward, except the
        # last block and the head, which stay gathered, and the embedding (gathered_once). Under
        # bf16 and fp16 the parameters are gathered in that dtype (2 bytes) and the gradients
        # reduced in fp32. HSDP then all-reduces each micro-batch's gradient shard (FSDP2's padded
        # chunks) over the replicas. Under CP, the ring's traffic besides (on the same group
        # when dp_shard is 1).
        # Under FP8's float8 all-gather (tensorwise) the block linears travel at 1 byte an element,
        # and their scales, one fp32 each, are all-reduced once a step (parallel/float8.py).
        linear = [n for n in shapes if gathers_float8(t.float8, p.zero_stage, shards) and FLOAT8_LINEAR.match(n)]
        once_names = {n for names in gathered_once(shapes, args.tie_embeddings) for n in names}
        in8 = 4 * sum(numel(shapes[n]) for n in linear)
        in8_once = 4 * sum(numel(shapes[n]) for n in linear if n in once_names)
        gathered_all, gathered8 = ((x if p.zero_stage == 2 else 2 * x - x_once)
                                   for x, x_once in ((total, once), (in8, in8_once)))
        gathered = (gathered_all - gathered8) * gather_bytes(t.precision) / 4 + gathered8 / 4
        out = {f"{axis}/all_gather_bytes": m * gathered,
               f"{axis}/all_reduce_bytes": m * total + 4 * len(shapes) + 4 * len(linear)}
        if dims.dp_replicate > 1:
            shard = 4 * sum(numel(fsdp_local(s, shards, 0)) for s in shapes.values())
            out["dp_replicate/all_reduce_bytes"] = m * shard
        out = _add(_add(out, cp_collectives(args, dims, cfg, args.n_layers)), moe)
        return _add(out, expert_collectives(args, dims, cfg, held, m))
    if only("tp") and dims.tp > 1 and t.precision == "fp32":
        # Then one norm scalar per sharded tensor (tp_sharded_tensors, and the head), and with SP the
        # norms' weight gradients, partial per sequence shard, all-reduced once.
        moe = moe_blocks(shapes)
        reduced, gathered = tp_activation_traffic(args.n_layers, True, True, args.n_layers if recomputed else 0,
                                                  t.precision, False, moe)
        reduced = m * (reduced * activation + 3 * 4 * mb * seq) + 4 * (tp_sharded_tensors(args.n_layers, moe) + 1)
        if not p.sequence_parallel:
            return {"tp/all_reduce_bytes": reduced}
        return {"tp/all_reduce_bytes": reduced + (2 * args.n_layers + 1) * 4 * args.dim,
                "tp/all_gather_bytes": m * gathered * activation / dims.tp}
    if only("pp") and dims.pp > 1 and schedule(p.pp_schedule).stages_per_rank == 1 and not recomputed:
        first, last = pp_rank == 0, pp_rank == dims.pp - 1
        return {"pp/all_reduce_bytes": 4.0, "pp/send_bytes": m * activation * ((not last) + (not first))}
    return {}


def data_parallel_shapes(shapes: dict[str, tuple[int, ...]], ep: int) -> dict[str, tuple[int, ...]]:
    """The parameters data parallelism (FSDP, DDP) handles: all but the routed experts under expert
    parallelism, which FSDP leaves alone (their gradients are whole on their rank)."""
    return shapes if ep == 1 else {name: s for name, s in shapes.items() if not is_routed_expert(name)}


def zero1_broadcast(zero_stage: int, params: float) -> dict[str, float]:
    """ZeRO-1 (torch's ZeroRedundancyOptimizer) after its step: each rank broadcasts the
    parameters it updated, tensor by tensor, so every rank takes part in a broadcast of each of
    its `params` fp32 bytes once per step (Rajbhandari et al. 2020, sec. 5.1: stage 1 moves the
    same bytes as data parallelism, an all-gather of the updated parameters after the reduce)."""
    return {"dp_replicate/broadcast_bytes": params} if zero_stage == 1 else {}


def moe_blocks(shapes: dict[str, tuple[int, ...]]) -> int:
    """The mixture-of-experts blocks among a rank's parameters."""
    return sum(name.endswith(".moe.router.gate.weight") for name in shapes)


def tp_sharded_tensors(blocks: int, moe_blocks: int = 0) -> int:
    """Tensors tensor parallelism splits in `blocks` blocks: wq, wk, wv, wo and a dense block's
    w1, w2, w3 (an MoE block's router and experts are whole on every TP rank)."""
    return 7 * blocks - 3 * moe_blocks


def tp_activation_traffic(blocks: int, first: bool, last: bool, again: int, precision: str,
                          fsdp: bool, moe_blocks: int = 0) -> tuple[float, float]:
    """(reductions, all-gathers) of tensor parallelism's activations per micro-batch over `blocks`
    blocks, in B x T x dim fp32 activations (Megatron's f and g; Korthikanti et al. 2022 for SP).
    Reductions: the outputs of wo and w2 forward, the gradients of their inputs' norms backward,
    the embedding's output forward (first stage), the head input's gradient backward (last);
    all-reduces, or with SP reduce-scatters. All-gathers (SP only): the norms' outputs forward
    (2 per block, the final norm on the last stage) and, backward, the gradients of every
    reduce-scatter's output (2 per block, the embedding's). Recomputation repeats a block's
    forward up to its last reduction (torch's checkpoint stops once backward has what it needs):
    one reduction and, with SP, both norms' all-gathers.
    Under bf16 and fp16 autocast the matmul outputs move in 16 bits: wo's and w2's outputs
    forward (and their recomputation) and their gradients backward, and, when FSDP gathers the
    embedding in 16 bits (`fsdp`, data parallelism beside TP), its output and gradient too; the
    rest stays fp32 (the residual stream and the norms are fp32).
    Of the blocks, `moe_blocks` have a mixture of experts, replicated over the TP ranks
    (tensor_parallel.moe_plan): it adds no reduction (wo's forward and the attention input's
    gradient remain), and under SP its input is gathered and its output's gradient gathered in
    backward, as a dense MLP's are (measured on tiny-moe, fp32 and bf16 with SP: exact)."""
    h = 0.5 if precision in ("bf16", "fp16") else 1.0
    embedding = first * (h if fsdp else 1.0)
    reductions = (2 * blocks - moe_blocks) * (h + 1) + embedding + last + again * h
    gathers = 2 * blocks + last + 2 * again + 2 * blocks * h + embedding
    return reductions, gathers


def estimate_collectives(args: ModelArgs, dims: ParallelDims, cfg: Config, pp_rank: int) -> dict[str, float]:
    """Payload bytes per collective and mesh axis for the layouts predict_collectives does not
    model exactly (several parallel axes, or a pipeline with more than one stage per rank or with
    recomputation): each axis's traffic over this rank's own stages, composed. Measured against the
    accounting on 12 layouts of 4 ranks: most axes exact, a pipeline's SP all-gathers off by up to
    13% (they move between its ranks); ZeRO-3 beside every schedule exact. Per axis:
    - tp: per micro-batch the activation traffic of the rank's blocks (tp_activation_traffic;
      gloo logs the all-gathers at 1/tp) and loss_parallel's three values per token on the last
      stage; with SP the norms' weight gradients once; one fp32 norm scalar per sharded tensor
      (tp_sharded_tensors, the head);
    - pp: each stage sends its output forward (unless last) and its input gradient back (unless
      first), 1/tp of the activation under SP; one norm scalar;
    - data parallelism: the rank's own (tensor-parallel) parameters, gradients reduced in fp32;
      under a pipeline torch's stage syncs once per step, otherwise every micro-batch (FSDP2,
      including its replicate for DDP with TP) or once (DDP's buckets), each tensor padded to a
      multiple of dp_shard rows; ZeRO-2 gathers each unit once per sync, ZeRO-3 twice (but the
      last block, the head and the embedding once without a pipeline; under a pipeline, with any
      schedule, the last block of each stage the rank holds and the head once a step, the other
      blocks once per micro-batch and once more, the embedding once per micro-batch).
    Under bf16 and fp16, the part of tensor-parallel traffic that carries matmul outputs moves in
    16 bits (tp_activation_traffic)."""
    t, p = cfg.train, cfg.parallel
    layout = run_layout(args, dims, cfg)
    # Under CP each rank holds seq/cp of every sequence.
    seq, mb, m, v = layout.seq_len // dims.cp, layout.micro_batch, layout.num_microbatches, layout.pp_virtual_stages
    parts = rank_stage_shapes(from_args(args), dims.pp, v, p.pp_schedule, p.pp_fewer_edge_layers, pp_rank)
    shapes = {name: s for part in parts for name, s in part.items()}
    stages = list(forwards_held(layout.pp_schedule, dims.pp, v, m, pp_rank)) if dims.pp > 1 else [0]
    first, last = 0 in stages, dims.pp * v - 1 in stages
    blocks = len(block_indices(shapes))
    activation, sp = 4 * mb * seq * args.dim, p.sequence_parallel and dims.tp > 1
    again = blocks if t.recompute != "none" else 0
    out: dict[str, float] = {}
    if dims.tp > 1:
        moe = moe_blocks(shapes)
        reduced, gathered = tp_activation_traffic(blocks, first, last, again, t.precision, dims.dp * dims.cp > 1, moe)
        norms = 2 * blocks + last
        out["tp/all_reduce_bytes"] = (m * (reduced * activation + last * 3 * 4 * mb * seq)
                                      + 4 * (tp_sharded_tensors(blocks, moe) + last)
                                      + sp * norms * 4 * args.dim)
        if sp:
            out["tp/all_gather_bytes"] = m * gathered * activation / dims.tp
    if dims.pp > 1:
        sends = sum((s < dims.pp * v - 1) + (s > 0) for s in stages)
        out["pp/send_bytes"] = m * sends * activation / (dims.tp if sp else 1)
        out["pp/all_reduce_bytes"] = 4.0
    if dims.dp * dims.cp > 1:  # under CP, FSDP shards over dp_shard x cp
        out = _add(out, dp_collectives(args, dims, cfg, layout, data_parallel_shapes(shapes, dims.ep), parts))
    out = _add(out, moe_step_collectives(args, dims, cfg, shapes))
    out = _add(out, expert_collectives(args, dims, cfg, shapes, m, parts))
    return _add(out, cp_collectives(args, dims, cfg, blocks))


def dp_collectives(args: ModelArgs, dims: ParallelDims, cfg: Config, layout: Layout,
                   shapes: dict[str, tuple[int, ...]], parts: list[dict[str, tuple[int, ...]]]) -> dict[str, float]:
    """Data parallelism's part of estimate_collectives, over the rank's own parameter `shapes`,
    held in the pipeline stages `parts`."""
    t, p, m = cfg.train, cfg.parallel, layout.num_microbatches
    params = 4 * sum(numel(tp_local(name, s, dims.tp)) for name, s in shapes.items())
    syncs = 1 if dims.pp > 1 else m
    if p.zero_stage in (0, 1):
        reduced = syncs * params if fsdp_gathers(layout) else params
        return {"dp_replicate/all_reduce_bytes": reduced, **zero1_broadcast(p.zero_stage, params)}
    padded = fsdp_padded(shapes, dims)
    params = sum(padded.values())
    kept, forward = (sum(padded[name] for name in names)
                     for names in gathered_once(shapes, args.tie_embeddings, parts))
    gathered = fsdp_gathered(cfg, dims, m, params, kept, forward)
    # The gradients reduced, and one norm scalar per sharded tensor.
    axis, shards = fsdp_axis(dims)
    out = {f"{axis}/all_gather_bytes": gathered * gather_bytes(t.precision) / 4,
           f"{axis}/all_reduce_bytes": syncs * params + 4 * len(shapes)}
    if dims.dp_replicate > 1:
        out["dp_replicate/all_reduce_bytes"] = syncs * params / shards
    return out


def fsdp_gathered(cfg: Config, dims: ParallelDims, m: int, params: float, kept: float, forward: float) -> float:
    """Bytes FSDP all-gathers in a step (in fp32 terms) of units holding `params` bytes, `kept` of
    them kept gathered from forward to backward and `forward` gathered in forward only (gathered_once)."""
    p = cfg.parallel
    if p.zero_stage == 2:
        return (1 if dims.pp > 1 else m) * params
    if dims.pp == 1:
        return m * (2 * params - kept - forward)
    # Every micro-batch's forward gathers the stage's units again but the last block of each stage
    # the rank holds and the head, which stay gathered, and the first backward once more; the
    # embedding once per micro-batch. Measured by dry runs of 70B and 405B layouts at 8 and 16
    # micro-batches, and on the small model at 8 layers over pp 2 x dp_shard 2 (or cp 2), 2 to 8
    # micro-batches, under every schedule: 1F1B, interleaved 1F1B and looped BFS at v 2 and 3, and
    # the split-backward ones (ZB-V, interleaved ZB), whose stage gathers its blocks before each
    # backward pass (SplitBackwardStage) where they are not gathered already.
    return (m + 1) * (params - kept - forward) + kept + m * forward


def expert_collectives(args: ModelArgs, dims: ParallelDims, cfg: Config, shapes: dict[str, tuple[int, ...]],
                       m: int, parts: list[dict[str, tuple[int, ...]]] | None = None) -> dict[str, float]:
    """The routed experts' data-parallel traffic where ep leaves data-parallel ranks over
    (gridtrain.layout.experts): each MoE layer's experts an FSDP unit of their own, E / ep of them
    split on dimension 1 over 'edp_shard' (gathered in the training dtype as the dense units are,
    gradients reduced in fp32 per sync, the last block's kept gathered) and replicated over
    'edp_replicate' (their shard's gradient all-reduced per sync); an all-reduce of the whole
    gradient over 'edp_replicate' where edp_shard is 1. Gloo logs the reduce-scatters as all-reduces."""
    if not experts_fsdp_sharded(dims):
        return {}
    replicas, shards = expert_data_parallel(dims, cfg.parallel.zero_stage)
    experts = {name: ep_local(s, dims.ep) for name, s in shapes.items() if is_routed_expert(name)}
    params = 4 * sum(numel(s) for s in experts.values())
    syncs = 1 if dims.pp > 1 else m
    out: dict[str, float] = {}
    if shards > 1:
        kept = 4 * sum(numel(experts[n]) for n in gathered_once(experts, False, parts)[0])
        out["edp_shard/all_gather_bytes"] = fsdp_gathered(cfg, dims, m, params, kept, 0) * gather_bytes(
            cfg.train.precision) / 4
        out["edp_shard/all_reduce_bytes"] = syncs * params
    if replicas > 1:
        out["edp_replicate/all_reduce_bytes"] = syncs * params / shards
    return out if experts else {}


def gathered_once(shapes: dict[str, tuple[int, ...]], tie_embeddings: bool,
                  parts: list[dict[str, tuple[int, ...]]] | None = None) -> tuple[list[str], list[str]]:
    """ZeRO-3's exceptions to "gathered for forward, again for backward" among the rank's
    parameters (parallel/data_parallel.apply_fsdp), as (kept, forward only): the units kept
    gathered from their forward to their backward (the last block of each of the rank's pipeline
    stages `parts`, or of the rank without them; the final norm with the head), and the
    embedding, whose backward reads only the token ids. A head tied to an embedding on the same
    rank puts the two and the norm in the root unit, which is gathered twice."""
    lasts = {max(blocks) for part in (parts or [shapes]) if (blocks := block_indices(part))}
    tied = tie_embeddings and "tok_embeddings.weight" in shapes and "norm.weight" in shapes
    head = () if tied else ("norm.weight", "output.weight")
    kept = [name for name in shapes if (name.startswith("layers.") and int(name.split(".")[1]) in lasts)
            or name in head]
    return kept, [] if tied or "tok_embeddings.weight" not in shapes else ["tok_embeddings.weight"]


def block_indices(shapes: dict[str, tuple[int, ...]]) -> set[int]:
    """The indices of the blocks (`layers.N.*`) whose parameters are among `shapes`."""
    return {int(name.split(".")[1]) for name in shapes if name.startswith("layers.")}


def fsdp_padded(shapes: dict[str, tuple[int, ...]], dims: ParallelDims) -> dict[str, int]:
    """fp32 bytes FSDP gathers and reduces per tensor of the rank's (tensor-parallel) parameters:
    each padded to a multiple of its shard count (dp_shard, or dp_shard x cp) in rows."""
    shards = fsdp_axis(dims)[1]
    return {name: 4 * shards * numel(fsdp_local(tp_local(name, s, dims.tp), shards, 0))
            for name, s in shapes.items()}


def gather_bytes(precision: str) -> int:
    """Bytes per parameter element that FSDP all-gathers: the training dtype's."""
    return 2 if precision in ("bf16", "fp16") else 4
