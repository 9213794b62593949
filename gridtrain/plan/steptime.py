"""Predicted step time: compute + exposed communication + pipeline bubble, with one set of
physical constants (`Efficiency`), and the throughput it implies (tokens/s, TFLOP/s, MFU, HFU).

One step on the slowest pipeline rank:

    step = m x t_mb + bubble + pipeline sends + exposed DP/FSDP + optimizer
    t_mb = layers x (matmul + memory-bound + overhead + TP + exposed CP) [+ embedding/head]

- matmul: the layer's hardware FLOPs (model FLOPs plus recomputation, flops.py's convention;
  attention counted in full, as Megatron's Eq. 3 counts it: a causal flash kernel skips half the
  work but runs it at a lower fraction of peak; under document masking over the layout's
  attention span, documents.py) over peak x `matmul`;
- memory-bound: norms, activation functions, softmax, dropout, residual adds stream activations
  through HBM. Their bytes are the layer's saved activations (memory.layer_activation_bytes
  without recomputation), each written in forward, read back in backward, and its gradient
  written and read: 4 passes, and 2 more for what recomputation rebuilds; over HBM x `hbm`;
- TP: 4 all-reduces of the (tokens, h) activation per layer, 6 with full recomputation (SP's
  all-gather + reduce-scatter cost the same), on the critical path, no overlap;
- CP: ring attention's KV passes, hidden behind the attention core's matmuls where they can be;
- bubble: the schedule's idle share of the rank's step, its torch action order replayed with the
  measured action costs (pipeline.schedule_bubble, plan/replay.py: right for any m, m < pp
  included), and the zero-bubble schedules' split backward costing more per micro-batch
  (pipeline.split_cost);
- pipeline sends: forward activation and backward gradient of every micro-batch on every chunk,
  1/tp of the activation per GPU (Megatron's scatter/gather, Narayanan et al. 2021 sec. 4.1);
- DP: the data-parallel collectives as gridtrain issues them, less what the compute hides
  (dptime.py);
- optimizer: AdamW is memory-bound: it reads the gradient, reads and writes master weights and
  both moments, writes the 16-bit weights, for the parameters this rank updates;
- a mixture-of-experts layer (moe_cost.py): its feed-forward's FLOPs whole on every TP rank (the
  routed experts at the imbalance allowance under expert parallelism), its TP collectives the
  attention's and, under sequence parallelism, the mixture's all-gathers, and its all-to-alls in line; a rank's own experts are neither gathered nor
  reduced by DP/FSDP, and AdamW updates all of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from gridtrain.plan import placement
from gridtrain.plan.dptime import dp_time, step_sync_seconds
from gridtrain.plan.float8 import matmul_peak
from gridtrain.plan.flops import flops_per_token, hardware_flops_per_token
from gridtrain.plan.layout import Layout
from gridtrain.plan.memory import (edge_ranks, kv_heads_per_rank, layer_activation_bytes, layers_per_rank,
                                   moe_layers_per_rank, rank_expert_params, rank_params)
from gridtrain.plan.moe_cost import busiest_rows, ep_seconds, moe_ffn_flops_per_token
from gridtrain.plan.pipeline import schedule_bubble, split_cost
from gridtrain.plan.shape import (ModelShape, attention_params, block_params, matmul_params, moe_block_active_params,
                                  norm_params)
from gridtrain.plan.state import StateBytes
from gridtrain.plan.specs import ClusterSpec

GB = 1e9


@dataclass(frozen=True)
class Efficiency:
    """The planner's physical constants, calibrated once (tests/test_plan_reference_throughput.py)."""

    matmul: float
    """Fraction of the dense 16-bit peak that a transformer's large matmuls achieve."""
    hbm: float
    """Fraction of HBM bandwidth that memory-bound kernels (norms, softmax, AdamW) achieve."""
    intra_node: float
    """Achieved bus bandwidth / one-way link bandwidth of collectives inside a node (NVLink)."""
    inter_node: float
    """The same between nodes (one NIC per GPU)."""
    layer_overhead_s: float
    """Fixed time per layer per micro-batch (forward + backward): kernel launches, syncs."""
    overlap_slowdown: float = 0.0
    """Compute time lost per second of DP/FSDP communication hidden under it: NCCL's kernels take
    SMs and HBM bandwidth from the matmuls they overlap."""
    attention: float | None = None
    """Fraction of the peak the attention core reaches (None: as the matmuls; a CPU's is far lower)."""
    recompute_overhead_s: tuple[tuple[str, float], ...] = ()
    """Framework time recomputation adds per layer per micro-batch, by mode (its checkpoint
    machinery, measured on CPUs where it shows)."""
    tp_block_s: float = 0.0
    """Host time tensor parallelism adds per layer per micro-batch beyond its collectives' bytes and
    latency (DTensor's dispatch and redistributions): hidden on a GPU like fsdp_call_s, the step
    on CPU ranks (train/calibrate_gloo.py)."""
    fsdp_call_s: float = 0.0
    """Host time per FSDP collective call beyond its bytes (copies into and out of its buffers,
    DTensor's dispatch, the backend's per-call cost): hidden on a GPU, where the host runs ahead of
    the kernels; on CPU ranks the step itself (train/calibrate_gloo.py)."""
    grads_once_per_step: bool = False
    """Replicated gradients are all-reduced once per step whatever the layout (Megatron-LM's DDP);
    False: as gridtrain's runtime does, once per micro-batch where FSDP replicates them beside TP
    without a pipeline."""

    @property
    def attention_share(self) -> float:
        return self.matmul if self.attention is None else self.attention


