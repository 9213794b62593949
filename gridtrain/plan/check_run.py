"""`gridtrain plan --check RUN_DIR`: the planner's prediction for a finished gridtrain run beside
what each of its ranks measured (<run_dir>/accounting/rank<r>.jsonl).

Model state comes from the planner's own model of a rank (memory.rank_state under gridtrain's
convention, tensor by tensor in census.py), at each rank's pipeline and data-parallel
coordinates: what `gridtrain plan` predicts for the same layout. Activations and collectives
follow gridtrain's runtime as measured (below). Under expert parallelism the bytes one rank moves
in its all-to-alls depend on where its tokens were routed: its rows predict their expectation
under uniform routing, and one more row per such collective sets the ranks' sum, which routing
does not change, beside the prediction's (plan/moe_collectives.py)."""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from gridtrain.config import Config
from gridtrain.layout.dims import ParallelDims, stage_layer_counts
from gridtrain.layout.schedules import forwards_held
from gridtrain.model.args import ModelArgs
from gridtrain.plan.activations import held_bytes, ring_selective_bytes_per_token, stage_bytes, stage_moe_layers
from gridtrain.plan.machine import cached_entry
from gridtrain.plan.memory import STATE_BUCKETS, fsdp_gathers, rank_state, state_index
from gridtrain.plan.moe_collectives import routed_exactly, routed_keys
from gridtrain.plan.state import StateBytes
from gridtrain.plan.run_collectives import collectives, predict_collectives, run_layout
from gridtrain.plan.shape import from_args
from gridtrain.rundir import RunRecord


def predict_rank(args: ModelArgs, dims: ParallelDims, cfg: Config, rank: int) -> dict[str, float]:
    """Predicted bytes per bucket for one rank of the run: the planner's rank_state under
    gridtrain's convention, at this rank's pipeline and data-parallel coordinates."""
    coords, layout = dims.coordinates(rank), run_layout(args, dims, cfg)
    state = rank_state(from_args(args), layout, coords["pp"], StateBytes.gridtrain(cfg.train.precision),
                       state_index(layout, coords["dp"], coords["cp"]))
    return {bucket: getattr(state, bucket) for bucket in STATE_BUCKETS}


def predict_activations(args: ModelArgs, dims: ParallelDims, cfg: Config, pp_rank: int, cp_rank: int = 0) -> float:
    """Bytes saved on a rank up to its first backward (what `SavedActivations` measures): the
    forwards its stages ran by then (schedules.forwards_held), each saving what activations.py's
    census says for the rank's tokens (seq/cp of each sequence under CP; with selective
    recomputation, the ring's kernel outputs of CP rank `cp_rank`), with the weight casts or norm
    copies of its precision, the token ids and targets, and under fp16 the loss scale (one fp32
    scalar every micro-batch's scaled loss keeps for its backward)."""
    shape, layout = from_args(args), run_layout(args, dims, cfg)
    v, seq = layout.pp_virtual_stages, layout.seq_len // dims.cp
    counts = stage_layer_counts(args.n_layers, dims.pp * v, cfg.parallel.pp_fewer_edge_layers)
    held = forwards_held(layout.pp_schedule, dims.pp, v, layout.num_microbatches, pp_rank)
    total = held_bytes(shape, held, counts, layout.micro_batch * seq, cfg.train.precision,
                       layout.recompute, dims.tp, layout.sequence_parallel, fsdp_gathers(layout), dims.ep)
    ring = ring_selective_bytes_per_token(shape, cfg.train.precision, layout.recompute, dims.tp, dims.cp, cp_rank)
    total += ring * layout.micro_batch * seq * sum(n * counts[s] for s, n in held.items())
    # A pipeline chunks the whole local batch into views of one storage: ids and targets count whole.
    ids = 8 * seq * (layout.micro_batch * layout.num_microbatches if dims.pp > 1 else layout.micro_batch)
    last = len(counts) - 1 in held
    scale = 4 * (cfg.train.precision == "fp16" and last)  # fp16's S, saved by the scaled loss's product
    return total + ids * ((0 in held) + last) + scale


def microbatch_activations(args: ModelArgs, dims: ParallelDims, cfg: Config, pp_rank: int) -> float:
    """Bytes one micro-batch's forward saves through all of a pipeline rank's stages."""
    shape, layout = from_args(args), run_layout(args, dims, cfg)
    v = layout.pp_virtual_stages
    counts = stage_layer_counts(args.n_layers, dims.pp * v, cfg.parallel.pp_fewer_edge_layers)
    held = forwards_held(layout.pp_schedule, dims.pp, v, layout.num_microbatches, pp_rank)
    moe = stage_moe_layers(shape, counts)
    return sum(stage_bytes(shape, counts[s], s == len(counts) - 1, layout.micro_batch * layout.seq_len // dims.cp,
                           cfg.train.precision, cfg.train.recompute, dims.tp,
                           layout.sequence_parallel, moe[s]) for s in held)


