"""`gridtrain plan`: parse the question, search the layouts, print (or emit as JSON) the plan.

Inputs that cannot be planned end here as PlanError: the message goes to stderr with the fix,
and the command returns 2 (never a traceback)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from typing import TextIO

from gridtrain.config import ConfigError
from gridtrain.config_load import BARE_FLAG, parse_overrides
from gridtrain.plan import budget
from gridtrain.plan.app import explain, ranking, render
from gridtrain.plan.app.fixes import fix_dict, no_fit
from gridtrain.plan.app.inputs import (batch_sequences, check_constraints, constraints_label, doc_span, parse_count,
                                       parse_layout, parse_whole, resolve_cluster, resolve_local, resolve_model)
from gridtrain.plan.app.report import Assumptions, build_report, no_fit_report
from gridtrain.plan.memory import BUCKETS, GiB
from gridtrain.plan.state import CONVENTIONS
from gridtrain.plan.app.experts import ep_note
from gridtrain.plan.runnable import train_command
from gridtrain.plan.search import Candidate, Constraints, PlanError, Problem, SearchResult, search
from gridtrain.plan.shape import param_counts
from gridtrain.plan.specs import ClusterSpec
from gridtrain.plan.steptime import IMPLEMENTATIONS

DEFAULT_BATCH_TOKENS = 2**22
"""~4M tokens per step when no batch is given: 2^22 = 512 x 8,192 = 4,194,304 (Llama 3 405B
starts at a 4M-token batch, Dubey et al. 2024, sec. 3.4.1)."""


def build_problem(args: argparse.Namespace, extra: list[str]) -> tuple[Problem, str, float, list[str]]:
    """(problem, model name, training tokens, notes) from the command line."""
    try:
        overrides = {k: "true" if v == BARE_FLAG else v for k, v in parse_overrides(extra).items()}
    except ConfigError as e:
        raise PlanError("; ".join(e.problems)) from None
    model = resolve_model(args.model, overrides, args.arch)
    local = None
    if args.gpu == "local" and not args.cluster:
        seq = parse_whole(args.seq_len, "--seq-len") if args.seq_len else model.max_seq_len
        local = resolve_local(parse_whole(args.num_gpus, "--num-gpus"), args.precision, model.shape.head_dim, seq,
                              model.shape.hidden)
        cluster = local.cluster
    else:
        cluster = resolve_cluster(args.gpu, args.cluster, args.hardware)
    if args.price is not None:
        cluster = replace(cluster, price_per_gpu_hour=args.price)
    notes: list[str] = []
    if local:
        share = f", each at 1/{local.contention:g} of them (the processes share the cores)" if local.contention > 1 else ""
        notes.append(f"--gpu local: {local.threads} thread(s) per process at the rates `gridtrain calibrate` measured "
                     f"here{share}; --implementation does not apply")
    seq_len = parse_whole(args.seq_len, "--seq-len") if args.seq_len else model.max_seq_len
    if args.global_batch and args.global_batch_tokens:
        raise PlanError("--global-batch and --global-batch-tokens are both given: give one (the batch in "
                        "sequences, or in tokens)")
    if args.global_batch:
        seqs = parse_whole(args.global_batch, "--global-batch")
    elif args.global_batch_tokens:
        seqs, note = batch_sequences(args.global_batch_tokens, seq_len)
        notes += [note] if note else []
    else:
        seqs = max(1, DEFAULT_BATCH_TOKENS // seq_len)
        notes.append(f"no batch given: {seqs:,} sequences x {seq_len:,} = {seqs * seq_len:,} tokens per step")
    num_gpus = parse_whole(args.num_gpus, "--num-gpus")
    if args.tokens:
        tokens = parse_count(args.tokens, "--tokens")
    else:
        tokens = budget.chinchilla_tokens(param_counts(model.shape).total)
        notes.append(f"no --tokens: the Chinchilla-optimal {tokens:.3g} (20 per parameter)")
    if not 0 < args.hbm_usable <= 1:
        raise PlanError(f"--hbm-usable {args.hbm_usable} must be in (0, 1]")
    notes += float8_notes(args, cluster)
    span, note = doc_span(getattr(args, "doc_len", None), seq_len)
    notes += [note] if note else []
    state = CONVENTIONS[args.convention](args.precision)
    model_keys = None if args.arch == "gpt" else (("model.preset", args.model), *sorted(overrides.items()))
    if model_keys is not None and span is not None:  # validate judges, and the command carries, the mask
        model_keys += (("data.doc_mask", True),)
    problem = Problem(model.shape, cluster, num_gpus, seq_len, seqs, flash_attention=not args.no_flash,
                      hbm_usable=args.hbm_usable, state=state, act_bytes=4 if args.precision == "fp32" else 2,
                      model_keys=model_keys, precision=args.precision, runnable_only=not args.any_layout,
                      float8=args.float8, attention_span=span,
                      eff=local.eff if local else IMPLEMENTATIONS[args.implementation])
    return problem, model.name, tokens, notes


def float8_notes(args: argparse.Namespace, cluster: ClusterSpec) -> list[str]:
    """--float8's requirement (bf16) and what it changes on this device (plan/float8.py)."""
    if args.float8 == "none" or (args.float8 == "auto" and args.precision != "bf16"):
        return []
    if args.precision != "bf16":
        raise PlanError(f"--float8 {args.float8} runs the block linears in float8 beside bf16, not beside "
                        f"--precision {args.precision}: give --precision bf16")
    acc = cluster.accelerator
    if args.float8 == "auto":
        return []  # search_float8 says what it chose
    if acc.fp8_tflops <= 0:
        return [f"--float8 {args.float8}: {acc.name} has no FP8 matmul, so the block linears run at its 16-bit "
                f"peak ({acc.peak_flops / 1e12:,.0f} TFLOP/s): no faster than bf16 (where float8 is emulated, as on "
                f"CPUs, slower, which the plan does not price)"]
    gather = ("FSDP gathers their weights in float8, 1 byte a parameter, with one fp32 scale each"
              if args.float8 == "tensorwise" else "FSDP gathers in bf16 (rowwise scales each row inside the matmul)")
    return [f"--float8 {args.float8}: the block linears' matmuls at {acc.name}'s FP8 peak ({acc.fp8_tflops:,.0f} "
            f"TFLOP/s dense, attention and the head at {acc.peak_flops / 1e12:,.0f}); {gather}; MFU stays against "
            f"the 16-bit peak; the casts' own time is not modelled"]


