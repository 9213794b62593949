"""The calculations of distributed training, one card each: inputs (defaulting to a worked
problem's numbers), the formula, and answers computed by the planner's own functions. The
explorer's calculations page is generated from CARDS; tests check each card's answers at its
defaults against values derived by hand. Where a commonly quoted answer to the worked problem is
wrong, `quoted` gives it and `correction` says why the card's answer differs.

Units: GB = 1e9 bytes, GB/s = 1e9 bytes/s, times in the unit each answer names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from gridtrain.plan import budget, comm, pipeline, precision, reliability
from gridtrain.plan.comm import Link
from gridtrain.plan.memory import in_flight
from gridtrain.plan.state import StateBytes, model_state_bytes
from gridtrain.plan.shape import tp_heads, tp_weight_shard

GB, MiB, GiB, ms = 1e9, 2**20, 2**30, 1e-3


@dataclass(frozen=True)
class Input:
    name: str
    label: str
    default: float
    unit: str = ""
    whole: bool = False
    """Whole numbers only (GPUs, layers, steps)."""


@dataclass(frozen=True)
class Card:
    id: str
    title: str
    topic: str
    formula: str
    inputs: tuple[Input, ...]
    compute: Callable[..., list[tuple[str, float, str]]]
    """Inputs by name -> [(answer label, value, unit)]."""
    source: str
    quoted: str = ""
    """The answer as commonly quoted for the worked problem."""
    correction: str = ""
    """Why the card's answer differs from `quoted` ('' when it agrees)."""
    explore: dict = field(default_factory=dict)
    """The explorer state the calculation belongs to."""

    def answer(self, values: dict[str, float]) -> list[tuple[str, float, str]]:
        return self.compute(**{i.name: values.get(i.name, i.default) for i in self.inputs})


def _ring(M, N, bw, lat):
    link = Link(bw * GB, lat * 1e-6)
    return [("bytes each GPU sends", comm.ring_all_reduce_bytes(M * GB, N) / GB, "GB"),
            ("steps", 2 * (N - 1), ""), ("time", comm.ring_all_reduce_time(M * GB, N, link) / ms, "ms"),
            ("of which latency", 2 * (N - 1) * lat / 1e3, "ms")]


def _tree(M, N, bw, lat):
    link = Link(bw * GB, lat * 1e-6)
    ring, tree = comm.ring_all_reduce_time(M * GB, N, link), comm.tree_all_reduce_time(M * GB, N, link)
    out = [("ring", ring / ms, "ms"), ("tree", tree / ms, "ms"), ("ring steps", 2 * (N - 1), ""),
           ("tree steps", 2 * math.ceil(math.log2(N)), "")]
    return out + ([("tree / ring", tree / ring, "x")] if ring > 0 else [])


def _zero(P, N, w=2, g=2, K=12):
    state = StateBytes(weights=w, gradients=g, master=0, moments=K)  # K: the whole optimizer state
    return [(f"ZeRO-{s}" if s else "no ZeRO", model_state_bytes(P * 1e9, s, N, state).total / GB, "GB")
            for s in range(4)]


def _zero3(P, bytes_per_param, N, bw):
    weights = P * 1e9 * bytes_per_param
    z3, z1 = comm.dp_bytes_per_step(weights, N, 3), comm.dp_bytes_per_step(weights, N, 1)
    return [("ZeRO-3 bytes per GPU", z3 / GB, "GB"), ("ZeRO-3 time", z3 / (bw * GB) / ms, "ms"),
            ("ZeRO-1/2 bytes per GPU", z1 / GB, "GB"), ("ZeRO-3 / ZeRO-1/2", z3 / z1, "x")]


def _accumulation(batch, micro, dp, micro_ms, allreduce_ms):
    steps = budget.accumulation_steps(int(batch), int(micro), int(dp))
    step = budget.accumulated_step_seconds(steps, micro_ms * ms, allreduce_ms * ms)
    every = budget.accumulated_step_seconds(steps, micro_ms * ms, allreduce_ms * ms, reduce_every_micro_batch=True)
    return [("accumulation steps", steps, ""), ("step time", step / ms, "ms"), ("throughput", batch / step, "seq/s"),
            ("communication share", allreduce_ms * ms / step * 100, "%"),
            ("share if reduced every micro-batch", steps * allreduce_ms * ms / every * 100, "%")]