@dataclass
class CheckRow:
    rank: int
    bucket: str
    predicted: float
    measured: float
    estimated: bool = False
    """The prediction is estimate_collectives', not the exact model's."""
    missing: bool = False
    """A collective the run made that the planner does not predict (`predicted` is nan)."""
    routed: bool = False
    """The bytes depend on routing: the prediction is the rank's expectation under uniform routing
    (on the all-ranks row, rank ALL_RANKS, the ranks' sum: exact for dropless routing)."""
    data_wait: float = float("nan")
    """On the step-time row: the measured seconds a step waited for its batch (median), nan where
    the run did not log it."""

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("nan")


ALL_RANKS = -1
"""The rank of a row that sums every rank's (a routed collective's)."""


def check_run(run_dir: Path) -> list[CheckRow]:
    """Predicted against measured bytes per bucket for every rank that wrote accounting, then,
    where every rank of the job did, the ranks' sums of the collectives that routing spreads
    unevenly over them (a sum over some of the ranks, a dry run's one rank, depends on routing)."""
    record = RunRecord.load(run_dir)
    cfg, dims, args = record.config, record.dims, record.config.model.args()
    routed, moe = routed_keys(args, dims), args.moe is not None
    rows, all_exact = [], True
    paths = sorted((run_dir / "accounting").glob("rank*.jsonl"))
    for path in paths:
        measured = json.loads(path.read_text().splitlines()[-1])
        predicted = predict_rank(args, dims, cfg, measured["rank"])
        for bucket in STATE_BUCKETS:
            rows.append(CheckRow(measured["rank"], bucket, predicted[bucket], measured[f"memory/{bucket}_bytes"]))
        pp_rank, cp_rank = (dims.coordinates(measured["rank"])[axis] for axis in ("pp", "cp"))
        acts = predict_activations(args, dims, cfg, pp_rank, cp_rank)
        # A mixture of experts' census is exact in one process (activations.py); under expert parallelism
        # a rank's experts save the rows routing sent them (their expectation predicted), under a
        # capacity the rows kept (estimated).
        rows.append(CheckRow(measured["rank"], "activations", acts, measured["memory/activations_bytes"],
                             moe and not routed_exactly(args), routed=moe and dims.ep > 1))
        predicted, exact = collectives(args, dims, cfg, pp_rank, gloo=record.backend == "gloo")
        all_exact = all_exact and exact  # the summed rows are exact only if every rank's are
        for key, value in predicted.items():
            rows.append(CheckRow(measured["rank"], key, value, measured.get(f"comm/{key}", 0.0), not exact,
                                 routed=key in routed))
        for key, value in sorted(measured_collectives(measured).items()):
            if key not in predicted:
                rows.append(CheckRow(measured["rank"], key, math.nan, value, missing=True))
    if not rows:
        raise FileNotFoundError(f"{run_dir}/accounting has no rank records: was metrics.account_every 0?")
    if len(paths) < dims.world_size:
        return rows
    return rows + ranks_summed(rows, routed, all_exact and routed_exactly(args))


def ranks_summed(rows: list[CheckRow], keys: set[str], exact: bool) -> list[CheckRow]:
    """One row per key of `keys`: predicted and measured bytes summed over the ranks' rows."""
    out = []
    for key in sorted(keys):
        mine = [r for r in rows if r.bucket == key and not r.missing]
        if mine:
            out.append(CheckRow(ALL_RANKS, key, sum(r.predicted for r in mine), sum(r.measured for r in mine),
                                estimated=not exact, routed=True))
    return out


def measured_collectives(record: dict[str, float]) -> dict[str, float]:
    """Payload bytes per mesh axis and kind of collective in an accounting record
    ('dp_shard/all_gather_bytes'; the pipeline's and the ring's 'pp/send_bytes', 'cp/send_bytes'):
    every collective the rank made in the step, each counted once (not on the wire); a counter
    that stayed at 0 (the ring's sends under the all-gather rotation) made none."""
    return {key[len("comm/"):]: value for key, value in record.items()
            if key.startswith("comm/") and key.endswith("_bytes") and not key.endswith("_wire_bytes") and value}


def measured_step_seconds(run_dir: Path) -> float:
    """Median `time/step_s` of the run's logged steps, leaving out the first (warm-up) and those
    that validated or ran the accounting (saved-tensor hooks and the flight recorder)."""
    times = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] > 1 and "time/step_s" in rec and "loss/val" not in rec and "memory/weights_bytes" not in rec:
            times.append(rec["time/step_s"])
    if not times:
        raise ValueError(f"{run_dir}/metrics.jsonl has no plain steps to time: run more steps or "
                         "raise metrics.account_every")
    return statistics.median(times)


def measured_data_wait(run_dir: Path) -> float:
    """Median `time/data_wait_s` of the steps measured_step_seconds times; nan for a run that did not log it."""
    waits = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] > 1 and "time/data_wait_s" in rec and "loss/val" not in rec and "memory/weights_bytes" not in rec:
            waits.append(rec["time/data_wait_s"])
    return statistics.median(waits) if waits else float("nan")


