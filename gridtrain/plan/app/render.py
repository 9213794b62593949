"""Text rendering of a plan report (report.build_report): the units table, the ranked layouts,
memory bars against HBM, the step-time breakdown, throughput, budget and checkpoint cadence."""

from __future__ import annotations

from gridtrain.plan.memory import BUCKETS

BAR = 50
"""Characters of a full bar (all of HBM, or the whole step)."""


def _bar(value: float, full: float, width: int = BAR) -> str:
    cells = value / full * width if full else 0.0
    whole = int(cells)
    return "#" * whole + ("+" if cells - whole >= 0.5 else "")


def _count(x: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def layout_label(layout: dict) -> str:
    """'tp=4,cp=4,pp=32,dp=32,zero=1,mb=1,recompute=none,schedule=zbv,v=2': the --layout syntax
    (',ep=8' after it under expert parallelism)."""
    dp = f"dp={layout['dp']}" if layout["dp_shard"] in (1, layout["dp"]) else (
        f"dp={layout['dp']},dp_shard={layout['dp_shard']}")
    ep = f",ep={layout['ep']}" if layout.get("ep", 1) > 1 else ""
    return (f"tp={layout['tp']},cp={layout['cp']},pp={layout['pp']},{dp},zero={layout['zero_stage']},"
            f"mb={layout['micro_batch']},recompute={layout['recompute']},schedule={layout['pp_schedule']},"
            f"v={layout['pp_virtual_stages']}{ep}")


def render_header(r: dict) -> list[str]:
    p, s = r["problem"], r["problem"]["shape"]
    block = "GPT (LayerNorm, GELU, learned positions)" if s["block"] == "gpt" else (
        "Llama (RMSNorm, GQA, SwiGLU" + (", QK-norm)" if s.get("qk_norm") else ")"))
    width = f" of {s['explicit_head_dim']}" if s.get("explicit_head_dim") else ""  # wider than hidden / heads
    return [f"model {p['model']}: {_count(p['params'])} parameters, {s['num_layers']} layers, hidden "
            f"{s['hidden']}, {s['num_heads']} heads{width} ({s['num_kv_heads']} KV), ffn {s['ffn']}, vocab "
            f"{s['vocab']:,}, {block}",
            f"cluster {p['cluster']}: {p['num_gpus']:,} x {p['accelerator']}, {p['gpus_per_node']} per node; "
            f"sequence {p['seq_len']:,}, global batch {p['global_batch_seqs']:,} sequences = "
            f"{p['global_batch_tokens']:,} tokens"]


def render_units(r: dict) -> list[str]:
    """The units of one training step, as a summary table, for the chosen layout."""
    u = r["units"]
    stage_gpus = u["tp"] * u["cp"]
    rows = [
        ("GPU", f"{u['num_gpus']:,}", f"1 {r['problem']['accelerator']}", "physical accelerator"),
        ("Node", f"{u['num_nodes']:,}", f"{u['gpus_per_node']} GPUs", "NVLink domain"),
        ("Tensor-parallel group", f"{u['tp_groups']:,}", f"{u['tp']} GPUs (TP={u['tp']})",
         "splits each layer's matrices"),
        ("Pipeline stage", f"{u['pipeline_stages']:,}", f"{stage_gpus} GPUs (TP x CP={u['cp']})",
         f"owns ~{u['layers_per_stage']:.3g} layers ({u['pp_virtual_stages']} chunk(s))"),
        ("Model-parallel group", f"{u['replicas']:,}", f"{u['model_parallel_gpus']} GPUs "
         f"(TP x CP x PP={u['pp']})", "one full model copy"),
        ("Data-parallel replica", f"{u['replicas']:,}", f"{u['model_parallel_gpus']} GPUs",
         "independent data, syncs gradients"),
        ("Micro-batch", f"{u['replicas']:,} per fwd/bwd", f"{u['micro_batch']} x {u['seq_len']:,} = "
         f"{u['tokens_per_microbatch']:,} tokens", "one replica's input per pass"),
        ("Gradient accumulation", f"{u['accumulation']} steps", "", "micro-batches before sync"),
        ("Global batch", "1 per optimizer step", f"{u['global_batch_tokens']:,} tokens",
         "replicas x accumulation x micro-batch"),
        ("Optimizer step", f"{u['optimizer_steps']:,.0f} total", "", "one weight update"),
    ]
    w = [max(len(row[i]) for row in rows) for i in range(3)]
    head = f"{'Unit':<{w[0]}}  {'Count':<{w[1]}}  {'Size':<{w[2]}}  Key relationship"
    return ["Units of one step:", head, "-" * len(head)] + [
        f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in rows]


def render_ranked(r: dict) -> list[str]:
    head = (f"{'#':>2} {'tp':>2} {'cp':>2} {'pp':>3} {'dp':>5} {'shard':>5} {'zero':>4} {'schedule':<16} "
            f"{'v':>1} {'mb':>3} {'m':>4} {'recompute':<9} {'peak GiB':>8} {'step s':>7} {'tokens/s':>9} {'MFU':>6}")
    s = r["search"]
    lines = [f"Best layouts ({s['enumerated']:,} in the search space, {s['evaluated']:,} timed, "
             f"{s['seconds']:.2f} s):", head, "-" * len(head)]
    for i, c in enumerate(r["ranked"], 1):
        lay = c["layout"]
        lines.append(f"{i:>2} {lay['tp']:>2} {lay['cp']:>2} {lay['pp']:>3} {lay['dp']:>5} {lay['dp_shard']:>5} "
                     f"{lay['zero_stage']:>4} {lay['pp_schedule']:<16} {lay['pp_virtual_stages']:>1} "
                     f"{lay['micro_batch']:>3} {lay['num_microbatches']:>4} {lay['recompute']:<9} "
                     f"{c['peak_GiB']:>8.1f} {c['step_s']:>7.3f} {_count(c['tokens_per_s']):>9} {c['mfu']:>6.1%}"
                     + (f"  {SHORT.get(c['varies'], c['varies'])} {', '.join(map(str, c['values']))} alike"
                        if c.get("varies") else ""))
    if any(c.get("varies") for c in r["ranked"]):
        lines.append("'alike': layouts differing only in that choice, within 0.5% of each other's step time")
    return lines + r.get("why_first", [])


SHORT = {"pp_virtual_stages": "v", "micro_batch": "mb", "zero_stage": "zero", "pp_schedule": "schedule",
         "dp_shard": "shard", "recompute": "recompute"}


def render_memory(r: dict) -> list[str]:
    m = r["memory"]
    hbm, limit = m["hbm_GiB"], m["limit_GiB"]
    lines = [f"Memory of pipeline rank {m['rank']} ({m['layers']} layers; the rank that peaks), one bar "
             f"= {hbm:.1f} GiB of HBM, '|' = the {m['hbm_usable']:.0%} a plan may use:"]
    for b in BUCKETS:
        lines.append(f"  {b:<12}{m['buckets_GiB'][b]:>7.2f} GiB  {_bar(m['buckets_GiB'][b], hbm)}")
    mark = int(limit / hbm * BAR)
    total = _bar(m["total_GiB"], hbm).ljust(BAR, ".")
    total = total[:mark] + "|" + total[mark:]
    verdict = "fits" if m["fits"] else "does NOT fit"
    lines.append(f"  {'total':<12}{m['total_GiB']:>7.2f} GiB  [{total}] {verdict} "
                 f"({m['total_GiB']:.1f} of {limit:.1f} GiB usable)")
    return lines


def render_step(r: dict) -> list[str]:
    c = r["chosen"]
    step = c["step_s"]
    names = {"compute": "compute (matmul + memory-bound)", "tp": "TP collectives (critical path)",
             "cp": "CP ring sends (exposed)", "ep": "EP all-to-alls (in line)", "pp": "pipeline sends",
             "bubble": "pipeline bubble", "dp": "DP/FSDP (exposed after overlap)", "optimizer": "optimizer step"}
    lines = [f"Step time {step:.3f} s on the critical pipeline rank:"]
    for k, v in c["parts_s"].items():
        if k == "ep" and not v:  # a dense model, or experts without expert parallelism
            continue
        lines.append(f"  {names[k]:<34}{v:>8.3f} s {v / step:>6.1%}  {_bar(v, step)}")
    lines.append(f"Throughput {c['tokens_per_s']:,.0f} tokens/s; per GPU {c['model_tflops_per_gpu']:.0f} "
                 f"TFLOP/s model, {c['hardware_tflops_per_gpu']:.0f} hardware; MFU {c['mfu']:.1%}, "
                 f"HFU {c['hfu']:.1%}")
    return lines


def render_budget(r: dict) -> list[str]:
    b, k, a = r["budget"], r["checkpoint"], r["assumptions"]
    return [
        f"Run: {_count(b['tokens'])} tokens = {b['optimizer_steps']:,.0f} steps; 6ND = {b['six_nd_flops']:.3g} "
        f"FLOPs = {b['pf_days_6nd']:,.0f} PF-days (Chinchilla-optimal: {_count(b['chinchilla_tokens'])} tokens)",
        f"  {b['days']:.1f} days at the predicted throughput, {b['gpu_hours']:,.0f} GPU-hours, "
        f"${b['cost_usd']:,.0f} at ${a['price_per_gpu_hour']}/GPU-hour",
        f"  energy {b['energy_kwh'] / 1e6:,.2f} GWh (board power x PUE {a['pue']}), electricity "
        f"${b['electricity_usd']:,.0f} at ${a['electricity_per_kwh']}/kWh",
        f"Checkpoint: {k['size_bytes'] / 1e12:.2f} TB (14 bytes/parameter), written by {k['writers']:,} ranks "
        f"in {k['write_s']:.1f} s ({a['writer_gb_per_s']} GB/s each, storage capped at {a['storage_gb_per_s']:,.0f} GB/s)",
        f"  MTBF {a['mtbf_gpu_hours']:,.0f} GPU-hours per GPU (Llama 3: 419 interruptions in 54 days on 16,384 "
        f"GPUs) -> {k['cluster_mtbf_s'] / 3600:.2f} h for the cluster; {k['expected_failures']:,.0f} failures expected",
        f"  checkpoint every {k['daly_s'] / 60:.1f} min (Daly; Young {k['young_s'] / 60:.1f} min) = every "
        f"{k['steps_between']:,.0f} steps; {k['waste_fraction']:.1%} of time lost to checkpoints and "
        f"rework; ${k['cost_per_failure_usd']:,.0f} per failure",
        f"  goodput {k['goodput_restart']:.2%} restarting the job on each failure (restart {k['restart_s']:.0f} s: "
        f"{a['restart_overhead_s']:g} s start-up + reading the checkpoint); {k['goodput_ft']:.2%} with "
        f"{k['ft_replicas']:.0f} fault-tolerant replica groups (torchft: the others keep stepping, the failed group "
        f"rejoins from a live peer in {k['ft_recovery_s']:.0f} s at {a['peer_gb_per_s']:g} GB/s per GPU)",
    ]


def render_report(r: dict, explain_lines: list[str] | None = None) -> str:
    parts = [render_header(r), render_units(r), render_ranked(r), render_memory(r), render_step(r),
             render_budget(r)]
    if explain_lines:
        parts.append(["How each figure is computed:"] + [f"  {line}" for line in explain_lines])
    return "\n\n".join("\n".join(p) for p in parts)
