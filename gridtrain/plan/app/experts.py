"""Why a plan for a mixture of experts did or did not choose expert parallelism: the best layout of
the other kind, and the parts of the step (moe_cost.py, steptime.py) that set them apart."""

from __future__ import annotations

from dataclasses import replace

from gridtrain.plan.moe_cost import imbalance_tables, routing_imbalance
from gridtrain.plan.search import Candidate, Constraints, PlanError, Problem, _divisors, search
from gridtrain.plan.stop import SearchTimeout

PARTS = {"compute": "compute", "ep": "expert all-to-alls (in line)", "dp": "exposed DP/FSDP", "tp": "TP",
         "cp": "CP ring", "pp": "pipeline sends", "bubble": "bubble", "optimizer": "optimizer"}


def _label(cand: Candidate) -> str:
    lay = cand.layout
    return (f"ep {lay.ep}, tp {lay.tp}, cp {lay.cp}, pp {lay.pp}, dp {lay.dp}, ZeRO-{lay.zero_stage}, "
            f"micro-batch {lay.micro_batch}, recompute {lay.recompute}")


def _best(problem: Problem, constraints: Constraints, eps: list[int]) -> Candidate | None:
    found = []
    for ep in eps:
        try:
            result = search(problem, replace(constraints, ep=ep), top=1)
        except PlanError:
            continue
        found += result.ranked
    return min(found, key=lambda c: c.time.total_s, default=None)


def _differences(chosen: Candidate, other: Candidate) -> str:
    """The parts of the step where `other` spends more (+) or less (-) than `chosen`, largest first."""
    a, b = chosen.time.parts(), other.time.parts()
    diffs = sorted(((PARTS[k], b[k] - a[k]) for k in a), key=lambda p: -abs(p[1]))
    shown = [f"{name} {'+' if d > 0 else '-'}{abs(d):.3f} s" for name, d in diffs if abs(d) >= 1e-3 * a["compute"]]
    return ", ".join(shown[:4])


def ep_note(problem: Problem, constraints: Constraints, chosen: Candidate) -> str | None:
    """One note on the expert-parallel degree of a mixture-of-experts plan; None for a dense model.
    Its comparison searches share the request's time budget (the explorer's): past it, the note
    says so instead of turning a finished plan into a timeout."""
    if not problem.shape.num_experts:
        return None
    if constraints.ep is not None:
        return f"expert parallelism: ep {constraints.ep}, as --layout fixes it"
    try:
        return _compared(problem, constraints, chosen)
    except SearchTimeout:
        return (f"expert parallelism: ep {chosen.layout.ep}; the comparison with the best layout of the other kind "
                "ran out of this request's time (`gridtrain plan` has no limit)")


def _compared(problem: Problem, constraints: Constraints, chosen: Candidate) -> str:
    experts = problem.shape.num_experts
    ep = chosen.layout.ep

    def allowance(spread: int) -> str:
        measured = " or ".join(f"{e} experts at top-{k}" for e, k in imbalance_tables(experts))
        slow, cap = routing_imbalance(spread, experts), problem.shape.capacity_factor
        capped = f", capped at {cap:g} by the capacity factor" if cap is not None and cap < slow else ""
        return (f"the busiest of the {spread} expert-parallel ranks is costed at "
                f"{slow:.2f}x the mean rows (moe_cost.ROUTING_IMBALANCE, measured on "
                f"gridtrain's own runs routing to {measured}){capped}")

    if ep > 1:
        other = _best(problem, constraints, [1])
        if other is None:
            return (f"expert parallelism: ep {ep}, because no layout without it fits: FSDP's unit is a block, "
                    f"so every rank would gather all {experts} experts of a layer at once")
        return (f"expert parallelism: ep {ep} ({chosen.time.total_s:.3f} s a step) beats the best layout without it "
                f"({_label(other)}: {other.time.total_s:.3f} s), which spends {_differences(chosen, other)}; "
                f"{allowance(ep)}")
    candidates = [g for g in _divisors(experts) if 1 < g <= problem.num_gpus]
    other = _best(problem, constraints, candidates)
    if other is None:
        return (f"expert parallelism: none fits or divides: gridtrain borrows the expert-parallel ranks from "
                f"the data- and context-parallel ones (ep divides dp x cp), and ep must divide the {experts} experts")
    return (f"expert parallelism: ep 1, because the best layout with it ({_label(other)}: "
            f"{other.time.total_s:.3f} s a step against {chosen.time.total_s:.3f} s) spends "
            f"{_differences(chosen, other)}: gridtrain's all-to-alls run in line with compute, and {allowance(other.layout.ep)}; "
            f"{_without_ep(chosen)}")


def _without_ep(chosen: Candidate) -> str:
    """What becomes of the experts in the chosen layout without expert parallelism."""
    lay = chosen.layout
    if lay.dp * lay.cp == 1:
        return "without data- or context-parallel ranks to borrow, each rank runs all the experts of its layers"
    if lay.zero_stage >= 2 and lay.zero_shard_degree > 1:
        return (f"without expert parallelism FSDP (ZeRO-{lay.zero_stage}) gathers the experts with their blocks, "
                "its time counted in exposed DP/FSDP above")
    return ("without expert parallelism every data-parallel rank holds all the experts and their gradients are "
            f"{'all-reduced' if lay.zero_stage == 0 else 'reduced'} with the other weights (ZeRO-{lay.zero_stage}), "
            "counted in exposed DP/FSDP above")


def ep_refusal(problem: Problem, c: Constraints) -> str | None:
    """The relation a `--layout ep=N` breaks before any search, with its numbers and a fix (the
    runtime's own, validate._check_moe)."""
    if c.ep is None or c.ep < 1:
        return None if c.ep is None else f"ep ({c.ep}) must be 1 or more"
    experts = problem.shape.num_experts
    if not experts:
        return None if c.ep == 1 else (f"ep ({c.ep}) shards the routed experts of a mixture of experts, and this "
                                       "model is dense: drop ep from --layout, or plan a mixture-of-experts preset")
    if experts % c.ep:
        fits = ", ".join(str(g) for g in _divisors(experts) if g > 1)
        return f"ep ({c.ep}) must divide the {experts} experts of each MoE layer: choose ep among {fits}"
    if c.ep > 1 and c.dp is not None and c.cp is not None and (c.dp * c.cp) % c.ep:
        return (f"ep ({c.ep}) must divide dp x cp ({c.dp} x {c.cp} = {c.dp * c.cp}): gridtrain borrows the "
                "expert-parallel ranks from the data- and context-parallel ones; give dp and cp whose product "
                "ep divides")
    return None