def search_float8(problem: Problem, c: Constraints, top: int) -> tuple[Problem, SearchResult, str]:
    """--float8 auto: the search with and without FP8 (tensorwise, where the device has an FP8
    matmul and the run is bf16), and the one whose best layout is faster (bf16 on a tie)."""
    plain = replace(problem, float8="none")
    if problem.precision != "bf16" or problem.cluster.accelerator.fp8_tflops <= 0:
        why = (f"--precision {problem.precision}: FP8 runs beside bf16 only" if problem.precision != "bf16"
               else f"{problem.cluster.accelerator.name} has no FP8 matmul")
        return plain, search(plain, c, top=top), f"--float8 auto: bf16 ({why})"
    fp8 = replace(problem, float8="tensorwise")
    results = {p.float8: (p, search(p, c, top=top)) for p in (plain, fp8)}
    best = {k: r.ranked[0].time.total_s if r.ranked else math.inf for k, (_, r) in results.items()}
    pick = "tensorwise" if best["tensorwise"] < best["none"] else "none"
    shown = {k: f"{v:.3f} s" if math.isfinite(v) else "no layout that fits and gridtrain train accepts"
             for k, v in best.items()}
    return (*results[pick], f"--float8 auto: {'FP8 tensorwise' if pick != 'none' else 'bf16'} chosen (best step "
            f"with FP8 tensorwise {shown['tensorwise']}, with bf16 {shown['none']})")


