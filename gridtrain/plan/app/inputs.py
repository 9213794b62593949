"""What `gridtrain plan` is asked, parsed and checked: counts with K/M/B/T suffixes, the model
(a preset or `model.*` keys, Llama or GPT blocks), the accelerator and cluster, `--layout`.
Every input that cannot be planned raises PlanError with the broken relation, its numbers and a
fix; nothing here imports torch.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields

from gridtrain import tomlread
from gridtrain.config import ConfigError
from gridtrain.config_load import load_config
from gridtrain.model.args import PRESETS
from gridtrain.layout.schedules import RUNTIME_SCHEDULES
from gridtrain.plan import local, shape, specs
from gridtrain.names import PLAN_RECOMPUTE
from gridtrain.plan.app.refusals import layout_refusal
from gridtrain.plan.search import Constraints, PlanError, Problem

SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}

LAYOUT_KEYS = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp", "dp_shard": "dp_shard", "shard": "dp_shard",
               "zero": "zero_stage", "zero_stage": "zero_stage", "mb": "micro_batch",
               "micro_batch": "micro_batch", "recompute": "recompute", "schedule": "pp_schedule",
               "v": "pp_virtual_stages", "pp_virtual_stages": "pp_virtual_stages",
               "virtual_stages": "pp_virtual_stages", "pp_schedule": "pp_schedule", "ep": "ep"}


def parse_count(text: str, what: str) -> float:
    """'16384', '16_384', '1e6', '16M', '15.6T' -> a number (K 1e3, M 1e6, B or G 1e9, T 1e12)."""
    raw = str(text).strip().replace("_", "").replace(",", "")
    scale = SUFFIXES.get(raw[-1:].upper(), 1.0) if raw[-1:].isalpha() else 1.0
    body = raw[:-1] if scale != 1.0 else raw
    try:
        value = float(body) * scale
    except ValueError:
        raise PlanError(f"{what} = {text!r} is not a count: write e.g. 16384, 16M or 15.6T "
                        "(K = 1e3, M = 1e6, B = 1e9, T = 1e12)") from None
    if value <= 0 or not math.isfinite(value):
        raise PlanError(f"{what} = {text!r} must be a positive finite count")
    return value


def parse_whole(text: str, what: str) -> int:
    """parse_count for things that come whole (GPUs, sequences): 1.5 GPUs is an error, not 1."""
    value = parse_count(text, what)
    if value > 1e15:
        raise PlanError(f"{what} = {text!r} is too large (at most 1e15)")
    if value != int(value):
        raise PlanError(f"{what} = {text!r} is {value:g}, not a whole number")
    return int(value)


def batch_sequences(text: str, seq_len: int) -> tuple[int, str | None]:
    """Sequences per step for a `--global-batch-tokens` value, and a note when the suffix had to be
    read as binary: '16M' tokens of 8,192 is 1,953.125 sequences in decimal; batch sizes are
    customarily powers of two (Llama 3's "16M" is 2,048 x 8,192 = 16,777,216), so M is then read
    as 2^20 (K 2^10, B 2^30, T 2^40)."""
    tokens = parse_count(text, "--global-batch-tokens")
    if tokens > 1e15:
        raise PlanError(f"--global-batch-tokens = {text!r} is too large (at most 1e15)")
    if tokens % seq_len == 0:
        return int(tokens // seq_len), None
    raw = str(text).strip().upper()
    if raw[-1:] in SUFFIXES:
        binary = float(raw[:-1]) * 2 ** {"K": 10, "M": 20, "B": 30, "G": 30, "T": 40}[raw[-1]]
        if binary % seq_len == 0:
            seqs = int(binary // seq_len)
            return seqs, (f"--global-batch-tokens {text} = {tokens:,.0f} tokens is {tokens / seq_len:,.3f} "
                          f"sequences of {seq_len:,}; reading {raw[-1]} as binary: {binary:,.0f} tokens = "
                          f"{seqs:,} sequences")
    seqs = max(1, round(tokens / seq_len))
    raise PlanError(f"--global-batch-tokens {text} = {tokens:,.0f} is not a whole number of {seq_len:,}-token "
                    f"sequences: use {seqs * seq_len:,} ({seqs:,} sequences) or --global-batch {seqs}")


def parse_layout(text: str) -> Constraints:
    """'tp=8,pp=16,dp=128,zero=1,mb=1,recompute=full,schedule=interleaved-1f1b,v=2' -> Constraints."""
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not eq or key not in LAYOUT_KEYS:
            near = difflib.get_close_matches(key, list(LAYOUT_KEYS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise PlanError(f"--layout item {item!r}: expected KEY=VALUE with KEY one of "
                            f"{', '.join(sorted(set(LAYOUT_KEYS)))}{hint}")
        if LAYOUT_KEYS[key] in values:
            raise PlanError(f"--layout gives {LAYOUT_KEYS[key]} twice ({text!r}): give each choice once")
        values[LAYOUT_KEYS[key]] = _layout_value(LAYOUT_KEYS[key], value.strip())
    return Constraints(**values)  # type: ignore[arg-type]


def _layout_value(name: str, value: str) -> object:
    if name == "recompute":
        if value not in PLAN_RECOMPUTE:
            raise PlanError(f"--layout recompute={value}: choose one of {', '.join(PLAN_RECOMPUTE)}")
        return value
    if name == "pp_schedule":
        if value not in RUNTIME_SCHEDULES:
            near = difflib.get_close_matches(value, RUNTIME_SCHEDULES, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise PlanError(f"--layout schedule={value}: choose one of {', '.join(RUNTIME_SCHEDULES)}{hint}")
        return value
    try:
        number = int(value)
    except ValueError:
        raise PlanError(f"--layout {name}={value}: expected a whole number") from None
    if number < (0 if name == "zero_stage" else 1) or (name == "zero_stage" and number > 3):
        raise PlanError(f"--layout {name}={value} is out of range" + (" (ZeRO stages are 0-3)"
                                                                      if name == "zero_stage" else ""))
    return number


@dataclass(frozen=True)
class ModelChoice:
    name: str
    shape: shape.ModelShape
    max_seq_len: int


def resolve_model(preset: str, overrides: dict[str, str], arch: str = "llama") -> ModelChoice:
    """A preset with `model.*` overrides (gridtrain train's keys and checks), as Llama or GPT blocks.
    GPT: the preset's dim, layers, heads and vocabulary; ffn = 4h unless model.ffn_dim is given;
    learned positions for the context; tied embeddings."""
    if preset not in PRESETS:
        near = difflib.get_close_matches(preset, list(PRESETS), n=2, cutoff=0.3)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise PlanError(f"unknown model preset {preset!r}: known are {', '.join(PRESETS)}{hint} "
                        "(or give the shape with --model.dim, --model.n_layers, --model.n_heads, ...)")
    bad = [k for k in overrides if not k.startswith("model.")]
    if bad:
        raise PlanError(f"gridtrain plan takes model.* keys beyond its own options, not {', '.join(bad)}")
    keys = dict(overrides)
    if arch == "gpt":  # multi-head attention, and the MLP width 4h unless given
        keys.setdefault("model.n_kv_heads", "none")
        keys.setdefault("model.ffn_dim", "none")
    try:
        margs = load_config(None, {**keys, "model.preset": preset}).model.args()
    except ConfigError as e:
        raise PlanError("; ".join(e.problems)) from None
    except ValueError as e:  # MoE keys on a dense preset
        raise PlanError(str(e)) from None
    problems = margs.validate()
    if problems:
        raise PlanError("; ".join(problems))
    if arch == "gpt" and margs.moe is not None:
        raise PlanError(f"--arch gpt plans dense GPT blocks, and model {preset!r} is a mixture of experts "
                        f"({margs.moe.num_experts} experts, top {margs.moe.top_k}): drop --arch gpt, or plan a dense preset")
    if arch == "gpt":
        ffn = margs.ffn_dim or 4 * margs.dim
        s = shape.gpt(margs.dim, margs.n_layers, margs.n_heads, margs.vocab_size, margs.max_seq_len, ffn)
    elif arch == "llama":
        s = shape.from_args(margs)
    else:
        raise PlanError(f"--arch {arch!r}: choose 'llama' or 'gpt'")
    name = preset if not overrides else f"{preset} with {', '.join(f'{k[6:]}={v}' for k, v in overrides.items())}"
    return ModelChoice(name + (" as GPT blocks" if arch == "gpt" else ""), s, margs.max_seq_len)


def doc_span(text: str | None, seq_len: int) -> tuple[float | None, str | None]:
    """--doc-len: (attention span, a note) from a document length in tokens or a prepared folder
    (documents.py); (None, None) without it."""
    if text is None:
        return None, None
    from pathlib import Path

    from gridtrain.plan.documents import equal_documents_span, span_note

    folder = Path(text).expanduser()
    digits = text.strip().isdigit()  # tokens, even beside a folder of that name (the explorer sends digits)
    if digits or not text.strip() or not folder.exists():  # '' is no folder (Path('') is the working directory)
        try:
            doc_len = parse_whole(text, "--doc-len")
        except PlanError as err:
            raise err if digits else PlanError(f"{err}; nor is it a folder here (a prepared one: gridtrain data "
                                               "prepare)") from None
        return (equal_documents_span(seq_len, doc_len),
                span_note(seq_len, equal_documents_span(seq_len, doc_len),
                          f"documents of {doc_len:,} tokens from each sequence's start"))
    from gridtrain.data.doc_span import prepared_span
    from gridtrain.errors import UserError

    try:
        span = prepared_span(folder, seq_len)
    except (UserError, ValueError) as err:
        raise PlanError(f"--doc-len {text}: {err}") from None
    return span, span_note(seq_len, span, f"the documents of {text}, cut at {seq_len:,} as training cuts them")


def resolve_local(ranks: int, precision: str, head_dim: int, seq_len: int | None = None,
                  dim: int | None = None) -> local.LocalPlanMachine:
    """`--gpu local`: this machine's calibrated ranks (plan/local.py), for a model of `head_dim` and
    width `dim` at `seq_len`."""
    try:
        return local.local_machine(ranks, precision, head_dim=head_dim, seq_len=seq_len, dim=dim)
    except local.NoCalibration as e:
        raise PlanError(str(e)) from None


def resolve_cluster(gpu: str, cluster_name: str | None, hardware: str | None) -> specs.ClusterSpec:
    """The named cluster, or a built-in one of that accelerator, or a generic 8-GPU node (NVLink at
    half the vendor's both-ways figure, a 400 Gb/s NIC per GPU, the DGX latencies)."""
    try:
        extra = specs.load_hardware(hardware) if hardware else specs.HardwareFile()
        if cluster_name:
            return specs.cluster(cluster_name, extra.clusters)
        acc = specs.accelerator(gpu, extra.accelerators)
    except specs.SpecError as e:
        raise PlanError(str(e)) from None
    except (OSError, tomlread.TOMLDecodeError) as e:
        raise PlanError(f"--hardware {hardware}: {e}") from None
    for make in specs.CLUSTERS.values():
        built = make()
        if built.accelerator == acc:
            return built
    return specs.ClusterSpec(f"generic-{acc.name}", acc, 8, acc.link_gb_per_s / 2 or 25, 13e-6, 50, 55e-6)


def check_constraints(problem: Problem, c: Constraints) -> list[str]:
    """The root relation a `--layout` breaks before any search (refusals.py), with numbers and a fix."""
    from gridtrain.plan.app.experts import ep_refusal

    ep = ep_refusal(problem, c)
    if ep:
        return [ep]
    found = layout_refusal(problem, c)
    return [found[1]] if found else []


LAYOUT_LABELS = {f.name: f.name for f in fields(Constraints)} | {"zero_stage": "zero", "micro_batch": "mb",
                                                                "pp_virtual_stages": "v", "pp_schedule": "schedule"}
"""The --layout key a plan prints for each field of Constraints."""


def constraints_label(c: Constraints) -> str:
    return ",".join(f"{LAYOUT_LABELS[k]}={v}" for k, v in c.given().items())