CALIBRATED = Efficiency(matmul=0.66, hbm=0.70, intra_node=0.60, inter_node=0.80, layer_overhead_s=50e-6,
                        overlap_slowdown=0.35, grads_once_per_step=True)
"""Calibrated against Megatron-LM's SC21 Table 1 (A100-80GB, Selene); see README "Planning". The
overlap slowdown is fixed by torchtitan's FSDP rows instead (reference_titan): from 8 GPUs on
NVLink to 128 over RDMA the hidden FSDP traffic grows 0.21 -> 0.45 s a step and the published
step time by 2.8% eager, 2.3% compiled, which 0.39 and 0.29 s per hidden second explain; 0.35
between them."""

IMPLEMENTATIONS: dict[str, Efficiency] = {
    "megatron": CALIBRATED,
    "compiled": replace(CALIBRATED, matmul=0.49, grads_once_per_step=False),
    "eager": replace(CALIBRATED, matmul=0.41, grads_once_per_step=False),
}
"""What kernels reach, by the implementation that runs them. 'megatron': Megatron-LM's fused
kernels (and Transformer Engine's), fixed by SC21 Table 1. 'eager' (what gridtrain runs: PyTorch
eager with SDPA, FSDP2) and 'compiled' (the same under torch.compile): the share of the peak their
compute reaches, one constant each, fixed by torchtitan's published H100 rows that use neither
Float8 nor async TP (reference.TORCHTITAN_H100: Llama 3.1 8B on FSDP 8 and FSDP 128, bf16, selective
recomputation; eager 5,762 and 5,605 tokens/s per GPU, compiled 6,667 and 6,514). Two rows each
cannot tell the matmuls from the elementwise kernels and launches around them, so the constant
lumps them; the collectives and memory-bound passes keep Megatron's."""

HBM_PASSES = 4
"""Memory-bound passes over each saved activation byte: forward write, backward read, gradient
write and read."""
RECOMPUTE_PASSES = 2
"""Extra passes over what recomputation rebuilds: written and read once more."""


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer, one micro-batch, one GPU: forward, backward and recomputation."""

    matmul_s: float
    memory_bound_s: float
    overhead_s: float
    tp_s: float
    """All-reduces (or all-gather + reduce-scatter) of the activation, on the critical path."""
    cp_s: float
    """Ring-attention sends left after overlap with the attention core."""
    backward_share: float
    """Share of the layer's compute that runs in its backward pass (recomputation included)."""
    ep_s: float = 0.0
    """An MoE layer's expert-parallel all-to-alls, all on the critical path (moe_cost.py)."""

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.memory_bound_s + self.overhead_s + self.tp_s + self.cp_s + self.ep_s


