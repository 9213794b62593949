"""Memory per rank by bucket: weights, gradients, optimizer state, activations, buffers.

The model state (bytes per parameter by precision and ZeRO stage) is `state.py`.

Activations per layer follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"), GPT block, 16-bit, with dropout: s b h (34 + 5 a s / h); with TP t:
s b h (10 + 24/t + 5 a s/(h t)); with SP: s b h/t (34 + 5 a s/h); selective recomputation drops the
5as/h term; full recomputation keeps the block input, 2 s b h.

The same census for gridtrain's Llama block (RMSNorm, GQA with k KV heads, SwiGLU of width F, no
dropout, e bytes per activation), tensor by tensor:
- replicated under TP without SP: the two norm inputs (2e sbh), the QKV input (e sbh) and the MLP
  input (e sbh): 4e sbh (8 at e = 2; GPT's 10 adds two 1-byte dropout masks);
- split by TP: Q (e sbh), K and V (2e sb kv_width, kv_width = k h / a), the output-projection input
  (e sbh), SwiGLU's w1 and w3 outputs, silu output and product (4e sbF): e(2h + 2 kv_width + 4F) sb;
- attention scores: the softmax output, e a s^2 b (GPT: 2e + 1 with the dropout mask and output);
  with flash attention none, but the kernel keeps its output (e sbh) and log-sum-exp (4 a s b).
At e = 2 without TP: s b h (12 + 4k/a + 8F/h) + 2 a s^2 b; Llama 3 70B (k/a = 1/8, F/h = 3.5) is
40.5 s b h against GPT's 34.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from gridtrain.layout.dims import stage_layer_counts
from gridtrain.layout.schedules import forwards_held, in_flight, schedule, stage_ranks
from gridtrain.plan.activations import (block_bytes_per_token, head_bytes_per_token, held_bytes,
                                        moe_ffn_bytes_per_token, qk_norm_bytes_per_token,
                                        ring_selective_bytes_per_token)
from gridtrain.plan.census import peak_dp_index, rank_elements
from gridtrain.names import PLAN_RECOMPUTE, RECOMPUTE
from gridtrain.plan.float8 import gathered_bytes, gathers_float8, scale_bytes
from gridtrain.plan.layout import Layout
from gridtrain.plan.shape import ModelShape, expert_params, moe_mlp_params, norm_params
from gridtrain.plan.state import ModelState, StateBytes, model_state_bytes

GiB = 2**30


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, tp: int = 1,
                            sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2, per GPT layer, 16-bit activations with dropout.

    none: sbh (10 + 24/t + 5as/(ht)) (= sbh (34 + 5as/h) at t = 1); SP: sbh/t (34 + 5as/h);
    selective: the 5as/h term dropped; full: 2 sbh (the table's value, whatever t)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh
    score = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / tp * (34 + score)
    return sbh * (10 + 24 / tp + score / tp)


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """KV heads on one TP rank; tp above the KV heads replicates them (worked example: 8 KV heads at
    tp 16 -> one per rank, 2 copies each)."""
    return max(shape.num_kv_heads // tp, 1)


def measured_census(shape: ModelShape, flash: bool, recompute: str) -> bool:
    """Whether activations.py's census (measured on gridtrain's runtime) covers the case:
    gridtrain's Llama block with fused attention under the runtime's recomputation modes."""
    return shape.block == "llama" and flash and recompute in RECOMPUTE


@functools.lru_cache(maxsize=8192)
def layer_activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, tp: int = 1,
                           sequence_parallel: bool = False, cp: int = 1, recompute: str = "none",
                           flash: bool = True, act_bytes: int = 2, moe: bool = False, ep: int = 1,
                           imbalance: float = 1.0) -> float:
    """Bytes one rank saves for backward in one layer for one micro-batch (module docstring);
    with `moe`, a mixture-of-experts layer (activations.moe_ffn_bytes_per_token in place of the MLP,
    its routed rows under expert parallelism `imbalance` times the rank's own).

    Context parallelism divides the sequence and implies flash-style attention (ring attention
    merges blocks by log-sum-exp). Full recomputation keeps only the block input, divided by t
    under SP (Korthikanti's table prints 2sbh regardless)."""
    if recompute not in PLAN_RECOMPUTE:
        raise ValueError(f"recompute must be one of {PLAN_RECOMPUTE}, not {recompute!r}")
    e, h, a = act_bytes, shape.hidden, shape.num_heads
    s, b = seq_len / cp, micro_batch
    flash = flash or cp > 1
    precision = "fp32" if e == 4 else "bf16"
    if measured_census(shape, flash, recompute):
        return s * b * block_bytes_per_token(shape, precision, recompute, tp, sequence_parallel, moe, ep, imbalance)
    replicated_div = tp if sequence_parallel else 1
    if recompute == "full":
        return e * s * b * h / replicated_div
    gpt = shape.block == "gpt"
    kv_width = kv_heads_per_rank(shape, tp) * shape.head_dim
    replicated = (4 * e + (2 if gpt else 0)) * s * b * h
    if gpt:  # GELU input and output (2e sbF); Llama's SwiGLU keeps four F-wide tensors (4e sbF)
        mlp = 2 * e * shape.ffn / tp
    elif moe:  # the mixture's part, whole on every TP rank, as nothing is recomputed
        mlp = moe_ffn_bytes_per_token(shape, precision, "none", ep, imbalance)
    else:
        mlp = 4 * e * shape.ffn / tp
    # Q and the attention output are q wide (h unless the heads are wider); QK-norm keeps its fp32 tensors.
    qk_norm = qk_norm_bytes_per_token(shape, "none" if recompute == "attention" else recompute)
    sharded = ((2 * e * shape.q_width + qk_norm) / tp + 2 * e * kv_width + mlp) * s * b
    heads = a / tp
    if recompute == "attention":
        core = 0.0
    elif flash:
        core = e * s * b * shape.q_width / tp + 4 * heads * s * b
    else:
        core = (2 * e + 1 if gpt else e) * heads * s * s * b
    return replicated / replicated_div + sharded + core


@functools.lru_cache(maxsize=4096)
def head_activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, tp: int = 1,
                          sequence_parallel: bool = False, cp: int = 1, act_bytes: int = 2) -> float:
    """The last stage's extra per micro-batch: final-norm and head inputs (2e sbh) and the fp32
    log-probabilities the loss keeps, 4 s b V / t (vocab-parallel head; Korthikanti et al. 2022)."""
    s, b = seq_len / cp, micro_batch
    if measured_census(shape, True, "none"):
        return s * b * head_bytes_per_token(shape, "fp32" if act_bytes == 4 else "bf16", tp, sequence_parallel) + 4
    inputs = 2 * act_bytes * s * b * shape.hidden / (tp if sequence_parallel else 1)
    return inputs + 4 * s * b * shape.vocab / tp


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of a pipeline stage holds at its peak, by bucket."""

    rank: int
    """Pipeline rank (all ranks of one pipeline rank are alike across tp, cp and dp)."""
    layers: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return sum(getattr(self, bucket) for bucket in BUCKETS)


BUCKETS: tuple[str, ...] = tuple(f.name for f in fields(RankMemory))[2:]
"""The memory buckets, the same names in the planner's report, `plan --check` and the runtime's
accounting (memory/<bucket>_bytes): weights, gradients, optimizer, activations, buffers."""
STATE_BUCKETS = BUCKETS[:3]
"""The model state: what ZeRO shards."""


def rank_layers(shape: ModelShape, layout: Layout) -> list[int]:
    """Transformer blocks on each pipeline rank (a rank sums its virtual stages)."""
    return list(layers_per_rank(shape.num_layers, layout.pp, layout.pp_virtual_stages, layout.pp_schedule,
                                layout.fewer_edge_layers))


@functools.lru_cache(maxsize=4096)
def stage_counts(num_layers: int, num_stages: int, fewer_edge_layers: int = 0) -> list[int]:
    """stage_layer_counts, cached (the search asks for the same few splits often)."""
    return tuple(stage_layer_counts(num_layers, num_stages, fewer_edge_layers))  # type: ignore[return-value]


@functools.lru_cache(maxsize=4096)
def layers_per_rank(num_layers: int, pp: int, virtual: int, schedule: str,
                    fewer_edge_layers: int = 0) -> tuple[int, ...]:
    """rank_layers by its arguments (cached: the layout search asks for the same few splits often)."""
    counts = stage_layer_counts(num_layers, pp * virtual, fewer_edge_layers)
    owner = stage_ranks(pp, virtual, schedule)
    layers = [0] * pp
    for stage, n in enumerate(counts):
        layers[owner[stage]] += n
    return tuple(layers)


def edge_ranks(layout: Layout) -> tuple[int, int]:
    """(rank holding the embedding, rank holding the head): 0 and pp-1, or 0 and 0 for V schedules
    (the owners of the first and last stage in stage_ranks, without building the whole list)."""
    return 0, (0 if schedule(layout.pp_schedule).v_shape else layout.pp - 1)


@functools.lru_cache(maxsize=4096)
def moe_layers_per_rank(shape: ModelShape, pp: int, virtual: int, schedule_name: str,
                        fewer_edge_layers: int = 0) -> tuple[int, ...]:
    """Mixture-of-experts blocks on each pipeline rank (a rank sums its virtual stages)."""
    counts = stage_counts(shape.num_layers, pp * virtual, fewer_edge_layers)
    owner = stage_ranks(pp, virtual, schedule_name)
    out, start = [0] * pp, 0
    for stage, n in enumerate(counts):
        out[owner[stage]] += shape.moe_layers_in(start, start + n)
        start += n
    return tuple(out)


def rank_moe_layers(shape: ModelShape, layout: Layout, rank: int) -> int:
    """Mixture-of-experts blocks on pipeline rank `rank`."""
    if not shape.num_experts:
        return 0
    return moe_layers_per_rank(shape, layout.pp, layout.pp_virtual_stages, layout.pp_schedule,
                               layout.fewer_edge_layers)[rank]


def rank_expert_params(shape: ModelShape, layout: Layout, rank: int) -> float:
    """Routed-expert parameters on one rank of pipeline rank `rank`: its E / ep experts of each of
    its MoE blocks, whole on every tensor-parallel rank (they are not split by TP)."""
    return rank_moe_layers(shape, layout, rank) * expert_params(shape) / layout.ep


def rank_params(shape: ModelShape, layout: Layout, rank: int, layers: int) -> float:
    """Parameters on one rank of a TP group: attention and MLP matrices split t ways (K and V
    replicated when t exceeds the KV heads), norms replicated, embedding and head split by
    vocabulary; the embedding on the first stage, head and final norm on the last (a tied
    matrix is held on both ends when pp > 1, as Megatron does). An MoE block holds its router
    and shared experts whole and 1/ep of its routed experts (rank_expert_params) in place of
    the MLP."""
    t, h = layout.tp, shape.hidden
    kv_width = kv_heads_per_rank(shape, t) * shape.head_dim
    attention = 2 * h * shape.q_width / t + 2 * h * kv_width + (2 * shape.head_dim if shape.qk_norm else 0)
    mlp = (3 if shape.block == "llama" else 2) * h * shape.ffn / t
    block = attention + mlp + norm_params(shape)
    first, last = edge_ranks(layout)
    table = shape.vocab * h / t
    params = layers * block
    if shape.num_experts:
        moe = rank_moe_layers(shape, layout, rank)
        params += moe * (moe_mlp_params(shape) - mlp) + rank_expert_params(shape, layout, rank)
    if rank == first:
        params += table + shape.max_positions * h
    if rank == last:
        params += norm_params(shape) // 2 + (table if not shape.tie_embeddings or layout.pp > 1 else 0)
    return params


def state_index(layout: Layout, dp: int, cp: int) -> int:
    """A rank's data-parallel index for rank_state from its mesh coordinates: FSDP (stages 2, 3)
    shards over dp_shard x cp, CP ranks innermost; ZeRO-1 over dp alone."""
    return dp * layout.cp + cp if layout.zero_stage >= 2 else dp


def rank_state(shape: ModelShape, layout: Layout, rank: int, state: StateBytes,
               dp_index: int | None = None) -> ModelState:
    """Model-state bytes of one rank on pipeline rank `rank`: with an exact convention (gridtrain's
    runtime), tensor by tensor (census.py) for the data-parallel rank `dp_index`, by default the one
    that holds the most; otherwise the even split of model_state_bytes."""
    if state.exact and shape.block == "llama":
        # FSDP (stages 2, 3) shards over dp_shard x cp: dp_index then counts CP ranks innermost.
        shard = layout.zero_shard_degree if layout.zero_stage >= 2 else layout.dp_shard
        where = (shape, layout.tp, layout.pp, layout.pp_virtual_stages, layout.pp_schedule, layout.fewer_edge_layers,
                 layout.zero_stage, layout.dp_replicate, shard, rank)
        held = rank_elements(*where, peak_dp_index(*where) if dp_index is None else dp_index, layout.ep,
                             layout.expert_split[1])
        return ModelState(held.params * state.weights, held.grads * state.gradients,
                          held.optimizer * state.optimizer + held.optimizer_tensors * state.step_count)
    layers = rank_layers(shape, layout)[rank]
    params = rank_params(shape, layout, rank, layers)
    if layout.ep == 1:
        return model_state_bytes(params, layout.zero_stage, layout.zero_shard_degree, state)
    # Under expert parallelism the rank's experts are sharded by FSDP over edp_shard only (whole
    # when ep spans every data- and context-parallel rank: no other rank holds them).
    experts, shards = rank_expert_params(shape, layout, rank), layout.expert_split[1]
    dense = model_state_bytes(params - experts, layout.zero_stage, layout.zero_shard_degree, state)
    own = model_state_bytes(experts, layout.zero_stage if shards > 1 else 0, shards, state)
    return ModelState(*(getattr(dense, f) + getattr(own, f) for f in ("weights", "gradients", "optimizer")))


def fsdp_gathers(layout: Layout) -> bool:
    """Whether gridtrain runs the layout's parameters through FSDP2, which gathers them in the
    compute dtype: ZeRO 2 and 3 over several data-parallel ranks, and ZeRO 0 (replication) once
    tensor, pipeline or expert parallelism is on (parallel/data_parallel.py). Under context
    parallelism FSDP shards over dp_shard x cp, so it runs with one data-parallel rank too."""
    if layout.zero_stage in (2, 3):
        return layout.zero_shard_degree * layout.dp_replicate > 1
    return layout.dp > 1 and layout.zero_stage == 0 and (layout.tp > 1 or layout.pp > 1 or layout.ep > 1)


def gathered_bytes_per_param(zero_stage: int, shards: int, state: StateBytes) -> float:
    """Bytes per parameter of the unsharded copies ZeRO-2 keeps from forward to backward. gridtrain
    shards a ZeRO-2 model at rest too (FSDP2 without resharding after forward): every block's
    parameters are gathered once per step in the compute dtype and held until backward. In the
    ZeRO paper's convention the weights are simply not sharded at stage 2 (model_state_bytes).
    `shards`: the ranks FSDP shards over (Layout.zero_shard_degree)."""
    if state.exact and zero_stage == 2 and shards > 1:
        return state.compute
    return 0.0


DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 2**20, 25 * 2**20
"""DDP's gradient buckets as gridtrain runs them (parallel/data_parallel.py: bucket_cap_mb=25, and
torch's first bucket of 1 MiB)."""


def buffer_bytes(shape: ModelShape, layout: Layout, state: StateBytes, act_bytes: int = 2,
                 ddp_bucket_bytes: float = DDP_BUCKET_BYTES) -> float:
    """Communication buffers, a convention rather than a measurement:
    - ZeRO-3/FSDP: one block's weights all-gathered unsharded (in the compute dtype) plus the
      next one prefetched, and one block's unsharded gradients before their reduce-scatter;
      ZeRO-2: the gradients only;
    - DDP and ZeRO-1: two gradient buckets (one reducing while the next fills; torch's 25 MiB);
    - pipeline: a send and a receive buffer of one activation;
    - context parallelism (ring attention): one layer's keys and values in flight, the rank's own
      and the next (2 kv, kv = 2 x tokens/cp x kv_width x bytes), and in backward the fp32 dK/dV
      accumulator being passed on and the one arriving (2 x 4/bytes x kv)."""
    t, h = layout.tp, shape.hidden
    kv_width = kv_heads_per_rank(shape, t) * shape.head_dim
    attention = 2 * h * shape.q_width / t + 2 * h * kv_width
    block = attention + (3 if shape.block == "llama" else 2) * h * shape.ffn / t
    if shape.num_experts:  # FSDP's unit is the block: an MoE one gathers its experts too, unless EP holds them
        # whole (ep = dp x cp); beside an EP of fewer ranks, the experts' own unit gathers E / ep of them
        gathered_experts = expert_params(shape) / layout.ep if layout.ep == 1 or layout.expert_split[1] > 1 else 0
        moe = attention + moe_mlp_params(shape) + gathered_experts
        block = moe if shape.num_moe_layers == shape.num_layers else max(block, moe)
    out = 0.0
    if layout.zero_stage == 3 and layout.zero_shard_degree > 1:
        # Under FP8's float8 all-gather a gathered block weighs 1 byte a linear parameter.
        gathered = 1.0 if gathers_float8(layout.float8, 3, layout.zero_shard_degree) else state.compute
        out += 2 * block * gathered + block * state.gradients
    elif layout.zero_stage == 2 and layout.zero_shard_degree > 1:
        out += block * state.gradients
    elif layout.dp > 1:
        out += 2 * ddp_bucket_bytes
    if layout.pp > 1:
        tokens = layout.tokens_per_microbatch / layout.cp
        out += 2 * tokens * h * act_bytes / (t if layout.sequence_parallel else 1)
    if layout.cp > 1:
        kv = 2 * layout.tokens_per_microbatch / layout.cp * kv_width * act_bytes
        out += 2 * kv + 2 * kv * 4 / act_bytes
    return out


def rank_memory(shape: ModelShape, layout: Layout, state: StateBytes = StateBytes(),
                act_bytes: int = 2, ranks: tuple[int, ...] | None = None) -> list[RankMemory]:
    """Peak bytes per bucket on each pipeline rank (only on `ranks` when given)."""
    buffers = buffer_bytes(shape, layout, state, act_bytes)
    gathered = gathered_bytes_per_param(layout.zero_stage, layout.zero_shard_degree, state)
    out = []
    for rank, layers, acts in probe_activations(shape, layout, act_bytes, ranks):
        ms = rank_state(shape, layout, rank, state)
        # ZeRO-2's gathered copies; under FP8's float8 all-gather the block linears at 1 byte each.
        extra = gathered_bytes(shape, rank_params(shape, layout, rank, layers), layers, layout.tp, gathered,
                               layout.float8, layout.zero_stage, layout.zero_shard_degree) if gathered else 0.0
        extra += scale_bytes(layers, layout.float8, layout.zero_stage, layout.zero_shard_degree)  # FP8's scales
        out.append(RankMemory(rank, layers, ms.weights, ms.gradients, ms.optimizer, acts, buffers + extra))
    return out


def probe_activations(shape: ModelShape, layout: Layout, act_bytes: int = 2,
                      ranks: tuple[int, ...] | None = None) -> list[tuple[int, int, float]]:
    """(pipeline rank, its layers, its activations at the peak) for each pipeline rank (or those
    in `ranks`), full recomputation's working block included (an MoE block where the rank has one)."""
    from gridtrain.plan.moe_cost import imbalance  # it times the all-to-alls by placement, which imports comm

    def per_block(recompute: str, moe: bool) -> float:
        return layer_activation_bytes(shape, layout.seq_len, layout.micro_batch, layout.tp, layout.sequence_parallel,
                                      layout.cp, recompute, layout.flash_attention, act_bytes, moe,
                                      layout.ep if moe else 1, imbalance(shape, layout) if moe else 1.0)

    dense = per_block(layout.recompute, False)
    per_layer = (dense, per_block(layout.recompute, True) if shape.num_experts else dense)
    head = head_activation_bytes(shape, layout.seq_len, layout.micro_batch, layout.tp,
                                 layout.sequence_parallel, layout.cp, act_bytes)
    _, last = edge_ranks(layout)
    out = []
    for rank, layers in enumerate(rank_layers(shape, layout)):
        if ranks is None or rank in ranks:
            # Full recomputation rematerializes one block during its backward.
            working = 0.0
            if layout.recompute == "full":
                working = per_block("none", rank_moe_layers(shape, layout, rank) > 0)
            out.append((rank, layers, rank_activations(shape, layout, rank, layers, act_bytes, per_layer, head, last)
                        + working))
    return out


def rank_activations(shape: ModelShape, layout: Layout, rank: int, layers: int, act_bytes: int,
                     per_layer: tuple[float, float], head: float, last: int) -> float:
    """A pipeline rank's activations at its peak (recomputation's working block aside): the
    measured census on gridtrain's schedules, else its dense and MoE layers x `per_layer` (a dense
    and an MoE layer's bytes) per micro-batch in flight (in_flight) and the head on the `last` rank."""
    if measured_census(shape, layout.flash_attention or layout.cp > 1, layout.recompute) and \
            schedule(layout.pp_schedule).runnable:
        return census_activations(shape, layout, rank, act_bytes)
    held = in_flight(layout.pp_schedule, layout.pp, rank, layout.num_microbatches, layout.pp_virtual_stages)
    moe = rank_moe_layers(shape, layout, rank) if shape.num_experts else 0
    acts = ((layers - moe) * per_layer[0] + moe * per_layer[1]) * held
    if rank == last:
        acts += head * (layout.num_microbatches if schedule(layout.pp_schedule).all_forwards_first else 1)
    return acts


@functools.lru_cache(maxsize=8192)
def census_activations(shape: ModelShape, layout: Layout, rank: int, act_bytes: int) -> float:
    """A pipeline rank's activations at its peak, as gridtrain saves them: the forwards each of
    its stages holds then (schedules.forwards_held on torch's schedules) times what a forward
    saves (activations.held_bytes), and the token ids and targets of its micro-batches."""
    from gridtrain.plan.moe_cost import imbalance  # it times the all-to-alls by placement, which imports comm

    v = layout.pp_virtual_stages if layout.pp > 1 else 1
    counts = stage_counts(shape.num_layers, layout.pp * v, layout.fewer_edge_layers)
    held = forwards_held(layout.pp_schedule, layout.pp, v, layout.num_microbatches, rank, peak=True)
    tokens = layout.micro_batch * layout.seq_len / layout.cp
    precision = "fp32" if act_bytes == 4 else "bf16"
    acts = held_bytes(shape, held, counts, tokens, precision, layout.recompute,
                      layout.tp, layout.sequence_parallel, fsdp_gathers(layout), layout.ep, imbalance(shape, layout))
    # The last CP rank keeps the most of ring attention under selective recomputation.
    ring = ring_selective_bytes_per_token(shape, precision, layout.recompute, layout.tp, layout.cp, layout.cp - 1)
    acts += ring * tokens * sum(n * counts[s] for s, n in held.items())
    ids = 8 * tokens * (layout.num_microbatches if layout.pp > 1 else 1)
    return acts + ids * ((0 in held) + (len(counts) - 1 in held))


def peak_rank(ranks: list[RankMemory]) -> RankMemory:
    """The pipeline rank that needs the most memory (the first such one on ties)."""
    return max(ranks, key=lambda r: r.total)


def describe_peak(ranks: list[RankMemory], hbm_bytes: float) -> str:
    """One line naming the rank that peaks, its buckets in GiB, and whether it fits."""
    r = peak_rank(ranks)
    parts = ", ".join(f"{name} {getattr(r, name) / GiB:.2f}" for name in
                      BUCKETS)
    verdict = "fits" if r.total <= hbm_bytes else "does not fit"
    return (f"pipeline rank {r.rank} ({r.layers} layers) peaks at {r.total / GiB:.2f} GiB "
            f"({parts} GiB): {verdict} in {hbm_bytes / GiB:.1f} GiB")
