"""One metrics writer: a log line per logged step, metrics.jsonl, TensorBoard, a progress bar.

Keys are namespaced and carry units (`throughput/tokens_per_s`, `memory/peak_GiB`, `mfu_pct`).
Exactly one rank writes (the caller decides which).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from gridtrain.errors import BadInput, MissingInput

log = logging.getLogger("gridtrain")


def format_line(step: int, total: int, m: dict[str, float]) -> str:
    parts = [f"step {step:>{len(str(total))}}/{total}"]
    if "loss/train" in m:
        parts.append(f"loss {m['loss/train']:.4f}")
    if "grad/norm" in m:
        parts.append(f"grad_norm {m['grad/norm']:.3f}")
    if "lr" in m:
        parts.append(f"lr {m['lr']:.2e}")
    if "throughput/tokens_per_s" in m:
        parts.append(f"tok/s {m['throughput/tokens_per_s']:,.0f}")
    if "mfu_pct" in m:  # above 100% the peak is wrong, not the run: a calibration measured too low
        flag = " (above the peak: run `gridtrain calibrate` again)" if m["mfu_pct"] > 100 else ""
        parts.append(f"mfu {m['mfu_pct']:.1f}%{flag}")
    if "memory/peak_GiB" in m:
        parts.append(f"mem {m['memory/peak_GiB']:.2f} GiB")
    if "precision/loss_scale" in m:
        parts.append(f"scale {m['precision/loss_scale']:.0f}")
    if "moe/load_max" in m:  # the busiest expert's tokens over the mean, in the most uneven layer
        dropped = f", dropped {m['moe/dropped_frac']:.1%}" if m.get("moe/dropped_frac") else ""
        parts.append(f"expert load {m['moe/load_max']:.2f}{dropped}")
    epochs = [(k.removeprefix("data/epochs/"), v) for k, v in m.items() if k.startswith("data/epochs/")]
    if epochs:  # a mixture's sources: how far each has gone through its data
        parts.append("epochs " + " ".join(f"{name} {value:.3f}" for name, value in epochs))
    if "loss/val" in m:
        parts.append(f"val_loss {m['loss/val']:.4f} val_ppl {m['loss/val_ppl']:.2f}")
        per_source = [(k.removeprefix("loss/val/"), v) for k, v in m.items() if k.startswith("loss/val/")]
        if per_source:
            parts.append("val_loss " + " ".join(f"{name} {value:.4f}" for name, value in per_source))
    return " | ".join(parts)


class MetricsWriter:
    """Writes metrics to `<run_dir>/metrics.jsonl` (appending, so a resumed run continues the
    file) and TensorBoard, logs one line per call, and drives the progress bar."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, tensorboard: bool,
                 progress: bool) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self._jsonl = open(_complete_lines(run_dir / "metrics.jsonl"), "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # heavy import, only when asked

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)
        self._bar = None
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", leave=False,
                             dynamic_ncols=True)

    def write(self, step: int, metrics: dict[str, float], echo: bool = True) -> None:
        record: dict[str, Any] = {"step": step, "time": time.time(), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if echo:
            line = format_line(step, self.total, metrics)
            if self._bar is not None:
                self._bar.write(line)
            else:
                log.info(line)

    def advance(self, loss: float | None = None) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}")

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _complete_lines(path: Path) -> Path:
    """Cut a last line left unfinished by a killed run, so that a resumed run's records start on
    a line of their own (else the first joins the cut one and spoils both)."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = f.read() if f.seek(0) == 0 else b""
                cut = data.rfind(b"\n") + 1
                try:  # a whole record without its newline (a hand-edited file) is kept
                    json.loads(data[cut:])
                    f.write(b"\n")
                except ValueError:
                    f.truncate(cut)
    return path


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl; a resumed run's later records replace earlier ones
    for the same step."""
    by_step: dict[tuple[int, bool], dict[str, Any]] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise MissingInput(f"{run_dir} is not a gridtrain run directory (no metrics.jsonl): give the "
                           "run_dir of a `gridtrain train` run")
    lines = path.read_text(errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            rec = json.loads(line) if line.strip() else None
            if rec is not None:
                by_step[(int(rec["step"]), "loss/val" in rec and "loss/train" not in rec)] = rec
        except (ValueError, KeyError, TypeError) as err:
            if number == len(lines):  # a run killed while writing its last record
                break
            raise BadInput(f"{path}:{number} is not a metrics record ({err})") from None
    return [by_step[k] for k in sorted(by_step)]