def layer_hardware_flops_per_token(shape: ModelShape, seq_len: int, recompute: str) -> float:
    """One layer's share of flops.hardware_flops_per_token (blocks only; L x this + the edge =
    that): 6 x block parameters + 12 h s, plus what recomputation repeats. `seq_len`: the keys a
    query attends to (the sequence's length, or its attention span under doc_mask, documents.py)."""
    attn_fwd = 4 * shape.num_heads * shape.head_dim * seq_len
    model = 6 * block_params(shape) + 3 * attn_fwd
    if recompute == "full":
        return model + 2 * (block_params(shape) - norm_params(shape)) + attn_fwd
    return model + (attn_fwd if recompute == "attention" else 0)


def layer_attention_flops_per_token(shape: ModelShape, seq_len: int, recompute: str) -> float:
    """The attention core's part of layer_hardware_flops_per_token: 3 x 4 h s (forward and
    backward, the full square), and the forward again where it is recomputed (full, attention)."""
    attn_fwd = 4 * shape.num_heads * shape.head_dim * seq_len
    return attn_fwd * (4 if recompute in ("full", "attention") else 3)


def layer_attention_part_flops_per_token(shape: ModelShape, seq_len: int, recompute: str) -> float:
    """An MoE layer's share of layer_hardware_flops_per_token outside its feed-forward: the
    attention's matrices and core, and the norms (moe_cost.moe_ffn_flops_per_token has the rest)."""
    attn_fwd = 4 * shape.num_heads * shape.head_dim * seq_len
    weights = attention_params(shape) + norm_params(shape)
    model = 6 * weights + 3 * attn_fwd
    if recompute == "full":
        return model + 2 * attention_params(shape) + attn_fwd
    return model + (attn_fwd if recompute == "attention" else 0)


@functools.lru_cache(maxsize=64)
def edge_flops_per_token(shape: ModelShape) -> float:
    """Output head (and final norm) FLOPs per token, forward + backward (not recomputed)."""
    moe = shape.num_moe_layers
    blocks = (shape.num_layers - moe) * block_params(shape) + moe * moe_block_active_params(shape)
    return 6 * (matmul_params(shape) - blocks)


