"""Everything `gridtrain plan` reports, as plain data (the JSON of `--json`; render.py prints it):
the units of one step, the ranked layouts, memory by bucket, the step-time breakdown, throughput,
the run's budget and its checkpoint cadence. Every assumption that is not an input is stated in
`Assumptions` and copied into the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gridtrain.plan import budget, comm, reliability
from gridtrain.plan.app.ranking import Row, why_first
from gridtrain.plan.layout import Layout
from gridtrain.layout.dims import ParallelDims
from gridtrain.plan.memory import BUCKETS, GiB, RankMemory, rank_memory, rank_state, state_index
from gridtrain.plan.runnable import refusal
from gridtrain.plan.search import Candidate, Problem, SearchResult
from gridtrain.plan.shape import param_counts


@dataclass(frozen=True)
class Assumptions:
    """What the plan assumes beyond its inputs (each printed with the plan)."""

    price_per_gpu_hour: float = 2.0
    """Rental price, $ per GPU-hour (an assumed round figure for H100 rental)."""
    pue: float = 1.4
    """Facility power usage effectiveness: cooling, network, storage on top of the GPUs (an assumed typical value)."""
    electricity_per_kwh: float = 0.05
    """$ per kWh (an assumed hyperscaler industrial rate)."""
    mtbf_gpu_hours: float = 50_000.0
    """Mean time between failures of one GPU (with its share of host, network and software).
    Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs (Llama 3 paper, sec.
    3.3.4) is 54 x 24 x 16,384 / 419 = 50,700 GPU-hours per failure."""
    writer_gb_per_s: float = 2.0
    """Checkpoint write bandwidth of one writing rank, GB/s."""
    storage_gb_per_s: float = 2000.0
    """Aggregate bandwidth of the checkpoint storage, GB/s (Llama 3's Tectonic: 2 TB/s sustained)."""
    restart_overhead_s: float = 12.0
    """Seconds from a failure to training again, besides reading the state: the failure noticed,
    processes started, the rendezvous, the process groups. Measured: 12 s from kill -9 of a worker
    to the next step (tests/test_multinode.py, two torchrun agents on one 2-core host); a
    16,384-GPU job's start-up takes longer."""
    ft_replicas: int = 8
    """Fault-tolerant replica groups (torchft over HSDP's replicate axis) the with-replicas goodput
    assumes; the layout's data-parallel ranks split into this many groups (memory not re-checked)."""
    peer_gb_per_s: float = 50.0
    """Network bandwidth of one GPU for a rejoining replica's state from a live peer, GB/s (a 400
    Gb/s NIC per GPU, Llama 3's RoCE fabric)."""


def layout_dict(layout: Layout) -> dict[str, object]:
    out = asdict(layout)
    out["dp"] = layout.dp
    return out


def candidate_dict(cand: Candidate) -> dict[str, object]:
    """One ranked layout: its degrees, step time by part, throughput and peak memory."""
    st = cand.time
    return {"layout": layout_dict(cand.layout), "step_s": st.total_s, "parts_s": st.parts(),
            "tokens_per_s": st.tokens_per_s, "mfu": st.mfu, "hfu": st.hfu,
            "model_flops_per_token": st.model_flops_per_token,
            "model_flops_per_step": st.model_flops_per_token * cand.layout.global_batch_tokens,
            "model_tflops_per_gpu": st.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": st.hardware_tflops_per_gpu,
            "peak_rank": cand.memory.rank, "peak_GiB": cand.memory.total / GiB}


def runs(problem: Problem, cand: Candidate) -> str:
    """'' when `gridtrain train` runs the layout, else why not."""
    if problem.model_keys is None:
        return "gridtrain trains Llama blocks only"
    return refusal(problem.model_keys, problem.global_batch_seqs, problem.precision, cand.layout)


def units_dict(problem: Problem, layout: Layout, total_tokens: float) -> dict[str, object]:
    """The units of one training step for the layout (budget.step_units)."""
    u = budget.step_units(problem.num_gpus, problem.cluster.gpus_per_node, layout.tp, layout.pp,
                          problem.shape.num_layers, layout.micro_batch, layout.seq_len,
                          layout.num_microbatches, total_tokens, layout.cp)
    return asdict(u) | {"gpus_per_node": problem.cluster.gpus_per_node, "tp": layout.tp,
                        "cp": layout.cp, "pp": layout.pp, "micro_batch": layout.micro_batch,
                        "seq_len": layout.seq_len, "pp_virtual_stages": layout.pp_virtual_stages}


def _rank_dict(m: RankMemory) -> dict[str, object]:
    return {"rank": m.rank, "layers": m.layers, "buckets_GiB": {b: getattr(m, b) / GiB for b in BUCKETS},
            "total_GiB": m.total / GiB}


def memory_dict(problem: Problem, cand: Candidate) -> dict[str, object]:
    """The peak rank's buckets against HBM, and beside them the first and last pipeline ranks'
    (`pipeline_ranks`: first, last and peak, each once, in rank order)."""
    m = cand.memory
    acc = problem.cluster.accelerator
    edges = sorted({0, cand.layout.pp - 1} - {m.rank})
    ranks = rank_memory(problem.shape, cand.layout, problem.state, problem.act_bytes, tuple(edges)) + [m]
    return _rank_dict(m) | {
        "hbm_GiB": acc.hbm_bytes / GiB, "limit_GiB": problem.memory_limit / GiB, "hbm_usable": problem.hbm_usable,
        "fits": m.total <= problem.memory_limit,
        "pipeline_ranks": [_rank_dict(r) for r in sorted(ranks, key=lambda r: r.rank)]}


def comm_dict(problem: Problem, cand: Candidate) -> dict[str, float]:
    """Bytes one GPU of the peak pipeline rank sends per optimizer step, by mesh axis
    (comm.bytes_per_step)."""
    return comm.bytes_per_step(problem.shape, cand.layout, cand.memory.rank, problem.state, problem.act_bytes)


def ranks_list(problem: Problem, layout: Layout) -> list[dict[str, object]]:
    """Model-state bytes of every rank (global rank order, mesh axes pp, dp_replicate, dp_shard,
    cp, tp), for worlds of at most 64 ranks: what `gridtrain plan --check` compares with a run."""
    if problem.num_gpus > 64:
        return []
    dims = ParallelDims(layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.pp, 1, problem.num_gpus)
    out = []
    for rank in range(problem.num_gpus):
        c = dims.coordinates(rank)
        state = rank_state(problem.shape, layout, c["pp"], problem.state, state_index(layout, c["dp"], c["cp"]))
        out.append({"rank": rank, "pp": c["pp"], "dp": c["dp"], "tp": c["tp"], "weights": state.weights,
                    "gradients": state.gradients, "optimizer": state.optimizer})
    return out


def budget_dict(problem: Problem, cand: Candidate, total_tokens: float, a: Assumptions) -> dict[str, float]:
    """Total compute, days at the predicted throughput, GPU-hours, cost, energy."""
    n, acc = problem.num_gpus, problem.cluster.accelerator
    params = param_counts(problem.shape).total
    days = total_tokens / cand.time.tokens_per_s / 86_400
    hours = budget.gpu_hours(n, days)
    kwh = budget.energy_kwh(n, acc.power_w, days, a.pue)
    six_nd = budget.training_flops(params, total_tokens)
    return {"tokens": total_tokens, "params": params,
            "model_flops": cand.time.model_flops_per_token * total_tokens,
            "six_nd_flops": six_nd, "pf_days_6nd": budget.pf_days(six_nd), "days": days,
            "optimizer_steps": total_tokens / cand.layout.global_batch_tokens,
            "gpu_hours": hours, "cost_usd": hours * a.price_per_gpu_hour, "energy_kwh": kwh,
            "electricity_usd": kwh * a.electricity_per_kwh,
            "chinchilla_tokens": budget.chinchilla_tokens(params)}


def checkpoint_dict(problem: Problem, cand: Candidate, days: float, a: Assumptions) -> dict[str, float]:
    """Checkpoint size and write time; Young's and Daly's intervals at the cluster's MTBF; the work
    and money a failure costs (restart = reloading the checkpoint)."""
    layout = cand.layout
    size = reliability.checkpoint_bytes(param_counts(problem.shape).total)
    writers = min(problem.num_gpus, layout.model_parallel * layout.zero_shard_degree)
    write_s = reliability.checkpoint_write_seconds(size, a.writer_gb_per_s * 1e9, writers,
                                                   a.storage_gb_per_s * 1e9)
    mtbf_s = reliability.cluster_mtbf(a.mtbf_gpu_hours * 3600, problem.num_gpus)
    daly = reliability.daly_interval(write_s, mtbf_s)
    return {"size_bytes": size, "writers": writers, "write_s": write_s, "cluster_mtbf_s": mtbf_s,
            "young_s": reliability.young_interval(write_s, mtbf_s), "daly_s": daly,
            "steps_between": max(1.0, daly // cand.time.total_s),
            "waste_fraction": reliability.waste_fraction(daly, write_s, mtbf_s),
            "expected_failures": reliability.expected_failures(days * 86_400, mtbf_s),
            "cost_per_failure_usd": reliability.cost_per_failure(
                problem.num_gpus, a.price_per_gpu_hour, daly, restart_s=write_s),
            **goodput_dict(problem, cand, size, write_s, daly, mtbf_s, a)}


def goodput_dict(problem: Problem, cand: Candidate, size: float, write_s: float, daly: float, mtbf_s: float,
                 a: Assumptions) -> dict[str, float]:
    """Goodput when each failure restarts the job from its checkpoint (reading it back as fast as
    it was written), and with `a.ft_replicas` fault-tolerant replica groups (a failed group
    fetches the state of one replica from a live peer, every rank of the group in parallel)."""
    restart_s = a.restart_overhead_s + write_s
    group_gpus = max(1, problem.num_gpus // a.ft_replicas)
    recovery_s = a.restart_overhead_s + size / (group_gpus * a.peer_gb_per_s * 1e9)
    return {"restart_s": restart_s, "ft_recovery_s": recovery_s, "ft_replicas": float(a.ft_replicas),
            "goodput_restart": reliability.goodput_restarting(daly, write_s, mtbf_s, restart_s),
            "goodput_ft": reliability.goodput_with_replicas(daly, write_s, mtbf_s, cand.time.total_s, recovery_s,
                                                            a.ft_replicas)}


def problem_dict(problem: Problem, model_name: str) -> dict[str, object]:
    s, cl = problem.shape, problem.cluster
    return {"model": model_name, "shape": asdict(s), "params": param_counts(s).total,
            "cluster": cl.name, "accelerator": cl.accelerator.name, "num_gpus": problem.num_gpus,
            "gpus_per_node": cl.gpus_per_node, "seq_len": problem.seq_len,
            "global_batch_seqs": problem.global_batch_seqs,
            "global_batch_tokens": problem.global_batch_seqs * problem.seq_len,
            "efficiency": asdict(problem.eff), "flash_attention": problem.flash_attention,
            "attention_span": problem.attention_span,
            "state_bytes": asdict(problem.state)}


def row_dict(problem: Problem, row: Row) -> dict[str, object]:
    """A ranked row: its best layout, and the choice its collapsed variants differ in."""
    out = candidate_dict(row.best) | {"refused": runs(problem, row.best)}
    if row.field:
        out |= {"varies": row.field, "values": row.values,
                "same_as": [layout_dict(c.layout) for c in row.same]}
    return out


def build_report(problem: Problem, result: SearchResult, rows: list[Row], model_name: str,
                 total_tokens: float, a: Assumptions, search_s: float) -> dict[str, object]:
    """The whole plan for the first row's layout, the ranked rows (ranking.collapse) and why the
    first leads."""
    chosen = rows[0].best
    bud = budget_dict(problem, chosen, total_tokens, a)
    return {"fits": True, "problem": problem_dict(problem, model_name), "assumptions": asdict(a),
            "search": {"enumerated": result.enumerated, "evaluated": result.evaluated,
                       "seconds": search_s},
            "chosen": candidate_dict(chosen),
            "units": units_dict(problem, chosen.layout, total_tokens),
            "ranked": [row_dict(problem, row) for row in rows],
            "why_first": why_first(rows, problem.memory_limit),
            "memory": memory_dict(problem, chosen), "bytes_per_axis": comm_dict(problem, chosen),
            "ranks": ranks_list(problem, chosen.layout), "budget": bud,
            "checkpoint": checkpoint_dict(problem, chosen, bud["days"], a)}


def no_fit_report(problem: Problem, result: SearchResult, model_name: str, reason: str) -> dict[str, object]:
    """What `plan --json` emits when no layout fits: the reason with its fixes, and the leanest
    layout tried (its step time, memory by bucket and bytes per axis), when there was one."""
    out: dict[str, object] = {"fits": False, "reason": reason, "problem": problem_dict(problem, model_name)}
    if result.leanest is not None:
        out["leanest"] = candidate_dict(result.leanest)
        out["memory"] = memory_dict(problem, result.leanest)
        out["bytes_per_axis"] = comm_dict(problem, result.leanest)
    return out
