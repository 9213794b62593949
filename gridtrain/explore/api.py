"""The explorer's JSON API: a request is checked field by field, turned into the arguments of
`gridtrain plan --json` and answered by that command's own code, so the page never computes a
number of its own. Every answer is (HTTP status, JSON-able dict); a request the planner cannot
take is a 4xx naming the field, the value and what it accepts, never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import shlex
import time
from dataclasses import dataclass
from typing import Callable

from gridtrain.model.args import PRESETS
from gridtrain.layout.schedules import RUNTIME_SCHEDULES, schedule as row_of
from gridtrain.names import PLAN_RECOMPUTE
from gridtrain.plan.replay import replay
from gridtrain.plan import stop
from gridtrain.plan.search import PlanError
from gridtrain.plan.specs import ACCELERATOR_ALIASES, ACCELERATORS, CLUSTERS
from gridtrain.plan.state import CONVENTIONS

MAX_GPUS = 131_072
"""The largest cluster the explorer plans (8x the 16,384 GPUs of Llama 3 405B); `gridtrain plan`
takes more from the command line."""
SEARCH_SECONDS = 2.5
"""How long one request searches before it answers with the best layouts found so far, marked
partial (plan/stop.py); a search that has found none by then goes on to REQUEST_SECONDS."""
REQUEST_SECONDS = 10.0
"""How long one request may search at most: past it with nothing found the answer is a 503 saying
so and naming the fix, rather than a thread kept busy for minutes (never "invalid": the inputs are)."""
MAX_TIMELINE_OPS = 4096
"""Pipeline timelines with more actions (forwards, backwards, weight passes) than this are not drawn."""


class BadRequest(ValueError):
    """A request field the planner cannot take: its name, its value and what it accepts."""


@dataclass(frozen=True)
class Field:
    kind: str
    """'int', 'float', 'str', 'bool' or 'choice'."""
    low: float = 0
    high: float = math.inf
    choices: tuple[str, ...] = ()
    flag: str = ""
    """The `gridtrain plan` option it becomes ('' for the layout's keys)."""
    low_open: bool = False


def _gpu_names() -> tuple[str, ...]:
    """The accelerators by the names `gridtrain plan --gpu` takes, in lower case."""
    return tuple(sorted({*(name.lower() for name in ACCELERATORS), *ACCELERATOR_ALIASES}))


FIELDS: dict[str, Field] = {
    "model": Field("choice", choices=tuple(PRESETS), flag="--model"),
    "arch": Field("choice", choices=("llama", "gpt"), flag="--arch"),
    "gpu": Field("choice", choices=_gpu_names(), flag="--gpu"),
    "cluster": Field("choice", choices=tuple(CLUSTERS), flag="--cluster"),
    "num_gpus": Field("int", 1, MAX_GPUS, flag="--num-gpus"),
    "seq_len": Field("int", 16, 1 << 20, flag="--seq-len"),
    "global_batch": Field("int", 1, 1 << 24, flag="--global-batch"),
    "tokens": Field("float", 1e3, 1e16, flag="--tokens"),
    "precision": Field("choice", choices=("bf16", "fp16", "fp32"), flag="--precision"),
    "convention": Field("choice", choices=tuple(CONVENTIONS), flag="--convention"),
    "implementation": Field("choice", choices=("eager", "compiled", "megatron"), flag="--implementation"),
    "hbm_usable": Field("float", 0, 1, flag="--hbm-usable", low_open=True),
    "doc_len": Field("int", 1, 1 << 24, flag="--doc-len"),  # tokens only: a request names no folder
    "price": Field("float", 0, 1e4, flag="--price"),
    "top": Field("int", 1, 50, flag="--top"),
    "any_layout": Field("bool", flag="--any-layout"),
}
REQUIRED = ("model", "num_gpus")
"""What a question must name: the rest has `gridtrain plan`'s defaults."""
SHAPE: dict[str, Field] = {
    "dim": Field("int", 8, 1 << 17), "n_layers": Field("int", 1, 1024), "n_heads": Field("int", 1, 1024),
    "n_kv_heads": Field("int", 1, 1024), "ffn_dim": Field("int", 8, 1 << 20),
    "vocab_size": Field("int", 2, 1 << 22), "tie_embeddings": Field("bool"),
}
LAYOUT: dict[str, Field] = {
    "tp": Field("int", 1, 1024), "pp": Field("int", 1, 1024), "cp": Field("int", 1, 1024),
    "dp": Field("int", 1, MAX_GPUS), "dp_shard": Field("int", 1, MAX_GPUS), "zero": Field("int", 0, 3),
    "mb": Field("int", 1, 1 << 16), "v": Field("int", 1, 64), "ep": Field("int", 1, 1024),
    "schedule": Field("choice", choices=RUNTIME_SCHEDULES), "recompute": Field("choice", choices=PLAN_RECOMPUTE),
}


def _value(name: str, value: object, field: Field) -> object:
    """`value` checked against `field`, or BadRequest saying what is wrong."""
    if field.kind == "bool":
        if not isinstance(value, bool):
            raise BadRequest(f"{name}: expected true or false, got {value!r:.60}")
        return value
    if field.kind == "choice":
        if not isinstance(value, str) or value.lower() not in field.choices:
            raise BadRequest(f"{name}: {value!r:.60} is not one of {', '.join(field.choices)}")
        return value.lower()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name}: expected a number, got {type(value).__name__} {value!r:.60}")
    if not math.isfinite(value):
        raise BadRequest(f"{name}: {value!r} is not a finite number")
    if field.kind == "int" and value != int(value):
        raise BadRequest(f"{name}: expected a whole number, got {value!r}")
    low_ok = value > field.low if field.low_open else value >= field.low
    if not (math.isfinite(value) and low_ok and value <= field.high):
        bound = f"> {field.low:g}" if field.low_open else f">= {field.low:g}"
        raise BadRequest(f"{name}: {value!r} is out of range (must be {bound} and <= {field.high:g})")
    return int(value) if field.kind == "int" else float(value)