@functools.lru_cache(maxsize=4096)
def layer_cost(shape: ModelShape, cluster: ClusterSpec, eff: Efficiency, seq_len: int, micro_batch: int,
               tp: int, cp: int, sequence_parallel: bool, recompute: str, flash: bool,
               act_bytes: int = 2, float8: str = "none", moe: bool = False, ep: int = 1,
               span: float | None = None) -> LayerCost:
    """The cost of one layer for one micro-batch on one GPU (module docstring). Collectives: over
    the tp axis, 4 all-reduces (6 with full recomputation) of tokens x h x act_bytes, tokens =
    micro_batch x seq_len / cp; over the cp axis, the ring's (1 + forwards) x (cp - 1) sends of a
    K and V block, kv = 2 x tokens x kv_width x act_bytes (forwards: 2 under recomputation), and
    cp sends of its fp32 gradient (comm.ring_attention_payloads), less what the attention core hides.

    With `moe`, a mixture-of-experts layer: its feed-forward runs whole on every TP rank
    (moe_cost.moe_ffn_flops_per_token, the routed experts at moe_cost.busiest_rows: the imbalance
    allowance when ep > 1, capped by a capacity factor),
    so only the attention's 2 all-reduces (3 with full recomputation) cross the tp axis, and under
    sequence parallelism the mixture's own all-gathers: its fp32 input along the sequence forward
    (again where the forward is recomputed) and its output's gradient backward (act_bytes), as
    dry runs of tiny-moe at tp 2 log them; its all-to-alls (ep_s) are added by pipeline_time,
    which knows the layout's data-parallel ranks.

    `span`: the keys a query attends to under document masking (documents.py), for the attention
    core's FLOPs and what it hides of the ring; None: the whole sequence."""
    acc = cluster.accelerator
    tokens = micro_batch * seq_len / cp
    keys = seq_len if span is None else span
    if moe:
        slow = busiest_rows(shape, ep)
        hw = (layer_attention_part_flops_per_token(shape, keys, recompute) * tokens / tp
              + moe_ffn_flops_per_token(shape, recompute, slow) * tokens)
    else:
        hw = layer_hardware_flops_per_token(shape, keys, recompute) * tokens / tp
    attention = layer_attention_flops_per_token(shape, keys, recompute) * tokens / tp
    # Under FP8 the block linears run at the device's FP8 peak (plan/float8.py), attention at 16 bits.
    matmul_s = (hw - attention) / (matmul_peak(acc, float8) * eff.matmul) + attention / (acc.peak_flops * eff.attention_share)
    saved = layer_activation_bytes(shape, seq_len, micro_batch, tp, sequence_parallel, cp, "none",
                                   flash, act_bytes, moe)
    kept = layer_activation_bytes(shape, seq_len, micro_batch, tp, sequence_parallel, cp, recompute,
                                  flash, act_bytes, moe)
    traffic = HBM_PASSES * saved + RECOMPUTE_PASSES * (saved - kept if recompute != "none" else 0)
    memory_bound_s = traffic / (acc.hbm_gb_per_s * GB * eff.hbm)
    tp_s = 0.0
    if tp > 1:
        levels = placement.axis_levels(cluster, tp, 1, eff.intra_node, eff.inter_node)
        count = (6 if recompute == "full" else 4) // (2 if moe else 1)
        tp_s = count * placement.all_reduce_time(tokens * shape.hidden * act_bytes, levels) + eff.tp_block_s
        if moe and sequence_parallel:  # the mixture's own gathers (parallel/tensor_parallel.moe_plan)
            rows = tokens * shape.hidden
            again = recompute != "none"  # a recomputed forward gathers again (dry runs: selective too)
            tp_s += ((1 + again) * placement.all_gather_time(4 * rows, levels)
                     + placement.all_gather_time(act_bytes * rows, levels))
    cp_s = 0.0
    if cp > 1:
        # The ring's messages (comm.ring_attention_payloads): keys and values, (1 + forwards) x
        # (cp - 1) of them, and cp fp32 gradient accumulators; what the attention core's compute
        # does not hide is exposed.
        kv_width = kv_heads_per_rank(shape, tp) * shape.head_dim
        kv = 2 * tokens * kv_width * act_bytes
        forwards = 1 if recompute == "none" else 2
        send = lambda size: placement.p2p_time(size, cluster, cp, tp, eff.intra_node, eff.inter_node)  # noqa: E731
        sends = (forwards + 1) * (cp - 1) * send(kv) + cp * send(kv * 4 / act_bytes)
        attn_core = 12 * shape.q_width * keys * tokens / tp / (acc.peak_flops * eff.attention_share)
        cp_s = max(0.0, sends - attn_core)
    fwd = 1 + (1 if recompute == "full" else 0)
    overhead = eff.layer_overhead_s + dict(eff.recompute_overhead_s).get(recompute, 0.0)
    return LayerCost(matmul_s, memory_bound_s, overhead, tp_s, cp_s, 1 - 1 / (fwd + 2))


def head_seconds(shape: ModelShape, cluster: ClusterSpec, eff: Efficiency, layout: Layout) -> float:
    """The last stage's output head for one micro-batch: its matmuls and the fp32 logits the
    softmax cross-entropy streams (written, read, gradient written and read: 4 x 4 bytes x V/t)."""
    acc = cluster.accelerator
    tokens = layout.tokens_per_microbatch / layout.cp
    flops = edge_flops_per_token(shape) * tokens / layout.tp
    logits = HBM_PASSES * 4 * tokens * shape.vocab / layout.tp
    return flops / (acc.peak_flops * eff.matmul) + logits / (acc.hbm_gb_per_s * GB * eff.hbm)