def _lr(base_lr, base_batch, new_batch, base_warmup, total_steps):
    warm = budget.warmup_steps(base_warmup, base_batch, new_batch)
    return [("linear scaling", budget.lr_linear(base_lr, base_batch, new_batch), ""),
            ("square-root scaling", budget.lr_sqrt(base_lr, base_batch, new_batch), ""),
            ("warmup steps", warm, ""), ("warmup share", warm / total_steps * 100, "%")]


def _ratio(P, N, bw, step_tflop, gpu_tflops):
    r = comm.comm_compute_ratio(P * 1e9, N, bw * GB, step_tflop * 1e12, gpu_tflops * 1e12)
    t = comm.ring_all_reduce_time(P * 1e9 * 2, N, Link(bw * GB))
    return [("all-reduce time", t / ms, "ms"), ("compute time", step_tflop / gpu_tflops * 1e3, "ms"),
            ("communication / compute", r, ""), ("share of the step (no overlap)", r / (1 + r) * 100, "%")]


def _overlap(layers, layer_ms, bucket_ms):
    exposed = comm.exposed_after_compute([layer_ms * ms] * int(layers), [bucket_ms * ms] * int(layers))
    return [("exposed", exposed / ms, "ms"), ("hidden", comm.hidden_fraction(layers * bucket_ms * ms, exposed) * 100, "%"),
            ("overhead on the backward", exposed / (layers * layer_ms * ms) * 100, "%")]


def _hierarchical(M, g, nodes, intra, inter, compute_ms, mfu):
    t = comm.hierarchical_all_reduce_time(M * GB, int(g), int(nodes), Link(intra * GB), Link(inter * GB), leader=True)
    from gridtrain.plan.flops import effective_mfu
    return [("across nodes", t.inter / ms, "ms"), ("inside the nodes", (t.intra_first + t.intra_last) / ms, "ms"),
            ("all on NVLink (one ring of g x nodes)", comm.ring_all_reduce_time(M * GB, int(g * nodes), Link(intra * GB)) / ms, "ms"),
            ("MFU with it exposed", effective_mfu(mfu / 100, compute_ms * ms, t.inter) * 100, "%")]


def _bubble(pp, m, v, act_gb):
    sched = "interleaved-1f1b" if v > 1 else "1f1b"
    return [("bubble / ideal time", pipeline.bubble_ratio(int(pp), int(m), int(v)) * 100, "%"),
            ("bubble / step", pipeline.bubble_fraction(int(pp), int(m), int(v), sched) * 100, "%"),
            ("1F1B: first stage holds", in_flight("1f1b", int(pp), 0, int(m)) * act_gb, "GB"),
            ("GPipe: first stage holds", in_flight("gpipe", int(pp), 0, int(m)) * act_gb, "GB")]


def _sends(act_gb, pp, m, v, bw):
    total = comm.pp_total_bytes_per_step(act_gb * GB, int(pp), int(m), int(v))
    boundaries = pp * v - 1 if pp > 1 else 0  # one pipeline rank's stages share its GPU
    return [("boundaries", boundaries, ""), ("bytes per step", total / GB, "GB"), ("time at bw", total / (bw * GB) / ms, "ms")]


def _roofline(peak_tflops, bw, P, b, bytes_per_value, T, d):
    ridge = peak_tflops * 1e12 / (bw * GB)
    decode = 2 * b / bytes_per_value  # 2 P b FLOPs per step over the P x bytes of weights read once
    matmul = T * d / (2 * T + d) * 2 / bytes_per_value  # [T, d] x [d, d]: 2 T d^2 FLOPs, (2 T d + d^2) values
    reach = lambda intensity: min(peak_tflops, intensity * bw / 1e3)  # noqa: E731  (TFLOP/s)
    return [("ridge point", ridge, "FLOP/byte"), ("decode intensity", decode, "FLOP/byte"),
            ("decode reaches", reach(decode), "TFLOP/s"), ("decode share of peak", reach(decode) / peak_tflops * 100, "%"),
            ("decode time per token", P * 1e9 * bytes_per_value / (bw * GB) / ms, "ms"),
            ("training matmul intensity", matmul, "FLOP/byte"), ("training matmul reaches", reach(matmul), "TFLOP/s")]