def _section(body: dict, key: str, fields: dict[str, Field]) -> dict[str, object]:
    part = {} if body.get(key) is None else body[key]
    if not isinstance(part, dict):
        raise BadRequest(f"{key}: expected an object of {', '.join(fields)}")
    unknown = sorted(set(part) - set(fields))
    if unknown:
        raise BadRequest(f"{key}.{unknown[0]}: unknown field; {key} takes {', '.join(fields)}")
    return {k: _value(f"{key}.{k}", v, fields[k]) for k, v in part.items() if v is not None}


def plan_args(body: object) -> list[str]:
    """The `gridtrain plan` arguments (after 'plan') a request stands for, `--json` included."""
    if not isinstance(body, dict):
        raise BadRequest("the request must be a JSON object, e.g. {\"model\": \"llama3-8b\", \"num_gpus\": 8}")
    missing = [name for name in REQUIRED if body.get(name) is None]
    if missing:
        raise BadRequest(f"{missing[0]}: missing; a request names at least {' and '.join(REQUIRED)}")
    unknown = sorted(set(body) - set(FIELDS) - {"shape", "layout"})
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field; the request takes {', '.join([*FIELDS, 'shape', 'layout'])}")
    args: list[str] = []
    for name, field in FIELDS.items():
        if body.get(name) is None:
            continue
        value = _value(name, body[name], field)
        if field.kind == "bool":
            args += [field.flag] if value else []
        else:
            args += [field.flag, repr(value) if field.kind == "float" else str(value)]
    for key, value in _section(body, "shape", SHAPE).items():
        args += [f"--model.{key}", str(value).lower()]
    layout = _section(body, "layout", LAYOUT)
    if layout:
        args += ["--layout", ",".join(f"{k}={v}" for k, v in layout.items())]
    return args + ["--json"]


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """`gridtrain plan`'s option parser, built once (parsing leaves it unchanged)."""
    from gridtrain.plan.app.options import plan_parser

    return plan_parser()


def run_plan_json(args: list[str]) -> tuple[dict | None, str]:
    """`gridtrain plan ARGS` through the command's own code: (its JSON or None, its error line)."""
    from gridtrain.plan.app.command import run_plan

    try:
        parsed, extra = _parser().parse_known_args(args)
    except (argparse.ArgumentError, SystemExit) as e:
        raise BadRequest(f"gridtrain plan refuses these options: {e}") from None
    out, err = io.StringIO(), io.StringIO()
    run_plan(parsed, extra, out, err)
    text = out.getvalue()
    return (json.loads(text) if text.strip() else None), err.getvalue().strip().removeprefix("gridtrain plan: ")