@dataclass(frozen=True)
class StepTime:
    """One optimizer step on the slowest pipeline rank, by part (seconds)."""

    layout: Layout
    compute_s: float
    """m micro-batches of matmuls, memory-bound kernels, overheads (and the head, if last)."""
    tp_s: float
    cp_s: float
    pp_s: float
    """Pipeline sends on the critical path."""
    bubble_s: float
    dp_s: float
    """DP/FSDP communication left after overlap."""
    dp_total_s: float
    """DP/FSDP communication before overlap."""
    optimizer_s: float
    """AdamW's update, and the trainer's small all-reduces of the step (dptime.step_sync_seconds)."""
    critical_rank: int
    """The pipeline rank that sets the pace."""
    model_flops_per_token: float
    hardware_flops_per_token: float
    peak_flops: float
    """Dense peak of one GPU, FLOP/s."""
    ep_s: float = 0.0
    """Expert-parallel all-to-alls (mixture-of-experts layers), in line with compute."""

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_s + self.cp_s + self.ep_s + self.pp_s + self.bubble_s + self.dp_s
                + self.optimizer_s)

    @property
    def tokens_per_s(self) -> float:
        return self.layout.global_batch_tokens / self.total_s

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.tokens_per_s * self.model_flops_per_token / self.layout.num_gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """Hardware FLOPs (recomputation included) per GPU: Megatron's Eq. 3 convention."""
        return self.tokens_per_s * self.hardware_flops_per_token / self.layout.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu * 1e12 / self.peak_flops

    @property
    def hfu(self) -> float:
        return self.hardware_tflops_per_gpu * 1e12 / self.peak_flops

    def parts(self) -> dict[str, float]:
        """Seconds by part, in the order of the step."""
        return {"compute": self.compute_s, "tp": self.tp_s, "cp": self.cp_s, "ep": self.ep_s, "pp": self.pp_s,
                "bubble": self.bubble_s, "dp": self.dp_s, "optimizer": self.optimizer_s}


@dataclass(frozen=True)
class PipelineTime:
    """The part of the step that does not depend on the ZeRO stage."""

    micro_s: float
    """One micro-batch on the critical rank (all its chunks, forward and backward)."""
    layer: LayerCost
    critical_rank: int
    layers: int
    head_s: float
    pp_s: float
    bubble_s: float
    moe_layers: int = 0
    """Of the critical rank's layers, those with a mixture of experts (costed by moe_layer)."""
    moe_layer: LayerCost | None = None

    def per_micro(self, part: str) -> float:
        """A LayerCost part (tp_s, cp_s, ep_s) summed over the critical rank's layers."""
        dense = (self.layers - self.moe_layers) * getattr(self.layer, part)
        return dense + (self.moe_layers * getattr(self.moe_layer, part) if self.moe_layer else 0.0)


@functools.lru_cache(maxsize=4096)
def _busiest(counts: tuple[int, ...]) -> int:
    """The first rank with the most layers."""
    return counts.index(max(counts))


