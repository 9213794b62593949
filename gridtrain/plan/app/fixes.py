"""When no layout fits: why (the leanest layout's memory against the usable HBM), and the fixes
that do fit, best first, each a layout one can apply as it stands.

A fix frees one choice the `--layout` fixed and lets the search set it (the others stay as given),
or, with nothing fixed, plans for more GPUs. Fixes are ranked by the MFU their best layout reaches;
fixes whose MFU lies within PLANNER_ERROR of the best remaining one are the planner's tie, and
among them the one that changes fewer of the layout's choices comes first (on Llama 2 7B over 8
H100s the lecture's fix, FSDP over the 8 data-parallel ranks, 33.6%, before a 4-stage pipeline
that also cuts dp to 2, 34.6%).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gridtrain.plan.app import render
from gridtrain.plan.app.inputs import LAYOUT_LABELS, constraints_label
from gridtrain.plan.app.refusals import no_layout_reason
from gridtrain.plan.app.report import candidate_dict, layout_dict
from gridtrain.plan.memory import BUCKETS, GiB
from gridtrain.plan.runnable import refusal
from gridtrain.plan.search import Candidate, Constraints, Problem, SearchResult, search
from gridtrain.plan.shape import param_counts

PLANNER_ERROR = 0.05
"""Relative MFU difference below which two fixes tie: the planner's throughput is within 4.6% of
the published runs it is checked against (`gridtrain plan --reference`: Megatron-LM's SC21 Table 1
and torchtitan's H100 benchmark), so a smaller difference is not a ranking it can stand behind."""
CHOICES = ("tp", "pp", "cp", "dp", "zero_stage", "micro_batch", "recompute", "pp_schedule", "pp_virtual_stages")
"""The layout's choices a fix may change (dp_shard follows the ZeRO stage; counted with it)."""
NAMES = {"tp": "tensor parallelism", "pp": "a pipeline", "cp": "context parallelism", "zero_stage": "ZeRO",
         "micro_batch": "micro-batch", "recompute": "recomputation", "pp_schedule": "schedule",
         "pp_virtual_stages": "virtual stages", "dp": "data parallelism", "dp_shard": "FSDP shards"}


@dataclass(frozen=True)
class Fix:
    """A change that makes the problem fit: the layout it leads to, and what it changes."""

    change: str
    """In words: 'zero 0 -> 3 (FSDP: state sharded over 8 ranks)'."""
    candidate: Candidate
    problem_change: tuple[tuple[str, int], ...] = ()
    """Inputs besides the layout the fix changes (('num_gpus', 16),)."""
    changed: int = 1
    """How many of the layout's CHOICES differ from the leanest layout that did not fit."""


def _zero_words(layout: dict) -> str:
    if layout["zero_stage"] in (2, 3) and layout["dp_shard"] * layout["cp"] > 1:
        replicas = f", {layout['dp_replicate']} replicas" if layout["dp_replicate"] > 1 else ""
        return (f"FSDP: ZeRO-{layout['zero_stage']} shards the model state over "
                f"{layout['dp_shard'] * layout['cp']} ranks{replicas}")
    return "ZeRO-1: optimizer state sharded" if layout["zero_stage"] == 1 else "replicated model state"


def describe(key: str, before: dict, after: dict) -> str:
    """'zero 0 -> 3 (FSDP: ...)', 'pp 1 -> 4 (dp 8 -> 2, interleaved-1f1b v2)'."""
    label = LAYOUT_LABELS.get(key, key)
    words = f"{label} {before[key]} -> {after[key]}"
    extra = [f"{LAYOUT_LABELS.get(k, k)} {before[k]} -> {after[k]}" for k in ("tp", "pp", "cp", "dp")
             if k != key and before[k] != after[k]]
    if key == "zero_stage" or after["zero_stage"] != before["zero_stage"]:
        extra.append(_zero_words(after))
    if after["pp"] > 1 and (key in ("pp", "pp_schedule", "pp_virtual_stages") or before["pp"] != after["pp"]):
        extra.append(f"{after['pp_schedule']}" + (f" v{after['pp_virtual_stages']}" if after["pp_virtual_stages"] > 1
                                                  else ""))
    return words + (f" ({'; '.join(extra)})" if extra else "")


def _changed(before: dict, after: dict) -> int:
    return sum(before[k] != after[k] for k in CHOICES)


def layout_fixes(problem: Problem, c: Constraints, leanest: Candidate) -> list[Fix]:
    """Each fixed choice freed in turn (the others kept): the best layout that then fits."""
    before = layout_dict(leanest.layout)
    out, seen = [], set()
    for key in c.given():
        found = search(problem, replace(c, **{key: None}), top=1)
        if not found.ranked or found.ranked[0].layout in seen:
            continue
        best = found.ranked[0]
        seen.add(best.layout)
        after = layout_dict(best.layout)
        out.append(Fix(describe(key, {**before, key: getattr(c, key)}, after), best,
                       changed=_changed(before, after)))
    return rank(out)


def more_gpus_fix(problem: Problem) -> Fix | None:
    """The smallest multiple (x2 ... x64) of the GPU count at which some layout fits."""
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = replace(problem, num_gpus=problem.num_gpus * factor)
        found = search(bigger, top=1)
        if found.ranked:
            return Fix(f"plan for {bigger.num_gpus:,} GPUs (num_gpus {problem.num_gpus:,} -> {bigger.num_gpus:,}: "
                       f"--num-gpus {bigger.num_gpus})",
                       found.ranked[0], (("num_gpus", bigger.num_gpus),))
    return None


def rank(fixes: list[Fix]) -> list[Fix]:
    """Best MFU first; fixes within PLANNER_ERROR of the best remaining one tie, and among them the
    one that changes fewer choices leads."""
    rest = sorted(fixes, key=lambda f: -f.candidate.time.mfu)
    out: list[Fix] = []
    while rest:
        top = rest[0].candidate.time.mfu
        tied = [f for f in rest if f.candidate.time.mfu >= top * (1 - PLANNER_ERROR)]
        out += sorted(tied, key=lambda f: (f.changed, -f.candidate.time.mfu))
        rest = rest[len(tied):]
    return out


def fix_dict(fix: Fix, best_mfu: float) -> dict[str, object]:
    """A fix for `plan --json`: the change, the inputs it sets, its layout with its step time,
    MFU and peak memory, and its MFU against the best fix's."""
    return candidate_dict(fix.candidate) | {"change": fix.change, "set": dict(fix.problem_change),
                                            "changed": fix.changed, "mfu_behind_best": best_mfu - fix.candidate.time.mfu}


def _leanest_text(problem: Problem, cand: Candidate) -> str:
    m = cand.memory
    buckets = ", ".join(f"{b} {getattr(m, b) / GiB:.1f}" for b in BUCKETS)
    return (f"the leanest, {render.layout_label(layout_dict(cand.layout))}, needs {m.total / GiB:.1f} GiB on "
            f"pipeline rank {m.rank} ({buckets} GiB) against {problem.memory_limit / GiB:.1f} GiB usable "
            f"({problem.hbm_usable:.0%} of {problem.cluster.accelerator.hbm_gb:g} GB)")


def no_fit(problem: Problem, c: Constraints, result: SearchResult) -> tuple[str, list[Fix]]:
    """Why nothing fits, and the fixes that would, best first (the message lists them as 'try:')."""
    what = f"with {constraints_label(c)} " if c.given() else ""
    head = f"no layout {what}of this model fits on {problem.num_gpus:,} x {problem.cluster.accelerator.name}"
    if result.leanest is None:
        return no_layout_reason(problem, c, head)[1], []
    if result.refused:
        lean = result.leanest
        why = refusal(problem.model_keys, problem.global_batch_seqs, problem.precision, lean.layout)
        example = f" (the leanest, {render.layout_label(layout_dict(lean.layout))}: {why})" if why else ""
        return (f"{head}: every layout that fits in memory is one gridtrain train refuses, {result.refused:,} of "
                f"them{example}; --any-layout ranks them, labelled"), []
    more = None if c.given() else more_gpus_fix(problem)
    fixes = layout_fixes(problem, c, result.leanest) if c.given() else [more] if more else []
    lines = [f"{f.change}: {render.layout_label(layout_dict(f.candidate.layout))} fits "
             f"({f.candidate.memory.total / GiB:.1f} GiB, MFU {f.candidate.time.mfu:.1%})" for f in fixes]
    if not lines and not c.given():
        state = param_counts(problem.shape).total * problem.state.total
        lines = [f"the model state alone is {state / 1e12:.1f} TB: use GPUs with more memory"]
    return f"{head}: {_leanest_text(problem, result.leanest)}.\n  try: " + "\n  try: ".join(
        lines or ["more GPUs, or --hbm-usable closer to 1"]), fixes