def _tp_step(h, tokens_mi, bytes_per_value, layers, bw, tp, dp, pp, link_bw):
    tokens = tokens_mi * 2**20
    payload = h * tokens * bytes_per_value  # one all-reduce of the whole batch's activations
    total = 4 * layers * payload  # 4 all-reduces per layer (2 forward, 2 backward), no ring factor
    per_gpu = math.ceil(layers / pp) * comm.tp_bytes_per_layer(tokens / dp, int(h), int(tp), int(bytes_per_value))
    return [("one all-reduce's payload", payload / GiB, "GiB"), ("whole step, one TP group", total / GiB, "GiB"),
            ("whole step in TB", total / 1e12, "TB"), ("at bw", total / (bw * GB), "s"),
            ("per GPU per step", per_gpu / GB, "GB"), ("per GPU at its link", per_gpu / (link_bw * GB) / ms, "ms")]


def _tp(d, tp, s, b, bytes_per_value, layers, bw):
    rows, cols = tp_weight_shard(int(d), int(d), int(tp), "column")
    payload = s * b * d * bytes_per_value
    per = comm.ring_all_reduce_bytes(payload, int(tp))
    return [("column shard rows", rows, ""), ("column shard columns", cols, ""),
            ("bytes per all-reduce per GPU", per / MiB, "MiB"),
            ("forward: 2 per layer", 2 * layers * per / GiB, "GiB"),
            ("one all-reduce at bw", comm.ring_all_reduce_time(payload, int(tp), Link(bw * GB)) / ms, "ms")]


def _gqa(heads, kv, tp):
    if heads % kv:
        raise ValueError(f"{int(kv)} KV heads must divide the {int(heads)} query heads")
    q, k, copies = tp_heads(int(heads), int(kv), int(tp))
    return [("query heads per rank", q, ""), ("KV heads per rank", k, ""), ("copies of each KV head", copies, "")]


def _checkpoint(P, gbps, writers):
    size = reliability.checkpoint_bytes(P * 1e9)
    return [("size", size / GB, "GB"), ("one writer", reliability.checkpoint_write_seconds(size, gbps * GB), "s"),
            ("parallel writers", reliability.checkpoint_write_seconds(size, gbps * GB, int(writers)), "s")]


def _young(C, mtbf_h, step_s, gpus, price, days):
    m = mtbf_h * 3600
    if C >= m:
        raise ValueError("Young's interval assumes a checkpoint much shorter than the MTBF; this one is longer")
    tau = reliability.young_interval(C, m)
    cost = reliability.cost_per_failure(int(gpus), price, tau, restart_s=C)
    crashes = reliability.expected_failures(days * 86400, m)
    return [("Young interval", tau / 60, "min"), ("Daly interval", reliability.daly_interval(C, m) / 60, "min"),
            ("steps between checkpoints", tau / step_s, ""), ("lost per crash", reliability.expected_lost_seconds(tau) / 60, "min"),
            ("checkpoint overhead", C / tau * 100, "%"),
            ("waste (overhead + lost work)", reliability.waste_fraction(tau, C, m) * 100, "%"), ("cost of a crash", cost, "$"),
            ("crashes in the run", crashes, ""), ("cost of all crashes", crashes * cost, "$")]


def _fp16(init_scale, overflows, clean_steps, window):
    history = [True] * int(overflows) + [False] * int(clean_steps)
    return [("smallest normal", precision.FP16.min_normal, ""), ("smallest subnormal", precision.FP16.min_subnormal, ""),
            ("largest", precision.FP16.max, ""),
            ("loss scale after", precision.dynamic_loss_scale(history, init_scale, int(window)), "")]