def check_step_time(run_dir: Path, calibration: dict | None = None) -> tuple[CheckRow, dict[str, float]]:
    """Predicted (slowest rank, localtime.py) against measured (median) seconds per step, and the
    prediction's parts. `calibration`: this machine's entry at the run's threads per rank; by
    default the one `gridtrain calibrate` cached (the command measures it first when missing)."""
    from gridtrain.plan.localtime import LocalMachine, local_step

    record = RunRecord.load(run_dir)
    cfg, dims, args, threads = record.config, record.dims, record.config.model.args(), record.threads
    calibration = calibration or cached_entry(threads)
    if "gloo_bytes_per_s" not in calibration:
        raise ValueError(f"no calibration of this machine at {threads} thread(s) per rank: run "
                         f"`gridtrain calibrate --threads {threads}`")
    machine = LocalMachine.from_calibration(calibration, cfg.train.precision,
                                            record.cpu_count or os.cpu_count() or 1, args, cfg.data.seq_len)
    span = run_span(cfg)
    steps = []
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        params = predict_rank(args, dims, cfg, rank)["weights"] / 4
        acts = microbatch_activations(args, dims, cfg, coords["pp"])
        collectives = predict_collectives(args, dims, cfg, coords["pp"])
        steps.append(local_step(args, dims, cfg, machine, coords["pp"], acts, collectives, params, threads, span))
    slowest = max(steps, key=lambda s: s.compute_s if math.isnan(s.total_s) else s.total_s)
    parts = {"compute_s": slowest.compute_s, "bubble_s": slowest.bubble_s, "comm_s": slowest.comm_s,
             "optimizer_s": slowest.optimizer_s}
    return CheckRow(0, "step_time_s", slowest.total_s, measured_step_seconds(run_dir),
                    data_wait=measured_data_wait(run_dir)), parts


def run_span(cfg: Config) -> float | None:
    """The attention span of a data.doc_mask run (None without it), from its prepared data
    (data/doc_span.py); ValueError, which the check prints as its step-time line, where the data
    is not on this machine."""
    from gridtrain.data.doc_span import run_attention_span
    from gridtrain.errors import UserError

    try:
        return run_attention_span(cfg)
    except UserError as err:
        raise ValueError(str(err)) from None


def span_line(cfg: Config) -> tuple[str | None, bool]:
    """--check's line on document masking: the span its step time and MFU count (None without it),
    and whether the span is known (False: the run's documents are not on this machine)."""
    if not cfg.data.doc_mask:
        return None, True
    from gridtrain.plan.documents import span_note

    try:
        span = run_span(cfg)
    except ValueError as err:
        return f"attention: {err}", False
    return "attention: " + span_note(cfg.data.seq_len, span, "the run's prepared documents, cut as it cut them"), True


DOC_KERNEL_NOTE = ("note: on a CPU, data.doc_mask runs gridtrain's blockwise document attention, priced here at "
                   "causal SDPA's calibrated rate; its own rate is not calibrated, and at short sequences its "
                   "per-block overhead makes it far slower (python bench/bench_doc_attention.py)")


def format_step_time(row: CheckRow, parts: dict[str, float], where: str = "on this machine") -> str:
    detail = ", ".join(f"{k[:-2]} not modelled" if math.isnan(v) else f"{k[:-2]} {v:.4f}" for k, v in parts.items())
    waited = "" if math.isnan(row.data_wait) else (
        f", of which waiting for data {row.data_wait:.4f} s ({100 * row.data_wait / row.measured:.2f}%)")
    return (f"step time {where}: predicted {row.predicted:.4f} s ({detail}), measured "
            f"{row.measured:.4f} s (median of plain steps{waited}), measured/predicted {row.ratio:.3f}")


def format_check(rows: list[CheckRow]) -> str:
    lines = [f"{'rank':>4}  {'bucket':<30}  {'predicted':>13} {'measured':>14} {'ratio':>7}"]
    for r in rows:
        pred = "missing" if r.missing else "-" if math.isnan(r.predicted) else f"{r.predicted:,.0f}"
        ratio = "-" if math.isnan(r.predicted) else f"{r.ratio:.4f}"
        mark = "~" if r.estimated else "!" if r.missing else "r" if r.routed and r.rank != ALL_RANKS else " "
        rank = "all" if r.rank == ALL_RANKS else r.rank
        lines.append(f"{rank:>4}  {r.bucket:<30}{mark}{pred:>14} {r.measured:>14,.0f} {ratio:>7}")
    if any(r.estimated for r in rows):
        lines.append("~ estimated: not modelled exactly (this layout's collectives composed axis by axis, "
                     "plan/run_collectives.py estimate_collectives; a mixture of experts' routed bytes and "
                     "activations under a capacity)")
    if any(r.routed for r in rows):
        lines.append("r routed: the rank's bytes depend on where its tokens went; predicted: their expectation "
                     "under uniform routing; 'all' (where every rank recorded): the ranks' sum, which routing does "
                     "not change")
    if any(r.missing for r in rows):
        lines.append("! missing: the run made this collective and the planner predicts none")
    return "\n".join(lines)
