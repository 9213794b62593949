"""The GPU suite's parity part: the default model's bf16 run on the device and on CPU, compared
within gridtrain.parity.compare's bf16 bounds (the bounds a parallel layout must meet; kernels
that differ between devices round differently in more places, so the report gives the measured
deviations beside the bounds, step by step)."""

from __future__ import annotations

from pathlib import Path

import torch

from gridtrain.parity.compare import deviation, problems, tolerance
from gridtrain.parity.run import Result, run_reference

OVERRIDES = {"train.precision": "bf16", "train.warmup_steps": 5, "train.val_every": 0, "train.sample_tokens": 0,
             "checkpoint.interval": 0, "checkpoint.final": False, "metrics.log_every": 10}


def run_leg(device: str, out: Path, steps: int) -> None:
    """Train the default model for `steps` steps on this process's device and save the result."""
    over = dict(OVERRIDES, run_dir=str(out / f"parity-{device}-run"), **{"train.steps": steps,
                "data.cache_dir": str(out / "cache")})
    r = run_reference(over)
    cpu = {k: v.detach().cpu() for k, v in r.weights.items()}
    init = {k: v.detach().cpu() for k, v in r.initial.items()}
    torch.save({"losses": r.losses, "grad_norms": r.grad_norms, "weights": cpu, "lrs": r.lrs, "initial": init},
               out / f"parity-{device}.pt")


def _load(path: Path) -> Result:
    d = torch.load(path, weights_only=True)
    return Result(d["losses"], d["grad_norms"], d["weights"], d["lrs"], d["initial"])


def compare_legs(out: Path | str) -> dict:
    out = Path(out)
    run, ref = _load(out / "parity-device.pt"), _load(out / "parity-cpu.pt")
    from gridtrain.config_load import load_config

    cfg = load_config(None, {})
    tol = tolerance("bf16", cfg.train.global_batch * cfg.data.seq_len, ref.lrs, cfg.train.beta1, cfg.train.beta2)
    dev = deviation(run, ref)
    found = problems(dev, tol)
    return {"steps": len(ref.losses), "bounds": vars(tol), "worst": dev.summary(), "within": not found,
            "problems": found[:20], "problem_count": len(found),
            "losses": {"device": run.losses, "cpu": ref.losses},
            "grad_norms": {"device": run.grad_norms, "cpu": ref.grad_norms}}
