"""The parity matrix: every layout gridtrain can be asked for, generated from the choices along
each axis, and for each one `validate`'s verdict. A layout it accepts is run against one process
(`gridtrain.parity.compare`); one it refuses is listed with validate's reason.

Axes and choices (degree 2 on each parallel axis, so the world is 1, 2, 4 or 8 processes):

| axis | choices |
|---|---|
| dp | none, ddp (ZeRO-0 over 2 replicas), zero1, zero2 and zero3 over 2 ranks, hsdp (2 x 2) |
| tp | none, tp (2), tp_sp (2, with sequence parallelism) |
| pp | none, and each schedule over 2 ranks with its virtual stages (1 for gpipe and 1f1b, else 2) |
| embeddings | untied, tied |
| precision | fp32, bf16, fp16 |
| recompute | none, selective, full (train.recompute) |
| accumulation | one micro-batch per step, or several (4, or 2 with 4-way data parallelism) |
| cp | none, cp (2: each sequence split over 2 ranks, ring attention) |
| model | dense (`tiny`), moe (`tiny-moe`: 8 experts of ffn 32, top-2, the auxiliary loss) |
| ep | none, ep (the experts sharded over every data- and context-parallel rank, ep = dp x cp) |
| attention | causal, doc_mask (data.doc_mask), doc_restart (doc_mask, RoPE positions restarted per document) |

The model is the `tiny` preset (or `tiny-moe`) widened to 4 layers, 8 query and 4 KV heads, so every
schedule gets at least one layer per stage. A doc_mask or doc_restart case, and its one-process
reference, read a corpus of short documents (`gridtrain.parity.sweep.write_short_documents`: 4 to
12 bytes each, so every 32-token sequence crosses at least two ends of documents); the others the
matrix's corpus. Everything here is arithmetic on configurations: no torch.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import zlib
from dataclasses import dataclass, field

from gridtrain.config import ConfigError
from gridtrain.config_load import load_config
from gridtrain.layout.schedules import RUNTIME_SCHEDULES, SCHEDULES
from gridtrain.names import PRECISIONS, RECOMPUTE
from gridtrain.validate import validate

STEPS = 3
"""Optimizer steps of a case (the second leg takes the last one after resuming)."""
LR = 2e-3
GRAD_CLIP = 0.3  # below every gradient norm of these runs (0.5-2.4), so clipping acts on every step
GLOBAL_BATCH = 8
# Near the gradients' RMS (about 1e-3 per element here), so that Adam's update depends on the
# gradient's scale and a wrongly scaled, averaged or clipped gradient shows in the weights.
ADAM_EPS = 1e-3

DP_CHOICES: dict[str, dict[str, object]] = {
    "none": {},
    "ddp": {"parallel.zero_stage": 0, "parallel.dp_replicate": 2, "parallel.dp_shard": 1},
    "zero1": {"parallel.zero_stage": 1, "parallel.dp_replicate": 2, "parallel.dp_shard": 1},
    "zero2": {"parallel.zero_stage": 2, "parallel.dp_shard": 2},
    "zero3": {"parallel.zero_stage": 3, "parallel.dp_shard": 2},
    "hsdp": {"parallel.zero_stage": 3, "parallel.dp_replicate": 2, "parallel.dp_shard": 2},
}
TP_CHOICES: dict[str, dict[str, object]] = {
    "none": {},
    "tp": {"parallel.tp": 2},
    "tp_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
}
PP_CHOICES: dict[str, dict[str, object]] = {
    "none": {},
    **{s: {"parallel.pp": 2, "parallel.pp_schedule": s,
           "parallel.pp_virtual_stages": SCHEDULES[s].stages_per_rank or 2} for s in RUNTIME_SCHEDULES},
}
EMBEDDING_CHOICES = {"untied": {"model.tie_embeddings": False}, "tied": {"model.tie_embeddings": True}}
PRECISION_CHOICES = {p: {"train.precision": p} for p in PRECISIONS}
RECOMPUTE_CHOICES = {m: {"train.recompute": m} for m in RECOMPUTE}
ACCUMULATION_CHOICES = ("one", "many")
CP_CHOICES: dict[str, dict[str, object]] = {"none": {}, "cp": {"parallel.cp": 2}}
MODEL_CHOICES: dict[str, dict[str, object]] = {"dense": {}, "moe": {"model.preset": "tiny-moe"}}
EP_CHOICES = ("none", "ep")
"""ep: the routed experts sharded over every data- and context-parallel rank (ep = dp x cp: EP 2 beside
DDP, ZeRO-2 or FSDP 2, or beside CP 2; EP 4 beside HSDP 2 x 2 or beside CP)."""
ATTENTION_CHOICES: dict[str, dict[str, object]] = {
    "causal": {},
    "doc_mask": {"data.doc_mask": True},
    "doc_restart": {"data.doc_mask": True, "data.doc_positions": "restart"},
}
NEW_AXES_DEFAULT: dict[tuple[str, ...], tuple[str, ...]] = {("model", "ep"): ("dense", "none"),
                                                             ("attention",): ("causal",)}
"""The choices of every case on the axes added later, before they existed: a group at these is left
out of a case's name, so the names (and a sweep's verdicts) of the earlier cases stay what they were."""
NEW_AXES = tuple(axis for group in NEW_AXES_DEFAULT for axis in group)

AXES: dict[str, tuple[str, ...]] = {
    "dp": tuple(DP_CHOICES), "tp": tuple(TP_CHOICES), "pp": tuple(PP_CHOICES),
    "embeddings": tuple(EMBEDDING_CHOICES), "precision": tuple(PRECISION_CHOICES),
    "recompute": tuple(RECOMPUTE_CHOICES), "accumulation": ACCUMULATION_CHOICES, "cp": tuple(CP_CHOICES),
    "model": tuple(MODEL_CHOICES), "ep": EP_CHOICES, "attention": tuple(ATTENTION_CHOICES),
}


def base_overrides() -> dict[str, object]:
    """The run every case shares, before its layout: 3 steps of the widened tiny model on the
    global batch of 8 sequences of 32 tokens, clipping active, no validation or checkpoints."""
    return {
        "model.preset": "tiny", "model.n_layers": 4, "model.n_heads": 8, "model.n_kv_heads": 4,
        "model.ffn_dim": 128, "data.seq_len": 32, "train.global_batch": GLOBAL_BATCH,
        "train.steps": STEPS, "train.lr": LR, "train.warmup_steps": 1, "train.grad_clip": GRAD_CLIP,
        "train.eps": ADAM_EPS, "train.val_every": 0, "metrics.tensorboard": False, "metrics.progress": False,
        "metrics.account_every": 0, "train.collective_timeout_s": 300,
    }


@dataclass(frozen=True)
class Case:
    """One point of the matrix: a choice on every axis."""

    choices: tuple[tuple[str, str], ...]  # (axis, choice) in AXES order
    world: int = 0
    overrides: dict[str, object] = field(default_factory=dict, compare=False, hash=False)
    refused: str = ""  # validate's reason, empty when accepted

    @property
    def name(self) -> str:
        chosen = dict(self.choices)
        parts = [choice for axis, choice in self.choices if axis not in NEW_AXES]
        for group, default in NEW_AXES_DEFAULT.items():
            new = tuple(chosen.get(axis, d) for axis, d in zip(group, default))
            parts += [] if new == default else list(new)
        return ".".join(parts)

    @property
    def accepted(self) -> bool:
        return not self.refused

    def choice(self, axis: str) -> str:
        return dict(self.choices)[axis]

    def pairs(self) -> set[tuple[tuple[str, str], tuple[str, str]]]:
        """Every pair of (axis, choice) this case covers."""
        return set(itertools.combinations(self.choices, 2))


_DEFAULTS = {axis: d for group, default in NEW_AXES_DEFAULT.items() for axis, d in zip(group, default)}


def layout_overrides(choices: dict[str, str]) -> dict[str, object]:
    """The config keys of one choice per axis (without the shared base)."""
    out: dict[str, object] = {}
    for table, axis in ((DP_CHOICES, "dp"), (TP_CHOICES, "tp"), (PP_CHOICES, "pp"),
                        (EMBEDDING_CHOICES, "embeddings"), (PRECISION_CHOICES, "precision"),
                        (RECOMPUTE_CHOICES, "recompute"), (CP_CHOICES, "cp"), (MODEL_CHOICES, "model"),
                        (ATTENTION_CHOICES, "attention")):
        out.update(table[choices.get(axis, _DEFAULTS.get(axis, ""))])
    dp = out.get("parallel.dp_replicate", 1) * out.get("parallel.dp_shard", 1)
    if choices.get("ep", "none") == "ep":  # over no data- or context-parallel rank: 2, which validate refuses
        out["parallel.ep"] = max(2, dp * int(out.get("parallel.cp", 1)))
    if "parallel.dp_shard" not in out:
        out["parallel.dp_shard"] = 1
    # "one": the whole local batch in one micro-batch; "many": up to 4 micro-batches (enough for
    # every schedule over 2 pipeline ranks), of one sequence when the local batch is smaller.
    local = GLOBAL_BATCH // dp
    out["train.micro_batch"] = local if choices["accumulation"] == "one" else max(1, local // 4)
    return out


def world_of(overrides: dict[str, object]) -> int:
    return (int(overrides.get("parallel.dp_replicate", 1)) * int(overrides.get("parallel.dp_shard", 1))
            * int(overrides.get("parallel.tp", 1)) * int(overrides.get("parallel.pp", 1))
            * int(overrides.get("parallel.cp", 1)))


def make_case(choices: dict[str, str], max_world: int = 8) -> Case:
    """The case for one choice per axis, with validate's verdict at its world size."""
    overrides = layout_overrides(choices)
    world = world_of(overrides)
    choices = {**_DEFAULTS, **choices}  # an earlier case may leave the later axes out
    ordered = tuple((axis, choices[axis]) for axis in AXES)
    if world > max_world:
        return Case(ordered, world, overrides, f"needs {world} processes, more than {max_world}")
    cfg = load_config(None, {**base_overrides(), **overrides})
    try:
        validate(cfg, world)
    except ConfigError as err:
        return Case(ordered, world, overrides, "; ".join(err.problems))
    return Case(ordered, world, overrides)


