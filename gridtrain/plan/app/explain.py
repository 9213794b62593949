"""`gridtrain plan --explain`: each figure of the plan as its formula with the numbers put in.

Every line is recomputed here from the planner's own functions, so the arithmetic shown is the
arithmetic done.
"""

from __future__ import annotations

import math

from gridtrain.layout.schedules import schedule
from gridtrain.plan import placement
from gridtrain.plan.flops import flops_per_token, hardware_flops_per_token
from gridtrain.plan.layout import Layout
from gridtrain.plan.memory import GiB, layer_activation_bytes, rank_params
from gridtrain.plan.pipeline import bubble_fraction, bubble_scale, schedule_bubble, split_cost
from gridtrain.plan.search import Candidate, Problem
from gridtrain.plan.shape import matmul_params
from gridtrain.plan.dptime import grad_levels
from gridtrain.plan.steptime import (HBM_PASSES, RECOMPUTE_PASSES, layer_attention_flops_per_token,
                                     layer_hardware_flops_per_token, pipeline_time)


def _g(x: float) -> str:
    """A number for humans: 3 significant digits with an SI suffix."""
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _ms(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def layout_lines(problem: Problem, layout: Layout) -> list[str]:
    return [
        f"GPUs = tp x cp x pp x dp = {layout.tp} x {layout.cp} x {layout.pp} x {layout.dp} = {layout.num_gpus:,}",
        f"micro-batches per step m = global batch / (dp x micro-batch) = {problem.global_batch_seqs:,} / "
        f"({layout.dp} x {layout.micro_batch}) = {layout.num_microbatches}",
    ]


def flops_lines(problem: Problem, layout: Layout) -> list[str]:
    s, t, span = problem.shape, layout.seq_len, layout.attention_span
    n = matmul_params(s)
    model = flops_per_token(s, t, span)
    hw = hardware_flops_per_token(s, t, layout.recompute, span)
    keys = f"{t:,}" if span is None else f"span {span:,.1f} (documents: sum L_i^2 / T)"
    return [
        f"model FLOPs/token = 6N + 12 L H Q T = 6 x {_g(n)} + 12 x {s.num_layers} x {s.num_heads} x "
        f"{s.head_dim} x {keys} = {_g(model)}",
        f"hardware FLOPs/token (recompute {layout.recompute}) = {_g(hw)} ({hw / model:.3f} x model)",
    ]


def layer_lines(problem: Problem, layout: Layout) -> list[str]:
    """One layer, one micro-batch, one GPU: matmuls, memory-bound kernels, TP."""
    s, eff, acc = problem.shape, problem.eff, problem.cluster.accelerator
    tokens = layout.tokens_per_microbatch / layout.cp
    keys = layout.seq_len if layout.attention_span is None else layout.attention_span
    per_token = layer_hardware_flops_per_token(s, keys, layout.recompute)
    attention = layer_attention_flops_per_token(s, keys, layout.recompute)
    matmul = (per_token - attention) * tokens / layout.tp / (acc.peak_flops * eff.matmul)
    core = attention * tokens / layout.tp / (acc.peak_flops * eff.attention_share)
    args = (s, layout.seq_len, layout.micro_batch, layout.tp, layout.sequence_parallel, layout.cp)
    saved = layer_activation_bytes(*args, "none", layout.flash_attention)
    kept = layer_activation_bytes(*args, layout.recompute, layout.flash_attention)
    rebuilt = saved - kept if layout.recompute != "none" else 0.0
    bound = (HBM_PASSES * saved + RECOMPUTE_PASSES * rebuilt) / (acc.hbm_gb_per_s * 1e9 * eff.hbm)
    lines = [
        f"matmuls per layer per micro-batch = FLOPs/token/layer outside attention x tokens / tp / (peak x "
        f"{eff.matmul:.0%}) = {_g(per_token - attention)} x {tokens:,.0f} / {layout.tp} / ({_g(acc.peak_flops)} x "
        f"{eff.matmul:.3g}) = {_ms(matmul)}; attention core {_g(attention)} x {tokens:,.0f} / {layout.tp} / "
        f"({_g(acc.peak_flops)} x {eff.attention_share:.3g}) = {_ms(core)}",
        f"memory-bound per layer = ({HBM_PASSES} x saved {_g(saved)}B + {RECOMPUTE_PASSES} x rebuilt "
        f"{_g(rebuilt)}B) / (HBM {acc.hbm_gb_per_s:g} GB/s x {eff.hbm}) = {_ms(bound)}",
    ]
    if layout.tp > 1:
        levels = placement.axis_levels(problem.cluster, layout.tp, 1, eff.intra_node, eff.inter_node)
        payload = tokens * s.hidden * problem.act_bytes
        count = 6 if layout.recompute == "full" else 4
        one = placement.all_reduce_time(payload, levels)
        lines.append(f"TP per layer = {count} all-reduces of tokens x h x 2 B = {_g(payload)}B over "
                     f"{placement.describe_levels(levels)} at {eff.intra_node:.0%}: {count} x {_ms(one)} "
                     f"= {_ms(count * one)} (2(t-1)/t x payload / bandwidth + latency each)")
    return lines


def pipeline_lines(problem: Problem, cand: Candidate) -> list[str]:
    layout, st = cand.layout, cand.time
    pt = pipeline_time(problem.shape, layout, problem.cluster, problem.eff, problem.act_bytes)
    m, p, v = layout.num_microbatches, layout.pp, layout.pp_virtual_stages
    lines = [f"one micro-batch on pipeline rank {pt.critical_rank} = {pt.layers} layers x "
             f"{_ms(pt.layer.total_s)}" + (f" + head {_ms(pt.head_s)}" if pt.head_s else "")
             + f" = {_ms(pt.micro_s)}; x m = {m}: {_ms(m * pt.micro_s)}"]
    if p > 1:
        f, sc = schedule_bubble(layout.pp_schedule, p, m, v), split_cost(layout.pp_schedule, layout.recompute)
        if sc != 1.0:
            form = "F + R + I + R + W over F + R + B" if layout.recompute == "full" else "F + I + W over F + B"
            lines.append(f"split backward ({form}, measured): micro-batch x {sc:.3f}")
        if schedule(layout.pp_schedule).runnable:
            closed = bubble_fraction(p, m, v)
            how = (f"torch's action order replayed with the measured F, B, I, W costs: idle fraction f = {f:.4f} "
                   f"(the closed form (p-1)/(v m + p-1) says {closed:.4f}"
                   + (", which holds only for m a multiple of p)" if abs(closed - f) > 1e-9 else ")"))
        else:
            how = (f"(p-1)/v x {bubble_scale(layout.pp_schedule):.2f} (Qi et al.'s closed form) over m x {sc:.3f} "
                   f"+ that: fraction f = {f:.4f}")
        lines.append(f"bubble ({layout.pp_schedule}, p={p}, v={v}, m={m}): {how}; "
                     f"f/(1-f) x m x micro-batch = {_ms(st.bubble_s)}")
        lines.append(f"pipeline sends = 2 x m x v x send(b s/cp x h x 2 B / tp) = 2 x {m} x {v} x "
                     f"{_ms(pt.pp_s / (2 * m * v))} = {_ms(st.pp_s)}")
    return lines


def dp_lines(problem: Problem, cand: Candidate) -> list[str]:
    layout, st, eff = cand.layout, cand.time, problem.eff
    shard, rep = grad_levels(layout, problem.cluster, eff)
    if not shard and not rep:
        return ["DP: one replica, no gradient reduction"]
    kind = {0: "DDP all-reduce in 25 MiB buckets", 1: "ZeRO-1 all-reduce in 25 MiB buckets, then its broadcast",
            2: "ZeRO-2 all-gather + reduce-scatter per sync",
            3: "ZeRO-3 all-gathers + reduce-scatter per sync"}[layout.zero_stage]
    replicated = layout.zero_stage == 0 and (layout.tp > 1 or layout.pp > 1)
    if replicated:
        kind = "FSDP replication: all-reduce per sync"
    if layout.zero_stage >= 2 or replicated and not eff.grads_once_per_step:
        syncs = 1 if layout.pp > 1 else layout.num_microbatches
        kind += f" ({syncs} sync{'s' if syncs > 1 else ''}: {'once a step beside a pipeline' if layout.pp > 1 else 'every micro-batch'})"
    where = " ; ".join(x for x in (f"shard over {placement.describe_levels(shard)}" if shard else "",
                                   f"replicate over {placement.describe_levels(rep)}" if rep else "") if x)
    c = eff.overlap_slowdown
    latency = "gloo's measured" if problem.cluster.gloo_step_s is not None else "NCCL's"
    def per_call(kind: str, levels: tuple) -> str:
        pat = placement.pat_latency(levels) if kind == "all_gather" else None
        return f"{placement.nccl_latency(kind, levels) * 1e6:,.1f} us" + (
            f" (PAT {pat * 1e6:,.1f} us at 0.75 of the bandwidth, where it is faster)" if pat else "")

    calls = " and ".join(f"{per_call(k, lv)} per {k.replace('_', '-')} call over {name}"
                         for k, lv, name in (("all_gather" if layout.zero_stage >= 2 else "all_reduce", shard,
                                              "the shard group"), ("all_reduce", rep, "the replicas")) if lv)
    head = f"DP ({kind}; {where}): {_ms(st.dp_total_s)} in all, by layer or bucket ({latency} latency: {calls}); "
    if c >= 1:
        overlap = f"none of it hidden (gloo's threads share the cores the compute runs on) = {_ms(st.dp_s)} exposed"
    else:
        waited = (st.dp_s - c * st.dp_total_s) / (1 - c)
        overlap = (f"{_ms(waited)} waited for after overlap with backward/forward compute (bucketed per layer) + "
                   f"{c:g} x the {_ms(st.dp_total_s - waited)} hidden (the matmuls slowed by the NCCL kernels "
                   f"beside them) = {_ms(st.dp_s)} exposed")
    return [head + overlap,
            f"optimizer (AdamW, memory-bound over this rank's 1/{layout.zero_shard_degree} of the "
            f"parameters) = {_ms(st.optimizer_s)}"]


def throughput_lines(problem: Problem, cand: Candidate) -> list[str]:
    st, layout = cand.time, cand.layout
    parts = " + ".join(f"{k} {v:.3g}" for k, v in st.parts().items() if v)
    return [f"step = {parts} = {st.total_s:.4g} s",
            f"tokens/s = global batch tokens / step = {layout.global_batch_tokens:,} / {st.total_s:.4g} "
            f"= {st.tokens_per_s:,.0f}",
            f"MFU = tokens/s x model FLOPs/token / (GPUs x peak) = {st.tokens_per_s:,.0f} x "
            f"{_g(st.model_flops_per_token)} / ({layout.num_gpus:,} x {_g(st.peak_flops)}) = {st.mfu:.1%}",
            f"HFU (hardware FLOPs, recomputation included) = {st.hfu:.1%}"]


def memory_lines(problem: Problem, cand: Candidate) -> list[str]:
    m, layout = cand.memory, cand.layout
    sb = problem.state
    n = layout.zero_shard_degree
    params = rank_params(problem.shape, layout, m.rank, m.layers)
    return [f"parameters on pipeline rank {m.rank} ({m.layers} layers, 1/{layout.tp} of each matrix): {_g(params)}",
            f"weights = params x {sb.weights:g} B" + (f" / {n}" if layout.zero_stage >= 3 else "")
            + f" = {m.weights / GiB:.2f} GiB; gradients = params x {sb.gradients:g} B"
            + (f" / {n}" if layout.zero_stage >= 2 else "") + f" = {m.gradients / GiB:.2f} GiB; "
            f"optimizer = params x {sb.optimizer:g} B" + (f" / {n}" if layout.zero_stage >= 1 else "")
            + f" = {m.optimizer / GiB:.2f} GiB",
            f"activations = layers x per-layer bytes x micro-batches in flight ({layout.pp_schedule}) "
            f"= {m.activations / GiB:.2f} GiB; buffers {m.buffers / GiB:.2f} GiB; "
            f"total {m.total / GiB:.2f} GiB of {problem.memory_limit / GiB:.1f} GiB usable"]


def budget_lines(report: dict) -> list[str]:
    b, c, a = report["budget"], report["checkpoint"], report["assumptions"]
    n = report["problem"]["num_gpus"]
    tps = report["chosen"]["tokens_per_s"]
    return [
        f"days = tokens / tokens/s / 86,400 = {_g(b['tokens'])} / {tps:,.0f} / 86,400 = {b['days']:.1f}",
        f"6ND = 6 x {_g(b['params'])} x {_g(b['tokens'])} = {b['six_nd_flops']:.3g} FLOPs = "
        f"{b['pf_days_6nd']:,.0f} PF-days",
        f"cost = GPUs x days x 24 x ${a['price_per_gpu_hour']}/GPU-h = {n:,} x {b['days']:.1f} x 24 x "
        f"{a['price_per_gpu_hour']} = ${b['cost_usd']:,.0f}",
        f"energy = GPUs x board power x hours x PUE {a['pue']} = {b['energy_kwh'] / 1e6:,.2f} GWh; "
        f"x ${a['electricity_per_kwh']}/kWh = ${b['electricity_usd']:,.0f}",
        f"checkpoint = 14 B x params = {c['size_bytes'] / 1e12:.2f} TB; write = size / min({c['writers']:,} "
        f"writers x {a['writer_gb_per_s']} GB/s, {a['storage_gb_per_s']} GB/s) = {c['write_s']:.1f} s",
        f"cluster MTBF = {a['mtbf_gpu_hours']:,.0f} GPU-hours / {n:,} GPUs = {c['cluster_mtbf_s'] / 3600:.2f} h; "
        f"Young sqrt(2 C M) = sqrt(2 x {c['write_s']:.1f} x {c['cluster_mtbf_s']:.0f}) = "
        f"{math.sqrt(2 * c['write_s'] * c['cluster_mtbf_s']) / 60:.1f} min; Daly = {c['daly_s'] / 60:.1f} min",
    ]


def explain(problem: Problem, cand: Candidate, report: dict) -> list[str]:
    """Every formula of the plan for `cand`, numbers included."""
    layout = cand.layout
    return (layout_lines(problem, layout) + flops_lines(problem, layout) + layer_lines(problem, layout)
            + pipeline_lines(problem, cand) + dp_lines(problem, cand) + throughput_lines(problem, cand)
            + memory_lines(problem, cand) + budget_lines(report))
