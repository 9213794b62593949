"""`gridtrain plan --check RUN_DIR`: the planner's prediction for a finished gridtrain run beside
what each of its ranks measured (<run_dir>/accounting/rank<r>.jsonl).

Model state comes from the planner's own model of a rank (memory.rank_state under gridtrain's
convention, tensor by tensor in census.py), at each rank's pipeline and data-parallel
coordinates: what `gridtrain plan` predicts for the same layout. Activations and collectives
follow gridtrain's runtime as measured (below)."""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from gridtrain.model.args import ModelArgs, model_args
from gridtrain.parallel.dims import ParallelDims, stage_layer_counts
from gridtrain.plan.census import fsdp_local, numel, rank_stage_shapes
from gridtrain.plan.layout import Layout
from gridtrain.plan.memory import StateBytes, rank_state
from gridtrain.plan.shape import from_args

BUCKETS = ("params", "grads", "optimizer")
RECOMPUTE_NAMES = {"off": "none", "selective": "selective", "full": "full"}


def run_layout(args: ModelArgs, dims: ParallelDims, cfg: dict) -> Layout:
    """The planner's Layout of a gridtrain run (its config.json record)."""
    t, p = cfg["train"], cfg["parallel"]
    seq = cfg["data"]["seq_len"]
    local = (t["global_batch_tokens"] // seq if t["global_batch_tokens"] else t["global_batch"]) // dims.dp
    zero = p["zero_stage"] if dims.dp > 1 else 0
    return Layout(tp=dims.tp, pp=dims.pp, cp=dims.cp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard,
                  zero_stage=zero, micro_batch=t["micro_batch"], seq_len=seq,
                  num_microbatches=local // t["micro_batch"], schedule=p["pp_schedule"],
                  virtual_stages=p["pp_virtual_stages"] if dims.pp > 1 else 1,
                  sequence_parallel=p["sequence_parallel"], recompute=RECOMPUTE_NAMES[t["activation_checkpointing"]],
                  fewer_edge_layers=p["pp_fewer_edge_layers"])


def predict_rank(args: ModelArgs, dims: ParallelDims, cfg: dict, rank: int) -> dict[str, float]:
    """Predicted bytes per bucket for one rank of the run: the planner's rank_state under
    gridtrain's convention, at this rank's pipeline and data-parallel coordinates."""
    coords = dims.coordinates(rank)
    state = rank_state(from_args(args), run_layout(args, dims, cfg), coords["pp"],
                       StateBytes.gridtrain(cfg["train"]["precision"]), coords["dp"])
    return {"params": state.weights, "grads": state.gradients, "optimizer": state.optimizer}


def activation_bytes_per_microbatch(args: ModelArgs, dims: ParallelDims, seq_len: int, micro_batch: int,
                                    sequence_parallel: bool, layers: int, last: bool) -> float:
    """Bytes gridtrain's fp32 Llama block saves for backward, per micro-batch, on one rank: the
    census of what autograd keeps (measured tensor by tensor, `SavedActivations`), e = 4 bytes:
    - per layer, unsplit by TP: block input, RMSNorm's normalised input x_hat, the QKV input,
      the mid-block residual, its x_hat and the MLP input (6 h; with SP the four residual-side
      tensors are split by t, the two matmul inputs are gathered: 4h/t + 2h);
    - split by TP: Q, the attention output (the output projection's input, one storage), K and V
      (2 kv_width), SwiGLU's w1 and w3 outputs, silu output and product (4F): (2h + 2kv + 4F)/t;
    - RMSNorm's fp32 rsqrt (2 per layer, 4 s b each) and flash attention's log-sum-exp (4 a/t s b);
    - the last stage: final norm x, x_hat (split by SP), head input h, fp32 log-probabilities
      over the vocabulary shard (4 s b V/t) and the loss.
    Token ids and targets are added by the caller (their storage depends on the schedule)."""
    e, h, t = 4, args.dim, dims.tp
    sb = seq_len * micro_batch
    sp = t if sequence_parallel else 1
    kv = args.n_kv_heads * args.head_dim
    unsplit = 4 * h / sp + 2 * h if sequence_parallel else 6 * h
    split = (2 * h + 2 * kv + args.hidden_dim * 4) / t
    layer = e * sb * (unsplit + split) + 2 * 4 * sb / sp + 4 * (args.n_heads / t) * sb
    head = e * sb * (2 * h / sp + h) + 4 * sb / sp + 4 * sb * args.vocab_size / t + 4 if last else 0
    return layers * layer + head


def predict_activations(args: ModelArgs, dims: ParallelDims, cfg: dict, pp_rank: int) -> float:
    """Bytes saved on a rank up to its first backward (what `SavedActivations` measures); NaN
    where the census does not apply (bf16/fp16, activation checkpointing, other schedules)."""
    t, p = cfg["train"], cfg["parallel"]
    if t["precision"] != "fp32" or t["activation_checkpointing"] != "off":
        return float("nan")
    if dims.pp > 1 and p["pp_schedule"] not in ("gpipe", "1f1b"):
        return float("nan")
    seq, mb = cfg["data"]["seq_len"], t["micro_batch"]
    local = (t["global_batch_tokens"] // seq if t["global_batch_tokens"] else t["global_batch"]) // dims.dp
    m = local // mb
    num_stages = dims.pp
    counts = stage_layer_counts(args.n_layers, num_stages, p["pp_fewer_edge_layers"])
    first, last = pp_rank == 0, pp_rank == num_stages - 1
    if dims.pp == 1:
        in_flight = 1
    else:
        in_flight = m if p["pp_schedule"] == "gpipe" else min(dims.pp - pp_rank, m)
    per_micro = activation_bytes_per_microbatch(args, dims, seq, mb, p["sequence_parallel"],
                                                counts[pp_rank], last)
    # A pipeline chunks the whole local batch into views of one storage: ids and targets count whole.
    ids = 8 * seq * (local if dims.pp > 1 else mb)
    return in_flight * per_micro + ids * (first + last)


def predict_collectives(args: ModelArgs, dims: ParallelDims, cfg: dict, pp_rank: int) -> dict[str, float]:
    """Payload bytes per collective and mesh axis in one accounted step, for the layouts whose
    traffic is modelled exactly on CPU (gloo): DDP, FSDP (ZeRO 2 and 3, any precision) and HSDP, TP with or
    without SP, and single-stage pipelines. Keys as in the accounting ('dp_shard/all_gather_bytes'); empty when
    the layout is not modelled. gloo specifics: FSDP2 reduces gradients with an all-reduce (gloo
    has no reduce-scatter); the gradient norm all-reduces one fp32 scalar per sharded parameter
    tensor (DTensor's per-tensor norms) or one per pipeline (the squared total over 'pp')."""
    t, p = cfg["train"], cfg["parallel"]
    seq, mb = cfg["data"]["seq_len"], t["micro_batch"]
    local = (t["global_batch_tokens"] // seq if t["global_batch_tokens"] else t["global_batch"]) // dims.dp
    m = local // mb
    parts = rank_stage_shapes(from_args(args), dims.pp, p["pp_virtual_stages"], p["pp_schedule"],
                              p["pp_fewer_edge_layers"], pp_rank)
    shapes = {name: s for part in parts for name, s in part.items()}
    total = 4 * sum(numel(s) for s in shapes.values())
    layer = 4 * sum(numel(s) for n, s in shapes.items() if n.startswith(f"layers.{args.n_layers - 1}."))
    only = lambda *axes: all(getattr(dims, a) == 1 for a in ("tp", "pp", "dp_replicate", "dp_shard", "cp")
                             if a not in axes)
    activation = 4 * mb * seq * args.dim
    if p["zero_stage"] == 0 and only("dp_replicate"):
        return {"dp_replicate/all_reduce_bytes": total}
    if p["zero_stage"] in (2, 3) and only("dp_shard", "dp_replicate") and dims.dp_shard > 1:
        # ZeRO-2 gathers every unit once per micro-batch; ZeRO-3 again in backward, except the
        # last block, which stays gathered from its forward to its backward. Under bf16 and fp16
        # the parameters are gathered in that dtype (2 bytes) and the gradients reduced in fp32.
        # HSDP then all-reduces each micro-batch's gradient shard (FSDP2's padded chunks) over
        # the replicas.
        gathered = (total if p["zero_stage"] == 2 else 2 * total - layer) * gather_bytes(t["precision"]) / 4
        out = {"dp_shard/all_gather_bytes": m * gathered,
               "dp_shard/all_reduce_bytes": m * total + 4 * len(shapes)}
        if dims.dp_replicate > 1:
            shard = 4 * sum(numel(fsdp_local(s, dims.dp_shard, 0)) for s in shapes.values())
            out["dp_replicate/all_reduce_bytes"] = m * shard
        return out
    if only("tp") and dims.tp > 1:
        # Per micro-batch: two all-reduces per block forward and two backward, the embedding's
        # forward and the head input's backward (Megatron), plus loss_parallel's three of one
        # value per token; then one norm scalar per sharded tensor (7 per block and the head).
        # With SP each of those activation all-reduces is a reduce-scatter, which gloo runs as an
        # all-reduce of the same tensor; the norms' inputs are all-gathered (2 per block and the
        # final one), and the norms' weight gradients, partial per sequence shard, all-reduced once.
        norms = 2 * args.n_layers + 1
        per_micro = (4 * args.n_layers + 2) * activation + 3 * 4 * mb * seq
        reduced = m * per_micro + 4 * (7 * args.n_layers + 1)
        if not p["sequence_parallel"]:
            return {"tp/all_reduce_bytes": reduced}
        return {"tp/all_reduce_bytes": reduced + norms * 4 * args.dim,
                "tp/all_gather_bytes": m * norms * activation}
    if only("pp") and dims.pp > 1 and p["pp_schedule"] in ("gpipe", "1f1b"):
        first, last = pp_rank == 0, pp_rank == dims.pp - 1
        return {"pp/all_reduce_bytes": 4.0, "pp/send_bytes": m * activation * ((not last) + (not first))}
    return {}


def gather_bytes(precision: str) -> int:
    """Bytes per parameter element that FSDP all-gathers: the training dtype's."""
    return 2 if precision in ("bf16", "fp16") else 4


@dataclass
class CheckRow:
    rank: int
    bucket: str
    predicted: float
    measured: float

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("nan")


def check_run(run_dir: Path) -> list[CheckRow]:
    """Predicted against measured bytes per bucket for every rank that wrote accounting."""
    record = json.loads((run_dir / "config.json").read_text())
    cfg, d = record["config"], record["dims"]
    dims = ParallelDims(**d)
    model = {k: v for k, v in cfg["model"].items() if k != "preset"}
    args = model_args(cfg["model"]["preset"], **model)
    rows = []
    for path in sorted((run_dir / "accounting").glob("rank*.jsonl")):
        measured = json.loads(path.read_text().splitlines()[-1])
        predicted = predict_rank(args, dims, cfg, measured["rank"])
        for bucket in BUCKETS:
            rows.append(CheckRow(measured["rank"], bucket, predicted[bucket], measured[f"memory/{bucket}_bytes"]))
        pp_rank = dims.coordinates(measured["rank"])["pp"]
        acts = predict_activations(args, dims, cfg, pp_rank)
        rows.append(CheckRow(measured["rank"], "activations", acts, measured["memory/activations_bytes"]))
        for key, value in predict_collectives(args, dims, cfg, pp_rank).items():
            rows.append(CheckRow(measured["rank"], key, value, measured.get(f"comm/{key}", 0.0)))
    if not rows:
        raise FileNotFoundError(f"{run_dir}/accounting has no rank records: was metrics.account_every 0?")
    return rows


def measured_step_seconds(run_dir: Path) -> float:
    """Median `time/step_s` of the run's logged steps, leaving out the first (warm-up) and those
    that validated or ran the accounting (saved-tensor hooks and the flight recorder)."""
    times = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] > 1 and "time/step_s" in rec and "loss/val" not in rec and "memory/params_bytes" not in rec:
            times.append(rec["time/step_s"])
    if not times:
        raise ValueError(f"{run_dir}/metrics.jsonl has no plain steps to time: run more steps or "
                         "raise metrics.account_every")
    return statistics.median(times)


def check_step_time(run_dir: Path, calibration: dict | None = None) -> tuple[CheckRow, dict[str, float]]:
    """Predicted (slowest rank, localtime.py) against measured (median) seconds per step, and the
    prediction's parts. `calibration`: this machine's entry at the run's threads per rank
    (hardware.local_machine, which measures it when missing)."""
    from gridtrain.plan.localtime import LocalMachine, local_step

    record = json.loads((run_dir / "config.json").read_text())
    cfg, dims = record["config"], ParallelDims(**record["dims"])
    args = model_args(cfg["model"]["preset"], **{k: v for k, v in cfg["model"].items() if k != "preset"})
    threads = record.get("threads", 1)
    if calibration is None:
        from gridtrain.plan.hardware import local_machine  # noqa: PLC0415 - torch only for --check

        calibration = local_machine(threads)
    machine = LocalMachine.from_calibration(calibration, cfg["train"]["precision"],
                                            record.get("cpu_count") or os.cpu_count() or 1)
    steps = []
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        params = predict_rank(args, dims, cfg, rank)["params"] / 4
        counts = stage_layer_counts(args.n_layers, dims.pp, cfg["parallel"]["pp_fewer_edge_layers"])
        acts = activation_bytes_per_microbatch(args, dims, cfg["data"]["seq_len"], cfg["train"]["micro_batch"],
                                               cfg["parallel"]["sequence_parallel"], counts[coords["pp"]],
                                               coords["pp"] == dims.pp - 1)
        collectives = predict_collectives(args, dims, cfg, coords["pp"])
        steps.append(local_step(args, dims, cfg, machine, coords["pp"], acts, collectives, params, threads))
    slowest = max(steps, key=lambda s: s.compute_s if math.isnan(s.total_s) else s.total_s)
    parts = {"compute_s": slowest.compute_s, "bubble_s": slowest.bubble_s, "comm_s": slowest.comm_s,
             "optimizer_s": slowest.optimizer_s}
    return CheckRow(0, "step_time_s", slowest.total_s, measured_step_seconds(run_dir)), parts


def format_step_time(row: CheckRow, parts: dict[str, float]) -> str:
    detail = ", ".join(f"{k[:-2]} not modelled" if math.isnan(v) else f"{k[:-2]} {v:.4f}" for k, v in parts.items())
    return (f"step time on this machine: predicted {row.predicted:.4f} s ({detail}), measured "
            f"{row.measured:.4f} s (median of plain steps), measured/predicted {row.ratio:.3f}")


def format_check(rows: list[CheckRow]) -> str:
    lines = [f"{'rank':>4}  {'bucket':<30} {'predicted':>14} {'measured':>14} {'ratio':>7}"]
    for r in rows:
        pred = "-" if math.isnan(r.predicted) else f"{r.predicted:,.0f}"
        ratio = "-" if math.isnan(r.predicted) else f"{r.ratio:.4f}"
        lines.append(f"{r.rank:>4}  {r.bucket:<30} {pred:>14} {r.measured:>14,.0f} {ratio:>7}")
    return "\n".join(lines)