def fit_line(problem: Problem, c: Constraints, chosen: Candidate) -> str:
    """Why the chosen layout fits: its peak against the limit, and the largest bucket."""
    m = chosen.memory
    biggest = max(BUCKETS, key=lambda b: getattr(m, b))
    fixed = f"--layout {constraints_label(c)}: " if c.given() else ""
    return (f"{fixed}fits: pipeline rank {m.rank} peaks at {m.total / GiB:.1f} GiB of {problem.memory_limit / GiB:.1f} "
            f"GiB usable ({(problem.memory_limit - m.total) / GiB:.1f} GiB spare; largest bucket {biggest} "
            f"{getattr(m, biggest) / GiB:.1f} GiB)")


def plan(args: argparse.Namespace, extra: list[str], out: TextIO) -> int:
    problem, name, tokens, notes = build_problem(args, extra)
    constraints = parse_layout(args.layout) if args.layout else Constraints()
    problems = check_constraints(problem, constraints)
    if problems:
        raise PlanError("--layout is inconsistent:\n  " + "\n  ".join(problems))
    start = time.perf_counter()
    if args.float8 == "auto":
        problem, result, chose = search_float8(problem, constraints, 5 * args.top)
        notes += [chose] + float8_notes(argparse.Namespace(float8=problem.float8, precision=problem.precision),
                                        problem.cluster)
    else:
        result = search(problem, constraints, top=5 * args.top)  # rows that collapse leave room for more
    seconds = time.perf_counter() - start
    if not result.ranked:
        reason, fixes = no_fit(problem, constraints, result)
        if args.json:
            report = no_fit_report(problem, result, name, reason)
            report["fixes"] = [fix_dict(f, fixes[0].candidate.time.mfu) for f in fixes]
            json.dump(report, out, indent=2)
            out.write("\n")
        raise PlanError(reason)
    rows = ranking.collapse(ranking.order(result.ranked))[:args.top]
    chosen = rows[0].best
    assumptions = Assumptions(price_per_gpu_hour=problem.cluster.price_per_gpu_hour, pue=args.pue,
                              electricity_per_kwh=args.electricity_price, mtbf_gpu_hours=args.mtbf_hours)
    report = build_report(problem, result, rows, name, tokens, assumptions, seconds)
    report["notes"] = notes + [fit_line(problem, constraints, chosen)]
    if problem.shape.num_experts:
        report["notes"].append(ep_note(problem, constraints, chosen))
    if problem.model_keys is not None:
        report["train_command"] = train_command(problem.model_keys, problem.global_batch_seqs, problem.precision,
                                                chosen.layout, problem.cluster.gpus_per_node)
        if result.refused:
            report["notes"].append(f"{result.refused} faster or leaner layouts that fit were left out: gridtrain "
                                   "train refuses them (--any-layout ranks them too, labelled)")
    else:
        report["notes"].append("GPT blocks are planned for comparison with published runs; gridtrain trains "
                               "Llama blocks only, so there is no train command")
    lines = explain.explain(problem, chosen, report) if args.explain or args.json else None
    if args.json:
        report["explain"] = lines
        json.dump(report, out, indent=2)
        out.write("\n")
    else:
        out.write(render.render_report(report, lines if args.explain else None) + "\n\n")
        out.write(f"chosen layout: --layout {render.layout_label(report['chosen']['layout'])}\n")
        if "train_command" in report:
            out.write(f"train it: {report['train_command']}\n")
        out.write("".join(f"note: {n}\n" for n in report["notes"]))
    return 0


def run_plan(args: argparse.Namespace, extra: list[str], out: TextIO | None = None,
             err: TextIO | None = None) -> int:
    """The command: 0 with a plan on `out`, 2 with the reason and a fix on `err`."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        if args.reference:
            from gridtrain.plan.reference import reference_rows, render_reference
            from gridtrain.plan.reference_titan import render_titan, titan_rows

            out.write(render_reference(reference_rows()) + "\n\n" + render_titan(titan_rows()) + "\n")
            return 0
        return plan(args, extra, out)
    except PlanError as e:
        err.write(f"gridtrain plan: {e}\n")
        return 2