SEVEN_B = {"model": "llama3-8b", "shape": {"n_kv_heads": 32, "ffn_dim": 11008, "vocab_size": 32000}, "gpu": "h100",
           "seq_len": 4096, "global_batch": 512}
SEVENTY_B = {"model": "llama3-70b", "gpu": "h100", "seq_len": 4096, "global_batch": 512}

CARDS: tuple[Card, ...] = (
    Card("ring", "Ring all-reduce: volume and time", "data parallelism",
         "bytes = 2 M (N-1)/N; time = 2(N-1) x (M/N / BW + latency)",
         (Input("M", "payload M", 2, "GB"), Input("N", "GPUs N", 8, whole=True), Input("bw", "bandwidth", 50, "GB/s"),
          Input("lat", "latency per step", 5, "us")), _ring,
         "Patarasuk and Yuan 2009; Thakur et al. 2005",
         quoted="M = 1 GB: 0.875 + 0.875 = 1.75 GB per GPU; M = 2 GB at 50 GB/s: 70 ms, plus 14 x 5 us = 70 us",
         explore=SEVEN_B | {"num_gpus": 8, "layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 0}}),
    Card("tree", "Tree against ring", "data parallelism",
         "tree: 2 ceil(log2 N) x (M / BW + latency); ring: 2(N-1) x (M/N / BW + latency)",
         (Input("M", "payload M", 2, "GB"), Input("N", "GPUs N", 8, whole=True), Input("bw", "bandwidth", 50, "GB/s"),
          Input("lat", "latency per step", 5, "us")), _tree, "Thakur et al. 2005",
         quoted="6 tree steps against 14 ring steps at N = 8: the tree for small messages, the ring for large"),
    Card("zero-memory", "ZeRO: model-state memory per GPU by stage", "ZeRO",
         "w + g + K bytes/param (ZeRO paper: 2 + 2 + 12): none (w + g + K) P; ZeRO-1 (w + g + K/N) P; "
         "ZeRO-2 (w + (g + K)/N) P; ZeRO-3 (w + g + K) P / N",
         (Input("P", "parameters", 7, "B"), Input("N", "data-parallel GPUs N", 64, whole=True),
          Input("w", "weights w", 2, "bytes/param"), Input("g", "gradients g", 2, "bytes/param"),
          Input("K", "optimizer state K", 12, "bytes/param")), _zero,
         "Rajbhandari et al. 2020, fig. 1", quoted="112, 29.3, 15.5 and 1.75 GB",
         explore=SEVEN_B | {"num_gpus": 64, "layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 3}}),
    Card("zero3-traffic", "ZeRO-3's extra traffic", "ZeRO",
         "ZeRO-3: all-gather (forward) + all-gather (backward) + reduce-scatter = 3 M (N-1)/N; ZeRO-1/2: 2 M (N-1)/N",
         (Input("P", "parameters", 7, "B"), Input("bytes_per_param", "bytes per weight", 2),
          Input("N", "GPUs N", 64, whole=True), Input("bw", "bandwidth", 100, "GB/s")), _zero3,
         "Rajbhandari et al. 2020, sec. 7.2", quoted="~42 GB, ~420 ms; 1.5x",
         correction="3 x 14 GB x 63/64 = 41.3 GB, 413 ms: the quoted figures round (N-1)/N to 1",
         explore=SEVEN_B | {"num_gpus": 64, "layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 3}}),
    Card("accumulation", "Gradient accumulation: steps and step time", "the training loop",
         "steps = batch / (micro x dp); step = steps x t_micro + t_allreduce",
         (Input("batch", "global batch", 2048, "seq", True), Input("micro", "micro-batch", 4, "seq", True),
          Input("dp", "data-parallel GPUs", 8, whole=True), Input("micro_ms", "forward + backward of a micro-batch", 120, "ms"),
          Input("allreduce_ms", "all-reduce", 50, "ms")), _accumulation, "Goyal et al. 2017",
         quoted="64 steps; 7,731 ms, 265 seq/s; 50/7731 = 0.6% communication, 29% without accumulation",
         correction="64 x 120 + 50 = 7,730 ms (the quoted 7,731 is a slip)",
         explore=SEVEN_B | {"num_gpus": 8, "global_batch": 2048, "layout": {"mb": 4}}),
    Card("lr", "Learning rate: linear and square-root scaling, warmup", "the training loop",
         "linear: lr x B'/B; square root: lr x sqrt(B'/B); warmup = base warmup x B'/B",
         (Input("base_lr", "base learning rate", 3e-4), Input("base_batch", "base batch", 256, whole=True),
          Input("new_batch", "new batch", 2048, whole=True), Input("base_warmup", "base warmup", 1000, "steps", True),
          Input("total_steps", "training steps", 100_000, whole=True)), _lr,
         "Goyal et al. 2017 (linear); Krizhevsky 2014 (square root)", quoted="2.4e-3; 8.5e-4; 8,000 steps, 8%"),
    Card("comm-compute", "Communication-to-compute ratio", "overlap",
         "all-reduce of 2-byte gradients 2 (2P)(N-1)/N / BW against FLOPs per step / FLOP/s",
         (Input("P", "parameters", 10, "B"), Input("N", "GPUs N", 64, whole=True), Input("bw", "bandwidth", 600, "GB/s"),
          Input("step_tflop", "compute per step per GPU", 300, "TFLOP"), Input("gpu_tflops", "GPU throughput", 1000, "TFLOP/s")),
         _ratio, "Shoeybi et al. 2019", quoted="~66 ms against 200-400 ms of compute: 15-30% of the step"),
    Card("overlap", "Bucketed all-reduce overlapped with backward", "overlap",
         "bucket i starts when layer i's gradients are ready and the previous bucket is done; exposed = what is left after the last layer",
         (Input("layers", "layers", 40, whole=True), Input("layer_ms", "backward per layer", 5, "ms"),
          Input("bucket_ms", "all-reduce per bucket", 1.5, "ms")), _overlap, "Li et al. 2020 (PyTorch DDP)",
         quoted="1.5 ms exposed of 60 ms: 97.5% hidden, < 1% of the 200 ms backward"),
    Card("hierarchical", "Hierarchical all-reduce across nodes", "data parallelism",
         "reduce in the node, ring all-reduce between nodes 2 M (n-1)/n / BW_inter, broadcast in the node",
         (Input("M", "payload", 20, "GB"), Input("g", "GPUs per node", 8, whole=True), Input("nodes", "nodes", 8, whole=True),
          Input("intra", "NVLink", 600, "GB/s"), Input("inter", "InfiniBand per node", 100, "GB/s"),
          Input("compute_ms", "compute per step", 242, "ms"), Input("mfu", "MFU without communication", 50, "%")),
         _hierarchical, "Jia et al. 2018; Sergeev and Del Balso 2018 (Horovod)",
         quoted="350 ms across nodes, 5x the NVLink all-reduce; the node steps add ~10 ms; MFU 50% -> 20%",
         correction="in a pipelined reduce to the leader and broadcast from it every GPU takes in the whole 20 GB, "
                    "at least 20/600 = 33 ms each: 67 ms, not 10",
         explore={"model": "llama3-8b", "gpu": "h100", "num_gpus": 64, "seq_len": 4096, "global_batch": 512,
                  "layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 0}}),
    Card("bubble", "Pipeline bubble and activations in flight", "pipeline parallelism",
         "bubble (p-1)/(v m) of the ideal time = (p-1)/(v m + p-1) of the step; 1F1B holds p micro-batches, GPipe m",
         (Input("pp", "stages p", 4, whole=True), Input("m", "micro-batches m", 12, whole=True),
          Input("v", "virtual stages v", 1, whole=True), Input("act_gb", "activations per micro-batch", 2, "GB")),
         _bubble, "Huang et al. 2019 (GPipe); Narayanan et al. 2021, eq. 1", quoted="25%; 1F1B 6 GB, GPipe 24 GB",
         correction="25% is bubble over ideal time; as a share of the step it is 3/15 = 20%. 1F1B's first stage holds "
                    "p = 4 micro-batches (p-1 warm-up forwards and one more before its first backward): 8 GB",
         explore={"model": "llama3-70b", "gpu": "h100", "num_gpus": 32, "seq_len": 4096, "global_batch": 12,
                  "layout": {"tp": 8, "pp": 4, "cp": 1, "mb": 1, "schedule": "1f1b"}}),  # dp 1: m = 12
    Card("interleaved-sends", "Interleaved pipeline: point-to-point sends", "pipeline parallelism",
         "(p v - 1) boundaries x 2 m sends (forward and backward) x activation bytes",
         (Input("act_gb", "activation per micro-batch", 0.5, "GB"), Input("pp", "stages p", 4, whole=True),
          Input("m", "micro-batches m", 12, whole=True), Input("v", "virtual stages v", 4, whole=True),
          Input("bw", "bandwidth", 600, "GB/s")), _sends, "Narayanan et al. 2021, sec. 2.2.2",
         quoted="180 GB, 300 ms", explore={"model": "llama3-70b", "gpu": "h100", "num_gpus": 32, "seq_len": 4096,
                                           "global_batch": 96, "layout": {"tp": 8, "pp": 4, "schedule": "interleaved-1f1b", "v": 4}}),
    Card("tp", "Tensor parallelism: shard shapes and all-reduce bytes", "tensor parallelism",
         "column split [d, d/tp]; each all-reduce of [b s, d] moves 2 (tp-1)/tp x b s d x bytes per GPU",
         (Input("d", "hidden d", 8192, whole=True), Input("tp", "TP", 8, whole=True), Input("s", "sequence", 4096, whole=True),
          Input("b", "micro-batch", 1, whole=True), Input("bytes_per_value", "bytes per value", 2),
          Input("layers", "layers", 80, whole=True), Input("bw", "NVLink", 600, "GB/s")), _tp,
         "Shoeybi et al. 2019", quoted="[8192, 1024]; 56 MB per all-reduce; 8.75 GB forward; 0.09 ms",
         correction="56 MB is one phase, (tp-1)/tp x M; a ring all-reduce moves both: 2 x 7/8 x 64 MiB = 112 MiB, "
                    "17.5 GiB over 160 forward all-reduces, 0.196 ms each at 600 GB/s",
         explore=SEVENTY_B | {"num_gpus": 64, "layout": {"tp": 8}}),
    Card("tp-step", "Tensor parallelism's traffic in one step of Llama 3 405B", "tensor parallelism",
         "one group: 4 all-reduces x layers x h x tokens x bytes; one GPU: ceil(layers / pp) x 4 x 2 (tp-1)/tp x "
         "h x tokens / dp x bytes",
         (Input("h", "hidden h", 16384, whole=True), Input("tokens_mi", "tokens per step", 4, "Mi"),
          Input("bytes_per_value", "bytes per value", 2), Input("layers", "layers", 126, whole=True),
          Input("bw", "bandwidth, whole-group figure", 900, "GB/s"), Input("tp", "TP", 8, whole=True),
          Input("dp", "DP", 192, whole=True), Input("pp", "PP", 16, whole=True),
          Input("link_bw", "NVLink per GPU, one direction", 450, "GB/s")), _tp_step,
         "Shoeybi et al. 2019; Dubey et al. 2024 (Llama 3 405B: TP 8, PP 16, DP 192, 16M tokens at 8,192)",
         quoted="64 TB per step, 71 s at 900 GB/s",
         correction="126 x 4 x 128 GiB = 64,512 GiB, which is 69.3 TB, and 77 s at 900 GB/s: the quoted 71 s divides "
                    "64e12 bytes by 900e9, mixing TiB and TB. It also puts every token of the batch through one TP group "
                    "and every layer on one stage, without the ring's 2 (tp-1)/tp: one GPU (its replica's 1/192 of the "
                    "tokens, its stage's 8 layers) sends 40.1 GB, 89 ms at 450 GB/s",
         explore={"model": "llama3-405b", "gpu": "h100", "num_gpus": 24576, "seq_len": 8192, "global_batch": 1536,
                  "layout": {"tp": 8, "pp": 16, "cp": 1}}),
    Card("roofline", "Roofline: decode against prefill and training", "the accelerator",
         "ridge = peak / HBM bandwidth; decode: 2 P b FLOPs over P x bytes read, 2b / bytes FLOP/byte; a [T, d] x "
         "[d, d] matmul: T d / (2T + d) x 2 / bytes; reached = min(peak, intensity x bandwidth)",
         (Input("peak_tflops", "peak (dense 16-bit)", 989, "TFLOP/s"), Input("bw", "HBM bandwidth", 3352, "GB/s"),
          Input("P", "parameters", 8, "B"), Input("b", "decode batch", 1, "seq", True),
          Input("bytes_per_value", "bytes per value", 2), Input("T", "tokens per micro-batch", 4096, whole=True),
          Input("d", "hidden d", 4096, whole=True)), _roofline,
         "Williams et al. 2009; H100 SXM: 989 TFLOP/s, 3.35 TB/s",
         quoted="ridge ~295 FLOP/byte; decode at batch 1 ~1 FLOP/byte: memory-bound, under 1% of peak; training "
                "compute-bound"),
    Card("gqa", "Grouped-query attention heads per TP rank", "tensor parallelism",
         "query heads / tp per rank; KV heads / tp, or each KV head copied tp / KV times when tp > KV heads",
         (Input("heads", "query heads", 64, whole=True), Input("kv", "KV heads", 8, whole=True), Input("tp", "TP", 8, whole=True)),
         _gqa, "Ainslie et al. 2023", quoted="8 query heads and 1 KV head per GPU; TP 16 copies each KV head twice",
         explore=SEVENTY_B | {"num_gpus": 64, "layout": {"tp": 8}}),
    Card("checkpoint", "Checkpoint size and write time", "fault tolerance",
         "(2 + 4 + 8) bytes/param (bf16 weights, fp32 master, Adam moments); time = size / (writers x BW)",
         (Input("P", "parameters", 70, "B"), Input("gbps", "write bandwidth per writer", 10, "GB/s"),
          Input("writers", "parallel writers", 64, whole=True)), _checkpoint, "Eisenman et al. 2022 (Check-N-Run)",
         quoted="980 GB; 98 s; 1.5 s with 64 writers", explore=SEVENTY_B | {"num_gpus": 512}),
    Card("young", "Checkpoint interval (Young, Daly) and the cost of a crash", "fault tolerance",
         "Young sqrt(2 C M); Daly sqrt(2CM)(1 + sqrt(C/2M)/3 + C/18M) - C; a crash loses tau/2 + restart",
         (Input("C", "checkpoint time", 98, "s"), Input("mtbf_h", "cluster MTBF", 24, "h"), Input("step_s", "step time", 10, "s"),
          Input("gpus", "GPUs", 512, whole=True), Input("price", "price per GPU-hour", 2, "$"), Input("days", "run", 30, "days")),
         _young, "Young 1974; Daly 2006", quoted="68.5 min, ~410 steps, 34 min lost, 2.4% overhead; ~$618 per crash, ~$18,500",
         correction="GPUs x price x (tau/2 + restart) = 512 x $2 x (34.3 + 1.6) min = $613; the quoted $618 does not "
                    "follow from its inputs. The 2.4% is the checkpoints' overhead alone; with the work a crash "
                    "loses, the waste at Young's interval is sqrt(2C/M) = 4.8%",
         explore=SEVENTY_B | {"num_gpus": 512}),
    Card("fp16", "fp16 range and dynamic loss scaling", "mixed precision",
         "min normal 2^(1-bias); max (2 - 2^-10) 2^15; the scale halves on overflow, doubles after W clean steps",
         (Input("init_scale", "initial scale", 65536), Input("overflows", "overflows first", 2, whole=True),
          Input("clean_steps", "clean steps after", 100, whole=True), Input("window", "growth interval W", 2000, whole=True)),
         _fp16, "Micikevicius et al. 2018", quoted="2^-14 = 6.1e-5; 65504; S = 16384 after two overflows"),
)


def card(card_id: str) -> Card | None:
    return next((c for c in CARDS if c.id == card_id), None)
