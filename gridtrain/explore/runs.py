"""The runs view's API: the runs in the folder given to `gridtrain explore --runs DIR`, and one
run's curves (from metrics.jsonl) with its measured memory by bucket and collective bytes per
axis beside the planner's prediction (what `gridtrain plan --check` prints)."""

from __future__ import annotations

import math
from pathlib import Path

from gridtrain.errors import UserError
from gridtrain.config import Config
from gridtrain.rundir import RunRecord
from gridtrain.train.metrics import read_metrics

MAX_POINTS = 2000
"""Curve points sent per run; longer runs are thinned evenly (the last step always kept)."""
CURVES = {"loss": "loss/train", "val_loss": "loss/val", "tokens_per_s": "throughput/tokens_per_s",
          "mfu_pct": "mfu_pct", "grad_norm": "grad/norm", "step_s": "time/step_s"}


def _run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.json").is_file())


def _metrics(run: Path) -> list[dict]:
    """The run's records (a resumed run's later ones replace earlier ones); none if unreadable."""
    try:
        return read_metrics(run)
    except UserError:
        return []


def _finite(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def run_list(root: Path | None) -> tuple[int, object]:
    """GET /api/runs: each run's name, layout, steps and last losses."""
    if root is None:
        return 200, {"root": None, "runs": [], "note": "start the explorer with --runs DIR to list the runs in DIR"}
    if not root.is_dir():
        return 404, {"error": f"{root} is not a folder"}
    out = []
    for run in _run_dirs(root):
        rows = _metrics(run)
        losses = [r["loss/train"] for r in rows if "loss/train" in r]
        vals = [r["loss/val"] for r in rows if "loss/val" in r]
        try:
            record = RunRecord.load(run)
            layout = {"world": record.dims.world_size, **{k: getattr(record.dims, k) for k in
                      ("dp_replicate", "dp_shard", "cp", "tp", "pp")}}
            model = record.config.model.preset
        except (UserError, ValueError, KeyError, TypeError):
            layout, model = None, None
        out.append({"name": run.name, "model": model, "layout": layout, "steps": max((r["step"] for r in rows), default=0),
                    "loss": _finite(losses[-1]) if losses else None, "val_loss": _finite(vals[-1]) if vals else None})
    return 200, {"root": str(root), "runs": out}


def _curves(rows: list[dict]) -> dict[str, list]:
    stride = max(1, math.ceil(len(rows) / MAX_POINTS))
    kept = rows[::stride] + ([rows[-1]] if rows and (len(rows) - 1) % stride else [])
    out: dict[str, list] = {"step": [r["step"] for r in kept]}
    for name, key in CURVES.items():
        out[name] = [_finite(r.get(key)) for r in kept]
    vals = [(r["step"], _finite(r["loss/val"])) for r in rows if "loss/val" in r]  # every validation point
    out["val_step"], out["val_loss"] = [s for s, _ in vals], [v for _, v in vals]
    # A mixture of experts: each MoE layer's load (its busiest expert's tokens over the mean) per step.
    layers = sorted({k for r in kept for k in r if k.startswith("moe/load/layer")}, key=lambda k: int(k[14:]))
    out["expert_load"] = {k[len("moe/load/"):]: [_finite(r.get(k)) for r in kept] for k in layers}
    return out


def plan_state(record: RunRecord) -> dict[str, object]:
    """The explorer's state for the run's model, batch and layout (on the page's accelerator: the
    plan of the same layout at scale, not of this run's CPU processes)."""
    cfg, dims = record.config, record.dims
    layout = {"tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "zero": cfg.parallel.zero_stage,
              "mb": cfg.train.micro_batch, "recompute": cfg.train.recompute}
    if dims.ep > 1:
        layout["ep"] = dims.ep
    if dims.pp > 1:
        layout |= {"schedule": cfg.parallel.pp_schedule, "v": cfg.parallel.pp_virtual_stages}
    if cfg.parallel.zero_stage >= 2:
        layout["rep"] = dims.dp_replicate  # the page's HSDP replicas
    state = {"model": cfg.model.preset, "num_gpus": dims.world_size, "seq_len": cfg.data.seq_len,
             "global_batch": cfg.train.global_batch, "precision": cfg.train.precision, "layout": layout}
    return state | doc_len_state(cfg)


def doc_len_state(cfg: Config) -> dict[str, int]:
    """A data.doc_mask run: the page's document length, the one whose span reaches the run's measured
    span (plan/documents.py doc_len_for_span); nothing where the run's prepared data is not here."""
    from gridtrain.data.doc_span import run_attention_span
    from gridtrain.plan.documents import doc_len_for_span

    try:
        span = run_attention_span(cfg)
    except (UserError, ValueError):
        return {}
    return {} if span is None else {"doc_len": doc_len_for_span(cfg.data.seq_len, span)}


def run_page(root: Path | None, name: str) -> tuple[int, object]:
    """GET /api/runs/NAME: the run's curves, and predicted against measured bytes per rank."""
    if root is None:
        return 404, {"error": "no runs folder: start the explorer with --runs DIR"}
    run = root / name
    if not name or "/" in name or "\\" in name or name in (".", "..") or run not in _run_dirs(root):
        return 404, {"error": f"no run {name[:100]!r} in {root}"}
    try:
        record = RunRecord.load(run)
    except UserError as e:
        return 422, {"error": str(e)}
    out: dict[str, object] = {"name": name, "model": record.config.model.preset, "backend": record.backend,
                              "precision": record.config.train.precision,
                              "layout": {k: getattr(record.dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")},
                              "world": record.dims.world_size, "curves": _curves(_metrics(run)),
                              "explore": plan_state(record)}
    from gridtrain.plan.check_run import ALL_RANKS, check_run

    try:
        out["check"] = [{"rank": "all" if r.rank == ALL_RANKS else r.rank, "key": r.bucket,
                         "predicted": None if r.missing else r.predicted, "measured": r.measured,
                         "estimated": r.estimated, "missing": r.missing, "routed": r.routed}
                        for r in check_run(run)]
    except (FileNotFoundError, UserError, ValueError, KeyError) as e:
        out["check"], out["check_note"] = [], f"no accounting to compare: {e}"
    return 200, out