def all_cases(max_world: int = 8) -> list[Case]:
    """Every combination of the axes' choices, each accepted or refused."""
    return list(_all_cases(max_world))


@functools.cache
def _all_cases(max_world: int) -> tuple[Case, ...]:  # validated once per process: about 2 s per 10,000
    return tuple(make_case(dict(zip(AXES, combo)), max_world) for combo in itertools.product(*AXES.values()))


@functools.cache
def _accepted(max_world: int = 8) -> tuple[Case, ...]:
    return tuple(c for c in _all_cases(max_world) if c.accepted)


RESUME_MAX_WORLD = 4
"""The largest world whose cases resume under another layout of their world (in their own
launch); wider ones resume in one process. Eight processes share this machine's two cores: late in
an eight-rank launch of tests/test_parity.py's subset, a step of HSDP 2 x 2 x TP 2 + SP took 2.5
minutes and its resumption under ZeRO-3 x TP 2 x CP 2 more than 17."""


def resume_layout(case: Case, max_world: int | None = None) -> Case | None:
    """The layout the case's checkpoint resumes under for its second leg: drawn deterministically
    (a CRC of the case's name) from one process (None) and every other accepted layout of the same
    world size with the case's precision, embeddings, model, attention and micro-batch (so that
    the one-process reference's next step is this step's too); for worlds past `max_world`, one
    process. One process is left out only where it is the case's own layout."""
    options: list[Case | None] = [] if case.world == 1 and case.choice("recompute") == "none" else [None]
    if case.world > (RESUME_MAX_WORLD if max_world is None else max_world):
        return None
    options += [c for c in _runs().get(_run_of(case), ()) if c.name != case.name]
    return options[zlib.crc32(case.name.encode()) % len(options)] if options else None