def pipeline_time(shape: ModelShape, layout: Layout, cluster: ClusterSpec, eff: Efficiency,
                  act_bytes: int = 2) -> PipelineTime:
    """m micro-batches through the pipeline on its slowest rank, with sends and the bubble."""
    args = (shape, cluster, eff, layout.seq_len, layout.micro_batch, layout.tp, layout.cp,
            layout.sequence_parallel, layout.recompute, layout.flash_attention, act_bytes, layout.float8)
    lc = layer_cost(*args, span=layout.attention_span)
    counts = layers_per_rank(shape.num_layers, layout.pp, layout.pp_virtual_stages, layout.pp_schedule,
                             layout.fewer_edge_layers)
    _, last = edge_ranks(layout)
    head = head_seconds(shape, cluster, eff, layout)
    moe_lc, moe = None, (0,) * layout.pp
    if shape.num_experts:
        moe_lc = replace(layer_cost(*args, moe=True, ep=layout.ep, span=layout.attention_span),
                         ep_s=ep_seconds(shape, layout, cluster, eff.intra_node, eff.inter_node, act_bytes))
        moe = moe_layers_per_rank(shape, layout.pp, layout.pp_virtual_stages, layout.pp_schedule,
                                  layout.fewer_edge_layers)
        times = [(n - k) * lc.total_s + k * moe_lc.total_s + (head if r == last else 0.0)
                 for r, (n, k) in enumerate(zip(counts, moe))]
        critical = times.index(max(times))
        micro = times[critical]
    else:
        busiest = _busiest(counts)
        critical = last if counts[last] * lc.total_s + head >= counts[busiest] * lc.total_s else busiest
        micro = counts[critical] * lc.total_s + (head if critical == last else 0.0)
    m, pp, v = layout.num_microbatches, layout.pp, layout.pp_virtual_stages
    pp_s = bubble_s = 0.0
    if pp > 1:
        micro *= split_cost(layout.pp_schedule, layout.recompute)  # zero-bubble schedules' split backward
        act = layout.tokens_per_microbatch / layout.cp * shape.hidden * act_bytes / layout.tp
        send = placement.p2p_time(act, cluster, pp, layout.tp * layout.cp, eff.intra_node, eff.inter_node)
        pp_s = 2 * m * v * send
        frac = schedule_bubble(layout.pp_schedule, pp, m, v)
        bubble_s = frac / (1 - frac) * m * micro
    return PipelineTime(micro, lc, critical, counts[critical], head if critical == last else 0.0,
                        pp_s, bubble_s, moe[critical], moe_lc)


def optimizer_seconds(shape: ModelShape, layout: Layout, cluster: ClusterSpec, eff: Efficiency,
                      rank: int, layers: int, state: StateBytes = StateBytes()) -> float:
    """AdamW over the parameters this rank updates (1/shard of its stage's under ZeRO >= 1; under
    expert parallelism its own experts, 1/edp_shard of them where FSDP shards them)."""
    experts = rank_expert_params(shape, layout, rank) if layout.ep > 1 else 0.0
    params = ((rank_params(shape, layout, rank, layers) - experts) / layout.zero_shard_degree
              + experts / layout.expert_split[1])
    traffic = params * state.adamw_traffic
    return traffic / (cluster.accelerator.hbm_gb_per_s * GB * eff.hbm)


def step_time(shape: ModelShape, layout: Layout, cluster: ClusterSpec, eff: Efficiency = CALIBRATED,
              state: StateBytes = StateBytes(), act_bytes: int = 2,
              pt: PipelineTime | None = None) -> StepTime:
    """The predicted time of one optimizer step of `layout` on `cluster` (module docstring).
    `pt` reuses a pipeline_time already computed for this layout's non-ZeRO degrees."""
    pt = pt or pipeline_time(shape, layout, cluster, eff, act_bytes)
    m = layout.num_microbatches
    dp_exposed, dp_total = dp_time(shape, layout, cluster, eff, pt, state)
    tp_s, cp_s, ep_s = (m * pt.per_micro(part) for part in ("tp_s", "cp_s", "ep_s"))
    return StepTime(
        layout=layout, compute_s=m * pt.micro_s - tp_s - cp_s - ep_s, tp_s=tp_s, cp_s=cp_s, ep_s=ep_s, pp_s=pt.pp_s,
        bubble_s=pt.bubble_s, dp_s=dp_exposed, dp_total_s=dp_total,
        optimizer_s=optimizer_seconds(shape, layout, cluster, eff, pt.critical_rank, pt.layers, state)
        + step_sync_seconds(layout, cluster, eff),
        critical_rank=pt.critical_rank,
        model_flops_per_token=flops_per_token(shape, layout.seq_len, layout.attention_span),
        hardware_flops_per_token=hardware_flops_per_token(shape, layout.seq_len, layout.recompute,
                                                          layout.attention_span),
        peak_flops=cluster.accelerator.peak_flops)