def timeline(layout: dict) -> dict[str, object]:
    """The pipeline schedule's actions for one step, as the planner times them: each rank's actions
    in the runtime's (torch's) order, replayed with the measured costs (plan/replay.py): times in
    units of one micro-batch's forward through a rank's layers; F forward, B fused backward, I and W
    the zero-bubble schedules' input- and weight-gradient passes; chunk = stage // pp."""
    pp, m, v, name = (layout["pp"], layout["num_microbatches"], layout["pp_virtual_stages"], layout["pp_schedule"])
    if pp == 1:
        return {"ops": [], "note": "pp = 1: no pipeline, every micro-batch runs on each rank in turn"}
    actions = (3 if row_of(name).split_backward else 2) * pp * m * row_of(name).virtual(v)
    if actions > MAX_TIMELINE_OPS:
        return {"ops": [], "note": f"{actions:,} actions is too many to draw (at most {MAX_TIMELINE_OPS:,})"}
    try:
        step = replay(name, pp, v, m)
    except (ValueError, RuntimeError) as e:  # a leanest layout the schedule cannot run as given
        return {"ops": [], "note": f"not drawn: {e}"}
    return {"ops": [[rank, mb, kind, start, end, stage // pp] for rank, kind, stage, mb, start, end in step.actions],
            "note": "", "bubble": step.bubble, "makespan": step.span}


def plan(body: object, cancelled: Callable[[], bool] = lambda: False) -> tuple[int, dict]:
    """POST /api/plan: 200 with the plan (fitting or not; "partial" when the search stopped at its
    time budget with the best found so far), 400 for a malformed request, 422 for inputs the planner
    refuses (its reason and fix), 503 when the search found nothing in REQUEST_SECONDS, 499 when
    `cancelled()` said nobody awaits the answer (the page typed on)."""
    start = time.perf_counter()
    try:
        args = plan_args(body)
    except BadRequest as e:
        return 400, {"error": str(e)}
    command = "gridtrain plan " + shlex.join(args[:-1])
    try:
        with stop.budget(SEARCH_SECONDS, REQUEST_SECONDS, cancelled) as budget:
            report, error = run_plan_json(args)
    except BadRequest as e:
        return 400, {"error": str(e)}
    except PlanError as e:
        report, error = None, str(e)
    except stop.SearchTimeout as e:
        return 503, {"error": str(e), "timed_out": True, "command": command}
    except stop.SearchCancelled:
        return 499, {"error": "cancelled: a newer request took this one's place", "cancelled": True}
    if report is None:
        return 422, {"error": error or "the planner took no plan from these inputs", "command": command}
    layout = report["chosen" if report["fits"] else "leanest"]["layout"] if "memory" in report else None
    return 200, {"plan": report, "command": command, "timeline": timeline(layout) if layout else None,
                 "partial": budget.partial, "elapsed_ms": (time.perf_counter() - start) * 1e3}


ROUTES: dict[str, Callable[..., tuple[int, dict]]] = {"/api/plan": plan}
"""The POST routes that search: each takes the body and `cancelled`, and runs in a plan slot."""


LLAMA2_7B = {"n_kv_heads": 32, "ffn_dim": 11008, "vocab_size": 32000}
"""The lecture's "7B": Llama 2 7B's shape (Touvron et al. 2023), as llama3-8b's preset with these
overrides (dim 4096, 32 layers and 32 heads are the same)."""

PRESETS_TRY = [
    {"name": "7b-8gpu", "title": "7B on 8 GPUs, pure DP",
     "text": "Every GPU holds the whole model state (16 bytes per parameter): over the HBM. ZeRO-3 (FSDP) "
             "shards it 8 ways and it fits.",
     "state": {"model": "llama3-8b", "shape": LLAMA2_7B, "gpu": "h100", "num_gpus": 8, "seq_len": 4096,
               "global_batch": 512, "layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 0, "mb": 1, "recompute": "none"}}},
    {"name": "70b-256gpu", "title": "70B on 256 GPUs, pure DP",
     "text": "Every GPU holds 70B parameters' state, over a terabyte: nothing fits until something shards it. "
             "The fixes are ranked by the MFU they reach: ZeRO-3 over the 256 ranks first, a 32-stage pipeline far "
             "behind.",
     "state": {"model": "llama3-70b", "gpu": "h100", "num_gpus": 256, "seq_len": 8192, "global_batch": 512,
               "layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 0}}},
    {"name": "405b-128gpu", "title": "405B on 128 GPUs: TP 8 + PP 4 + FSDP",
     "text": "Each axis divides the memory and adds its own traffic: TP all-reduces inside the node, PP sends "
             "between nodes and a bubble, FSDP all-gathers and reduce-scatters over the replicas.",
     "state": {"model": "llama3-405b", "gpu": "h100", "num_gpus": 128, "seq_len": 8192, "global_batch": 64,
               "layout": {"tp": 8, "pp": 4, "cp": 1, "zero": 3, "schedule": "1f1b", "v": 1}}},
    {"name": "405b-8gpu", "title": "405B on 8 GPUs",
     "text": "No layout fits: the model state alone is 6.5 TB against 8 x 80 GB. More GPUs, or a smaller model.",
     "state": {"model": "llama3-405b", "gpu": "h100", "num_gpus": 8, "seq_len": 8192, "global_batch": 64,
               "layout": {}}},
]
"""The lecture's "try these" cases, as explorer states."""


CONVENTION_TEXT = {
    "gridtrain": ("gridtrain's runtime", "what gridtrain train holds: fp32 weights that are also the master copy, fp32 "
                  "gradients and Adam's two fp32 moments, plus a 4-byte step count per tensor, tensor by tensor; the "
                  "16-bit copy autocast casts and FSDP gathers is a buffer"),
    "zero": ("ZeRO paper", "Rajbhandari et al. 2020: 16-bit weights and gradients, fp32 master weights and moments "
             "(K = 12)"),
    "megatron": ("Megatron-LM", "16-bit weights, fp32 gradient buffers (bf16 accumulates in fp32), fp32 master "
                 "weights and moments"),
    "no-master": ("lecture notes", "the notes' count: 16-bit weights and gradients and Adam's two fp32 moments, no "
                  "fp32 master copy (7B: 7 x 12 = 84 GB; 405B over 1,024 GPUs with ZeRO-3: 405 x 12 / 1,024 = "
                  "4.75 GB)"),
}
"""Each convention's name on the page and what it counts; the bytes come from plan/state.py."""


def conventions() -> dict[str, dict[str, object]]:
    """The bytes-per-parameter conventions: label, what they count, bytes by bucket (bf16)."""
    out = {}
    for name, make in CONVENTIONS.items():
        state = make("bf16")
        label, counts = CONVENTION_TEXT[name]
        out[name] = {"label": f"{label}: {state.total:g} bytes/param", "counts": counts, "weights": state.weights,
                     "gradients": state.gradients, "optimizer": state.optimizer, "total": state.total}
    return out


def options() -> dict[str, object]:
    """GET /api/options: what the page's inputs offer (presets, accelerators, clusters, schedules),
    the lecture's presets, and the request's limits."""
    from gridtrain.plan.shape import from_args, param_counts

    models = {}
    for name in PRESETS:
        a = PRESETS[name]()
        counts = param_counts(from_args(a))
        models[name] = {"dim": a.dim, "n_layers": a.n_layers, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads,
                        "ffn_dim": a.hidden_dim, "vocab_size": a.vocab_size, "max_seq_len": a.max_seq_len,
                        "tie_embeddings": a.tie_embeddings, "params": counts.total, "active_params": counts.active,
                        "experts": a.moe.num_experts if a.moe else 0}
    accelerators = {name: {"hbm_gb": acc.hbm_gb, "peak_tflops": acc.bf16_tflops}
                    for name, acc in ACCELERATORS.items()}
    return {"models": models, "gpus": _gpu_names(), "accelerators": accelerators, "clusters": list(CLUSTERS),
            "cluster_accelerators": {name: make().accelerator.name for name, make in CLUSTERS.items()},
            "schedules": list(RUNTIME_SCHEDULES), "recompute": list(PLAN_RECOMPUTE), "presets": PRESETS_TRY,
            "conventions": conventions(),
            "fields": {name: {"low": f.low, "high": f.high} for name, f in {**FIELDS, **LAYOUT}.items()
                       if f.kind in ("int", "float")}}