def _run_of(case: Case) -> tuple[object, ...]:
    """What a layout the case resumes under must share with it: its world, precision, embeddings,
    model, attention and micro-batch."""
    return (case.world, *(case.choice(a) for a in ("precision", "embeddings", "model", "attention")),
            case.overrides["train.micro_batch"])


@functools.cache
def _runs() -> dict[tuple[object, ...], tuple[Case, ...]]:
    """The accepted cases by `_run_of`, each run's by name."""
    runs: dict[tuple[object, ...], list[Case]] = {}
    for c in _accepted():
        runs.setdefault(_run_of(c), []).append(c)
    return {run: tuple(sorted(cases, key=lambda c: c.name)) for run, cases in runs.items()}


def pairwise(cases: list[Case], required: tuple[str, ...] = ()) -> list[Case]:
    """A deterministic subset of the accepted cases that covers every pair of choices (on two
    different axes) that any accepted case covers: the `required` cases first, then greedily the
    case adding the most uncovered pairs per process it starts (ties: smaller world, then name).
    Lazily: a case's gain only falls as pairs get covered, so one whose gain, counted again, still
    leads every other's last count (ties to the earlier) is the one a full scan would pick.
    """
    accepted = [c for c in cases if c.accepted]
    by_name = {c.name: c for c in accepted}
    chosen = [by_name[name] for name in required]
    uncovered = set().union(*(c.pairs() for c in accepted)) - set().union(set(), *(c.pairs() for c in chosen))
    pool = sorted((c for c in accepted if c.name not in required), key=lambda c: (c.world, c.name))
    pairs = [c.pairs() for c in pool]
    heap = [(-len(p & uncovered) / c.world, i) for i, (c, p) in enumerate(zip(pool, pairs))]
    heapq.heapify(heap)
    while uncovered:
        _, i = heapq.heappop(heap)
        gain = -len(pairs[i] & uncovered) / pool[i].world
        if heap and (gain, i) > heap[0]:  # another may gain more now: count it again first
            heapq.heappush(heap, (gain, i))
            continue
        chosen.append(pool[i])
        uncovered -= pairs[i]
    return chosen
