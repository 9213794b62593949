"""Layout search: enumerate every valid layout of a model on a cluster, drop those that do not fit
in HBM, rank the rest by predicted step time (steptime.step_time).

A layout is a `core` (tp, cp, pp, dp, micro-batch, schedule and virtual stages, recomputation:
everything that sets the pipeline's time) times a ZeRO variant (stage 0-3; for stages 2 and 3
every HSDP split dp_shard x dp_replicate). Structure keeps it cheap:
- choices that another choice dominates are not enumerated (schedule_options names them):
  sequence parallelism is on whenever tp > 1 (TP's bytes, less memory); GPipe, looped-BFS,
  interleaved 1F1B and DualPipeV are tried only when --layout names them;
- the micro-batch grows until the leanest ZeRO variant no longer fits (activations only grow);
- cores are bounded below before their ZeRO variants are tried: memory by the leanest variant
  on the first and last pipeline rank; time by the pipeline alone (no DP, no optimizer);
- cores are visited in order of that time bound and the walk stops once the bound passes the
  k-th best full step time found (branch and bound); the exact memory (memory.rank_memory over
  every rank, memory.peak_rank) is computed only for layouts that would enter the top k.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass, field, replace

from gridtrain.layout.schedules import DEFAULT_SCHEDULE, SCHEDULES
from gridtrain.names import RECOMPUTE
from gridtrain.plan.layout import Layout
from gridtrain.plan.memory import (RankMemory, buffer_bytes, gathered_bytes_per_param, peak_rank, probe_activations,
                                   rank_memory, rank_params)
from gridtrain.plan.runnable import refusal
from gridtrain.plan.state import StateBytes, state_bytes_per_param
from gridtrain.plan.shape import ModelShape, tp_heads
from gridtrain.plan.specs import ClusterSpec
from gridtrain.plan.stop import check_stop, out_of_time
from gridtrain.plan.steptime import CALIBRATED, Efficiency, PipelineTime, StepTime, pipeline_time, step_time


class PlanError(ValueError):
    """An input the planner cannot use, with what is wrong and what to do instead."""


@dataclass(frozen=True)
class Problem:
    """What is to be trained, on what."""

    shape: ModelShape
    cluster: ClusterSpec
    num_gpus: int
    seq_len: int
    global_batch_seqs: int
    """Sequences per optimizer step."""
    flash_attention: bool = True
    sequence_parallel: bool = True
    """Megatron sequence parallelism whenever tp > 1 (it dominates: TP's bytes, less memory)."""
    state: StateBytes = StateBytes.gridtrain()
    """Bytes per parameter: gridtrain's runtime in bf16 unless another convention is asked for."""
    hbm_usable: float = 0.9
    """Share of HBM a layout may plan for; the CUDA context, NCCL and the caching allocator's
    fragmentation take the rest."""
    act_bytes: int = 2
    eff: Efficiency = CALIBRATED
    model_keys: tuple[tuple[str, object], ...] | None = None
    """The model as `gridtrain train` keys (model.preset and overrides): layouts are then checked
    against the runtime (runnable.refusal); None for shapes gridtrain does not train (GPT blocks)."""
    precision: str = "bf16"
    runnable_only: bool = True
    """With model_keys: rank only layouts `gridtrain train` accepts (else rank all, labelled)."""
    float8: str = "none"
    """FP8 training of the block linears (train.float8): every layout ranked runs it."""
    attention_span: float | None = None
    """Keys per query under document masking (plan/documents.py); None: the whole sequence."""

    @property
    def filters_runnable(self) -> bool:
        return self.model_keys is not None and self.runnable_only

    @property
    def memory_limit(self) -> float:
        return self.cluster.accelerator.hbm_bytes * self.hbm_usable


@dataclass(frozen=True)
class Constraints:
    """Choices the user fixes (`--layout tp=8,pp=16,...`); None leaves a choice to the search."""

    tp: int | None = None
    cp: int | None = None
    pp: int | None = None
    dp: int | None = None
    dp_shard: int | None = None
    zero_stage: int | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    pp_schedule: str | None = None
    pp_virtual_stages: int | None = None
    ep: int | None = None

    def given(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    time: StepTime
    memory: RankMemory
    """The pipeline rank that peaks."""


@dataclass
class SearchResult:
    ranked: list[Candidate]
    """Layouts that fit, fastest first."""
    enumerated: int
    """Layouts in the search space (cores x ZeRO variants)."""
    evaluated: int
    """Layouts whose step time was computed."""
    leanest: Candidate | None = None
    """When nothing fits: the layout needing the least memory, for the explanation."""
    refused: int = 0
    """Layouts that fit and would have ranked but `gridtrain train` refuses (runnable.refusal)."""


@functools.lru_cache(maxsize=1024)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of n in increasing order, in sqrt(n) steps (a billion GPUs stays instant)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def tp_options(problem: Problem, c: Constraints) -> list[int]:
    """Divisors of the node size that split the query heads, the KV heads (or are split by them)
    and the MLP width evenly."""
    s = problem.shape
    out = []
    for tp in _divisors(problem.cluster.gpus_per_node):
        try:
            tp_heads(s.num_heads, s.num_kv_heads, tp)
        except ValueError:
            continue
        if s.ffn % tp == 0 and (c.tp is None or c.tp == tp):
            out.append(tp)
    return out


def cp_options(problem: Problem, c: Constraints) -> list[int]:
    """CP degrees: a fixed one (`--layout cp=N`) when 2 x N divides the sequence (the runtime's
    zig-zag split), else the powers of two that leave 1,024 tokens or more per rank (below that
    ring attention's blocks are too small to hide their sends)."""
    if c.cp is not None:
        return [c.cp] if c.cp == 1 or (c.cp > 1 and problem.seq_len % (2 * c.cp) == 0) else []
    return [cp for cp in (1, 2, 4, 8, 16, 32, 64)
            if cp == 1 or (problem.seq_len % (2 * cp) == 0 and problem.seq_len // cp >= 1024)]


def pp_options(problem: Problem, c: Constraints, tp: int, cp: int) -> list[int]:
    """Pipeline degrees that divide the GPUs left by tp x cp, at most one rank per layer."""
    rest = problem.num_gpus // (tp * cp) if problem.num_gpus % (tp * cp) == 0 else 0
    return [pp for pp in _divisors(rest) if pp <= problem.shape.num_layers and (c.pp is None or c.pp == pp)]


def schedule_options(pp: int, num_layers: int, m: int, c: Constraints) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs gridtrain's runtime accepts for pp ranks and m micro-batches
    (validate._check_pp): 1F1B needs m >= pp; interleaved schedules run micro-batches in rounds of
    pp; V schedules hold exactly 2 stages per rank. Interleaving factors from 2 to 8. The
    zero-bubble schedules are tried with m >= pp (interleaved-zb) and m >= 2 pp (V schedules: their
    warm-up fills 2p chunks); each is costed by replaying its order (pipeline.schedule_bubble, split_cost).

    Unless the constraints name a schedule, those another dominates are left out: GPipe (1F1B's
    bubble with every micro-batch in flight) and looped-BFS (a larger bubble than interleaved
    1F1B, measured, with every micro-batch in flight). Interleaved 1F1B and interleaved
    zero-bubble are both tried (a smaller bubble against the split backward's cost), and so are
    ZB-V and DualPipeV (a smaller bubble against more micro-batches in flight)."""
    if pp == 1:  # no pipeline: a named schedule is moot
        return [(DEFAULT_SCHEDULE, 1)] if c.pp_virtual_stages in (None, 1) else []
    vs = [v for v in range(2, 9) if pp * v <= num_layers]
    pairs = []
    for row in SCHEDULES.values():
        if not row.runnable or (row.name != c.pp_schedule if c.pp_schedule else not row.searched):
            continue
        if row.stages_per_rank == 1 and m >= pp:
            pairs.append((row.name, 1))
        elif row.stages_per_rank is None and m % max(1, m // pp) == 0 and (m >= pp or not row.split_backward):
            pairs += [(row.name, v) for v in vs]
        elif row.stages_per_rank == 2 and 2 * pp <= num_layers and m >= 2 * pp:
            pairs.append((row.name, 2))
    return [(s, v) for s, v in pairs if c.pp_virtual_stages is None or c.pp_virtual_stages == v]


@functools.lru_cache(maxsize=1024)
def zero_options(dp: int, c: Constraints, cp: int = 1) -> tuple[tuple[int, int, int], ...]:
    """(stage, dp_replicate, dp_shard): stages 0 and 1 over all of DP, stages 2 and 3 sharded over
    dp_shard ranks (every power-of-two split, and all of dp) and replicated over the rest (HSDP).
    Under context parallelism FSDP shards over dp_shard x cp, so stages 2 and 3 also come with
    dp_shard 1 (sharded over the CP ranks alone)."""
    if dp == 1:
        out = [(0, 1, 1)]
    else:
        shards = sorted({s for s in _divisors(dp) if s > 1 and (s & (s - 1) == 0 or s == dp)})
        out = [(0, dp, 1), (1, dp, 1)] + [(z, dp // s, s) for z in (2, 3) for s in shards]
    if cp > 1:
        out += [(z, dp, 1) for z in (2, 3)]
    return tuple((z, r, s) for z, r, s in out if (c.zero_stage is None or c.zero_stage == z)
                 and (c.dp_shard is None or c.dp_shard == s))


@dataclass(frozen=True)
class Family:
    """Cores that differ only in the micro-batch, smallest first: activation memory grows with
    it (b x min(p, m) micro-batch-sequences in flight, b x m fixed), so the first that cannot fit
    ends the family."""

    tp: int
    cp: int
    pp: int
    dp: int
    recompute: str
    pp_schedule: str
    pp_virtual_stages: int
    micro_batches: tuple[int, ...]
    per_replica: int
    """Sequences per step per data-parallel rank."""
    ep: int = 1

    def layout(self, problem: Problem, micro_batch: int) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, cp=self.cp, dp_replicate=self.dp, zero_stage=0, ep=self.ep,
                      micro_batch=micro_batch, seq_len=problem.seq_len,
                      num_microbatches=self.per_replica // micro_batch, pp_schedule=self.pp_schedule,
                      pp_virtual_stages=self.pp_virtual_stages,
                      sequence_parallel=self.tp > 1 and problem.sequence_parallel,
                      recompute=self.recompute, flash_attention=problem.flash_attention, float8=problem.float8,
                      attention_span=problem.attention_span)


def degree_options(problem: Problem, c: Constraints) -> list[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) with tp x cp x pp x dp = GPUs and dp dividing the global batch."""
    out = []
    for tp in tp_options(problem, c):
        for cp in cp_options(problem, c):
            for pp in pp_options(problem, c, tp, cp):
                dp = problem.num_gpus // (tp * cp * pp)
                if (c.dp is None or c.dp == dp) and problem.global_batch_seqs % dp == 0:
                    out.append((tp, cp, pp, dp))
    return out


def ep_options(problem: Problem, c: Constraints, dp: int, cp: int) -> list[int]:
    """Expert-parallel degrees for a mixture of experts: none, or any degree above 1 that divides
    both the experts and the data- and context-parallel ranks (dp x cp, from which gridtrain's
    runtime borrows them; the ranks left FSDP-shard or replicate the experts,
    gridtrain.layout.experts); 1 for a dense model."""
    experts, group = problem.shape.num_experts, dp * cp
    out = [1] + [g for g in _divisors(math.gcd(experts, group)) if g > 1] if experts else [1]
    return [ep for ep in out if c.ep is None or c.ep == ep]


def families(problem: Problem, c: Constraints) -> list[Family]:
    """Every valid core, grouped by everything but the micro-batch."""
    recomputes = [r for r in RECOMPUTE if c.recompute is None or c.recompute == r] or (
        [c.recompute] if c.recompute else [])
    out = []
    for tp, cp, pp, dp in degree_options(problem, c):
        per_replica = problem.global_batch_seqs // dp
        by_schedule: dict[tuple[str, int], list[int]] = {}
        for b in _divisors(per_replica):
            if c.micro_batch is None or c.micro_batch == b:
                for pair in schedule_options(pp, problem.shape.num_layers, per_replica // b, c):
                    by_schedule.setdefault(pair, []).append(b)
        for (sched, v), bs in by_schedule.items():
            out += [Family(tp, cp, pp, dp, rc, sched, v, tuple(bs), per_replica, ep)
                    for rc in recomputes for ep in ep_options(problem, c, dp, cp)]
    return out


def with_zero(layout: Layout, zero: tuple[int, int, int]) -> Layout:
    stage, rep, shard = zero
    return replace(layout, zero_stage=stage, dp_replicate=rep, dp_shard=shard)


def exact_memory(problem: Problem, layout: Layout) -> RankMemory:
    return peak_rank(rank_memory(problem.shape, layout, problem.state, problem.act_bytes))


def _buffer_class(zero: tuple[int, int, int], cp: int = 1) -> int:
    """ZeRO variants whose communication buffers (memory.buffer_bytes) are alike: 3 and 2 when
    sharded over more than one rank (dp_shard x cp), 0 otherwise."""
    stage, _, shard = zero
    return stage if stage in (2, 3) and shard * cp > 1 else 0


@dataclass(order=True)
class _Core:
    """A core with what its ZeRO variants share: the pipeline's time, and on the first and last
    pipeline rank (a lower bound of the peak) their parameters and activations."""

    bound_s: float
    """Step time without DP communication and the optimizer: a lower bound for every variant."""
    index: int
    layout: Layout = field(compare=False)
    pt: PipelineTime = field(compare=False)
    zeros: tuple[tuple[int, int, int], ...] = field(compare=False)
    probes: list[tuple[float, float]] = field(compare=False)
    """(parameters, activation bytes) on the probed ranks."""
    buffers: dict[int, float] = field(compare=False)

    def memory_floor(self, problem: Problem, zero: tuple[int, int, int]) -> float:
        stage, _, shard = zero
        degree = 1 if stage == 0 else (self.layout.dp if stage == 1 else shard * self.layout.cp)  # Layout.zero_shard_degree
        per_param = state_bytes_per_param(stage, degree, problem.state)
        per_param += gathered_bytes_per_param(stage, degree, problem.state)
        return max(p * per_param + a for p, a in self.probes) + self.buffers[_buffer_class(zero, self.layout.cp)]


def _make_core(problem: Problem, index: int, layout: Layout, zeros: tuple[tuple[int, int, int], ...]) -> _Core:
    # Activations depend on the ZeRO variant only through FSDP (16-bit weights arrive gathered, so
    # autocast saves no casts of them): probe with FSDP when any variant has it, for a lower bound.
    lean = replace(layout, zero_stage=3, dp_replicate=1, dp_shard=layout.dp) if layout.dp * layout.cp > 1 else layout
    pairs = [(rank_params(problem.shape, layout, r, layers), acts) for r, layers, acts in
             probe_activations(problem.shape, lean, problem.act_bytes, (0, layout.pp - 1))]
    buffers = {cls: _buffers(problem, layout.tp, layout.cp, layout.pp, layout.micro_batch, z, layout.ep)
               for cls, z in _class_representatives(zeros, layout.cp).items()}
    return _Core(0.0, index, layout, None, zeros, pairs, buffers)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def _class_representatives(zeros: tuple[tuple[int, int, int], ...], cp: int) -> dict[int, tuple[int, int, int]]:
    out: dict[int, tuple[int, int, int]] = {}
    for z in zeros:
        out.setdefault(_buffer_class(z, cp), z)
    return out


@functools.lru_cache(maxsize=4096)
def _buffers(problem: Problem, tp: int, cp: int, pp: int, micro_batch: int, zero: tuple[int, int, int],
             ep: int = 1) -> float:
    """memory.buffer_bytes, which depends on these alone."""
    stage, rep, shard = zero
    probe = Layout(tp=tp, cp=cp, pp=pp, dp_replicate=rep, dp_shard=shard, zero_stage=stage, ep=ep,
                   micro_batch=micro_batch, seq_len=problem.seq_len,
                   sequence_parallel=tp > 1 and problem.sequence_parallel, float8=problem.float8)
    return buffer_bytes(problem.shape, probe, problem.state, problem.act_bytes)


def _lean_zero(core: _Core, problem: Problem) -> tuple[int, int, int]:
    """The variant needing the least memory: for each stage the widest shard holds the least
    model state (buffers depend on the stage only), so the minimum is among those few."""
    widest = {}
    for z in core.zeros:
        if z[0] not in widest or z[2] > widest[z[0]][2]:
            widest[z[0]] = z
    return min(widest.values(), key=lambda z: core.memory_floor(problem, z))


def _bounded_cores(problem: Problem, c: Constraints, fams: list[Family]) -> tuple[list[_Core], Layout | None]:
    """Cores whose leanest variant may fit, with their time bound, fastest bound first; and the
    leanest layout seen (for the explanation when nothing fits)."""
    out: list[_Core] = []
    leanest, least = None, float("inf")
    for fam in fams:
        zeros = zero_options(fam.dp, c, fam.cp)
        if problem.filters_runnable and (fam.tp > 1 or fam.pp > 1):  # ZeRO-1 runs without TP and PP only
            zeros = tuple(z for z in zeros if z[0] != 1)
        if problem.filters_runnable and fam.cp > 1:  # CP's gradients are summed by FSDP (ZeRO 2, 3)
            zeros = tuple(z for z in zeros if z[0] >= 2)
        if problem.filters_runnable and problem.shape.num_experts:  # ZeRO-1 is refused beside MoE
            zeros = tuple(z for z in zeros if z[0] != 1)
        check_stop()
        for b in fam.micro_batches if zeros else ():
            layout = fam.layout(problem, b)
            core = _make_core(problem, len(out), layout, zeros)
            lean = _lean_zero(core, problem)
            floor = core.memory_floor(problem, lean)
            if floor < least:
                leanest, least = with_zero(layout, lean), floor
            if floor > problem.memory_limit:
                break
            core.pt = pipeline_time(problem.shape, layout, problem.cluster, problem.eff, problem.act_bytes)
            core.bound_s = layout.num_microbatches * core.pt.micro_s + core.pt.pp_s + core.pt.bubble_s
            out.append(core)
    out.sort()
    return out, leanest


def search(problem: Problem, constraints: Constraints = Constraints(), top: int = 10) -> SearchResult:
    """The `top` fastest layouts that fit, by branch and bound over the cores (module docstring)."""
    fams = families(problem, constraints)
    enumerated = sum(len(f.micro_batches) * len(zero_options(f.dp, constraints, f.cp)) for f in fams)
    bounded, leanest = _bounded_cores(problem, constraints, fams)
    best: list[tuple[float, int, Candidate]] = []  # max-heap by step time (negated)
    evaluated, refused, serial = 0, 0, itertools.count()
    for core in bounded:
        if len(best) == top and core.bound_s >= -best[0][0]:
            break
        check_stop()
        if best and out_of_time():  # the explorer's time budget: the best found so far (stop.py)
            break
        for zero in core.zeros:
            if core.memory_floor(problem, zero) > problem.memory_limit:
                continue
            layout = with_zero(core.layout, zero)
            st = step_time(problem.shape, layout, problem.cluster, problem.eff, problem.state,
                           problem.act_bytes, pt=core.pt)
            evaluated += 1
            if len(best) == top and st.total_s >= -best[0][0]:
                continue
            peak = exact_memory(problem, layout)
            if peak.total > problem.memory_limit:
                continue
            if problem.filters_runnable and refusal(problem.model_keys, problem.global_batch_seqs,
                                                    problem.precision, layout):
                refused += 1
                continue
            heapq.heappush(best, (-st.total_s, -next(serial), Candidate(layout, st, peak)))
            if len(best) > top:
                heapq.heappop(best)
    ranked = [cand for _, _, cand in sorted(best, key=lambda e: (-e[0], -e[1]))]
    result = SearchResult(ranked, enumerated, evaluated, refused=refused)
    if not ranked and leanest is not None:
        result.leanest = evaluate(problem, leanest)
    return result


def evaluate(problem: Problem, layout: Layout) -> Candidate:
    """One layout's step time and exact peak memory."""
    return Candidate(layout, step_time(problem.shape, layout, problem.cluster, problem.eff, problem.state,
                                       problem.act_bytes), exact_memory(problem, layout))
