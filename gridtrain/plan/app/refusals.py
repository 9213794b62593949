"""Why `gridtrain plan` cannot plan a `--layout`: the relations between the layout's choices and the
problem, checked in the order in which one rests on another, so that a refusal names its root
relation (the schedule's v, the batch against dp, the replicas against dp) with its numbers and a
fix, and not a consequence of it (a dp_shard that "divides none" of the degrees the search was left).

`layout_refusal` checks what needs no search; `no_layout_reason` explains a search that found no
layout at all (before memory is asked). RELATIONS lists every relation a refusal can name: each
message starts from one of them, and tests/test_plan_refusals.py triggers each.
"""

from __future__ import annotations

import math

from gridtrain.layout.schedules import SCHEDULES
from gridtrain.plan.search import (Constraints, Problem, cp_options, degree_options, families, pp_options,
                                   schedule_options, tp_options, zero_options)

RELATIONS: dict[str, str] = {
    "tp": "tp divides the node, the query heads and the MLP width, and divides or is divided by the KV heads",
    "cp": "2 x cp divides the sequence",
    "pp": "pp is at most the number of layers",
    "gpus": "tp x cp x pp x dp is the number of GPUs",
    "dp_batch": "dp divides the global batch (each replica takes whole sequences)",
    "dp_shard": "dp_shard divides dp",
    "shard_stage": "only ZeRO 2 and 3 shard over dp_shard ranks",
    "replicas": "under ZeRO 2 or 3, replicas x shards = dp with at least 2 shards (or cp > 1)",
    "shard_sizes": "the search shards over a power of two or all of dp",
    "zero1_runtime": "gridtrain train runs ZeRO-1 without tp and pp",
    "zero1_moe": "gridtrain train runs a mixture of experts under ZeRO 0, 2 or 3, not ZeRO-1",
    "cp_zero": "gridtrain train sums context parallelism's gradients with FSDP (ZeRO 2 or 3)",
    "v_pipeline": "virtual stages need a pipeline (pp > 1)",
    "v_schedule": "the schedule's stages per rank: 1 (GPipe, 1F1B), 2 or more (interleaved), exactly 2 (V)",
    "v_layers": "pp x v stages, at most one per layer",
    "mb_batch": "the micro-batch divides each replica's sequences",
    "m_schedule": "micro-batches per replica against pp (1F1B m >= pp, V schedules m >= 2 pp)",
    "gpus_batch": "GPUs at most batch x tp x cp x layers (one stage per layer)",
    "degrees_batch": "some tp x cp x pp leaves a dp dividing the global batch",
    "schedule_batch": "some micro-batch and schedule runs each replica's sequences through the pipeline",
    "zero_variants": "some ZeRO variant the search tries matches zero and dp_shard for the dp left",
    "runtime": "gridtrain train accepts the layout (validate.py)",
    "memory": "the leanest layout fits in the usable HBM",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _known_dp(problem: Problem, c: Constraints) -> int | None:
    """dp, given or left by tp, cp and pp once all three are given (None otherwise)."""
    if c.dp is not None:
        return c.dp
    if None in (c.tp, c.pp, c.cp):
        return None
    rest = c.tp * c.pp * c.cp  # type: ignore[operator]
    return problem.num_gpus // rest if problem.num_gpus % rest == 0 else None


def layout_refusal(problem: Problem, c: Constraints) -> tuple[str, str] | None:
    """(relation, message) for the first relation of RELATIONS the constraints break, or None."""
    for check in (_degrees, _data_parallel, _zero, _schedule, _micro_batches):
        found = check(problem, c)
        if found:
            return found
    return None


def _degrees(problem: Problem, c: Constraints) -> tuple[str, str] | None:
    s, free = problem.shape, Constraints()
    if c.tp is not None and c.tp not in tp_options(problem, free):
        g = problem.cluster.gpus_per_node
        return "tp", (f"tp={c.tp} cannot split this model on {g}-GPU nodes: tp must divide the node ({g}), the "
                      f"{s.num_heads} query heads and the MLP width {s.ffn}, and divide or be divided by the "
                      f"{s.num_kv_heads} KV heads; choose tp among {tp_options(problem, free)}")
    if c.cp is not None and not cp_options(problem, c):
        return "cp", (f"cp={c.cp} must cut the {problem.seq_len:,}-token sequence into 2 x cp equal chunks: choose "
                      f"cp dividing {problem.seq_len // 2:,} (the search tries {cp_options(problem, free)})")
    if c.pp is not None and c.pp > s.num_layers:
        return "pp", f"pp={c.pp} exceeds the model's {s.num_layers} layers: choose pp <= {s.num_layers}"
    n = problem.num_gpus
    given = {k: getattr(c, k) for k in ("tp", "cp", "pp", "dp") if getattr(c, k) is not None}
    product = math.prod(given.values())
    relation = " x ".join(f"{k}({v})" for k, v in given.items()) + f" = {product:,}"
    if len(given) == 4 and product != n:
        fix = f"set dp to {n // (product // c.dp)}, or " if n % (product // c.dp) == 0 else ""  # type: ignore[operator]
        return "gpus", f"{relation} != {n:,} GPUs: {fix}plan for {product:,} GPUs (--num-gpus {product})"
    if given and n % product:
        return "gpus", f"{relation} does not divide {n:,} GPUs: choose degrees whose product divides {n:,}"
    return None


def _data_parallel(problem: Problem, c: Constraints) -> tuple[str, str] | None:
    dp, batch = _known_dp(problem, c), problem.global_batch_seqs
    if dp is None or batch % dp == 0:
        return None
    below, above = batch // dp * dp, -(-batch // dp) * dp
    multiples = " or ".join(f"{b:,}" for b in (above, below) if b > 0)
    how = f"dp={dp}" if c.dp is not None else (f"dp = {problem.num_gpus:,} GPUs / (tp {c.tp} x pp {c.pp} x cp "
                                              f"{c.cp}) = {dp:,}")
    other = ""
    if c.dp is None:
        pps = [pp for pp in pp_options(problem, Constraints(), c.tp or 1, c.cp or 1)  # type: ignore[arg-type]
               if batch % (problem.num_gpus // (c.tp * c.cp * pp)) == 0]  # type: ignore[operator]
        if pps:
            pick = min(pps, key=lambda pp: abs(pp - (c.pp or 1)))
            other = f", or pp={pick} (dp {problem.num_gpus // (c.tp * c.cp * pick):,})"  # type: ignore[operator]
    return "dp_batch", (f"{how} does not divide the global batch of {batch:,} sequences (each replica takes whole "
                        f"sequences): make the batch a multiple of {dp:,} ({multiples}){other}")


def _zero(problem: Problem, c: Constraints) -> tuple[str, str] | None:
    dp, shard, stage = _known_dp(problem, c), c.dp_shard, c.zero_stage
    if dp is not None and shard is not None and dp % shard:
        return "dp_shard", f"dp_shard={shard} must divide dp={dp}: choose dp_shard among {_divisors(dp)}"
    if shard is not None and shard > 1 and stage in (0, 1):
        return "shard_stage", (f"dp_shard={shard} shards ZeRO-2/3 (FSDP) state over that many ranks; zero={stage} "
                               "replicates the model over all of dp: drop dp_shard, or choose zero=2 or 3")
    cps = [c.cp] if c.cp is not None else cp_options(problem, c)
    if shard == 1 and stage in (2, 3) and cps == [1] and (dp is None or dp > 1):
        replicas = f"{dp:,} replicas" if dp else "dp replicas"
        lean = f", e.g. {dp // 8 or 1} replica(s) x {min(dp, 8)} shards" if dp and dp > 1 else ""
        return "replicas", (f"{replicas} of 1 shard each (dp_shard=1) leave ZeRO-{stage} nothing to shard: every "
                            f"replica holds the whole model state, as DDP does; choose fewer replicas{lean}, or "
                            "zero=0 for plain data parallelism")
    if dp is not None and shard is not None and shard not in (1, dp) and shard & (shard - 1):
        shards = [s for s in _divisors(dp) if s > 1 and (s & (s - 1) == 0 or s == dp)]
        return "shard_sizes", (f"dp_shard={shard}: the search shards over a power of two or all of dp={dp}; choose "
                               f"dp_shard among {shards}")
    if problem.filters_runnable and stage == 1 and problem.shape.num_experts and (dp is None or dp > 1):
        return "zero1_moe", (f"zero=1 with a mixture of experts ({problem.shape.num_experts} experts): gridtrain train "
                             "has not compared ZeRO-1 with one process for one (validate._check_moe); choose zero=2 "
                             "(the same sharded optimizer state, gradients sharded too), 0 or 3, or --any-layout to "
                             "plan it anyway")
    if problem.filters_runnable and stage == 1 and ((c.tp or 1) > 1 or (c.pp or 1) > 1):
        return "zero1_runtime", (f"zero=1 with tp={c.tp or 1}, pp={c.pp or 1}: gridtrain train runs ZeRO-1 "
                                 "(a sharded optimizer over DDP) without tp and pp only; choose zero=2 (the same "
                                 "sharded optimizer state, gradients sharded too), or --any-layout to plan it anyway")
    if problem.filters_runnable and (c.cp or 1) > 1 and stage in (0, 1):
        return "cp_zero", (f"cp={c.cp} with zero={stage}: gridtrain train sums context parallelism's gradients with "
                           "FSDP; choose zero=2 or 3, or --any-layout to plan it anyway")
    return None


def _schedule(problem: Problem, c: Constraints) -> tuple[str, str] | None:
    v, name, layers = c.pp_virtual_stages, c.pp_schedule, problem.shape.num_layers
    if c.pp == 1 and v is not None and v > 1:
        return "v_pipeline", f"v={v} virtual stages need a pipeline, and pp=1: set v=1, or pp >= 2"
    row = SCHEDULES[name] if name else None
    if row is not None and v is not None:
        if row.stages_per_rank == 1 and v != 1:
            return "v_schedule", (f"schedule={name} runs one stage per rank and v={v}: set v=1, or choose an "
                                  "interleaved schedule (interleaved-1f1b, interleaved-zb) for v >= 2")
        if row.stages_per_rank is None and v < 2:
            most = max(2, min(8, layers // (c.pp or 1)))
            return "v_schedule", (f"schedule={name} interleaves v >= 2 model chunks per rank and v={v} (one chunk "
                                  f"is 1F1B): choose v among {list(range(2, most + 1))}, or schedule=1f1b")
        if row.stages_per_rank == 2 and v != 2:
            return "v_schedule", (f"schedule={name} holds exactly 2 model chunks per rank, in a V, and v={v}: "
                                  "set v=2")
    if v is not None and v > 1 and c.pp is not None and c.pp * v > layers:
        return "v_layers", (f"pp={c.pp} x v={v} = {c.pp * v} stages exceeds the model's {layers} layers (at most one "
                            f"stage per layer): choose v <= {max(1, layers // c.pp)} or a smaller pp")
    return None


def _micro_batches(problem: Problem, c: Constraints) -> tuple[str, str] | None:
    dp = _known_dp(problem, c)
    if dp is None or problem.global_batch_seqs % dp:
        return None
    per_replica = problem.global_batch_seqs // dp
    if c.micro_batch is not None and per_replica % c.micro_batch:
        return "mb_batch", (f"mb={c.micro_batch} does not divide the {per_replica:,} sequences each replica takes "
                            f"(batch {problem.global_batch_seqs:,} / dp {dp:,}): choose mb among "
                            f"{_divisors(per_replica)}")
    if c.pp is None or c.pp == 1:
        return None
    mbs = [c.micro_batch] if c.micro_batch else _divisors(per_replica)
    if any(schedule_options(c.pp, problem.shape.num_layers, per_replica // b, c) for b in mbs):
        return None
    m = per_replica // min(mbs)
    named = f"schedule={c.pp_schedule}" if c.pp_schedule else "the schedules searched"
    need = 2 * c.pp if c.pp_schedule in ("zbv", "dualpipev") else c.pp
    return "m_schedule", (f"pp={c.pp} with at most {m:,} micro-batch(es) per replica (batch "
                          f"{problem.global_batch_seqs:,} / dp {dp:,} / mb {min(mbs)}): {named} need(s) m >= "
                          f"{need:,} (1F1B m >= pp, ZB-V and DualPipeV m >= 2 pp, interleaved schedules micro-batches "
                          f"in rounds of pp): make the global batch at least {need * dp * min(mbs):,}, or lower pp")


def no_layout_reason(problem: Problem, c: Constraints, head: str) -> tuple[str, str]:
    """(relation, message): why a search found no layout at all (after layout_refusal passed), the
    root relation of those the search needs, with its numbers and a fix. `head` starts the message."""
    batch, n = problem.global_batch_seqs, problem.num_gpus
    most = batch * max(tp_options(problem, c) or [1]) * max(cp_options(problem, c) or [1]) * problem.shape.num_layers
    if n > most:
        return "gpus_batch", (f"{head}: that is more GPUs than this model and batch can keep busy, at most {most:,} = "
                              f"{batch:,} sequences (dp) x the largest tp x cp x one pipeline stage per layer "
                              f"({problem.shape.num_layers}): use fewer GPUs or a larger --global-batch")
    if not degree_options(problem, c):
        dps = sorted({n // (tp * cp * pp) for tp in tp_options(problem, c) for cp in cp_options(problem, c)
                      for pp in pp_options(problem, c, tp, cp) if c.dp in (None, n // (tp * cp * pp))})
        shown = ", ".join(f"{d:,}" for d in dps[:12]) + (", ..." if len(dps) > 12 else "")
        fix = (f"make the batch a multiple of one of them (e.g. {_nearest_multiple(batch, dps):,})" if dps
               else "use a GPU count that tp x cp x pp divide")
        return "degrees_batch", (f"{head}: no tp x cp x pp leaves a dp that divides the global batch of {batch:,} "
                                 f"sequences: the dp degrees {n:,} GPUs leave are {shown or 'none'}; {fix}"
                                 + (", or loosen --layout" if c.given() else ""))
    fams = families(problem, c)
    if not fams:
        return "schedule_batch", (
            f"{head}: no tp x cp x pp x dp = {n:,} leaves a valid micro-batch and schedule for {batch:,} sequences "
            "per step (1F1B needs m >= pp micro-batches per data-parallel rank, ZB-V m >= 2 pp, interleaved "
            "schedules v >= 2 and micro-batches in rounds of pp): "
            + ("loosen --layout" if c.given() else "use fewer GPUs or a larger --global-batch"))
    dps = sorted({fam.dp for fam in fams})
    offered = sorted({s for dp in dps for z, _, s in zero_options(dp, Constraints(), 1) if z >= 2})
    return "zero_variants", (f"{head}: dp_shard={c.dp_shard} with zero={c.zero_stage} matches no ZeRO variant of the "
                             f"dp degrees the other choices leave ({', '.join(map(str, dps[:12]))}); the search "
                             f"shards over {offered[:12]}: choose one of those, or fix tp, cp and pp too")


def _nearest_multiple(batch: int, dps: list[int]) -> int:
    """The multiple of one of `dps` nearest the batch (and at least one of it)."""
    return min((max(d, round(batch / d) * d) for d in dps), key=lambda b: (abs(b - batch), b))
