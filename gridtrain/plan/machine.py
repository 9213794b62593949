"""This machine as the planner sees it, without torch: where `gridtrain calibrate` caches its
measurements, the key of one measurement (processor, cores, threads, torch version) and the cached
entry itself. Measuring is the runtime's (gridtrain/train/calibrate.py)."""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def calibration_path() -> Path:
    root = os.environ.get("GRIDTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "gridtrain")
    return Path(root) / "calibration.json"


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(threads: int) -> str:
    """Identity of a CPU measurement: processor, core count, threads used, torch version (read
    from the installed package's metadata: the same string as torch.__version__)."""
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    return f"{cpu_model_name()}|{os.cpu_count()}cpu|{threads}threads|torch{torch_version}"


def cached_entry(threads: int) -> dict:
    """What `gridtrain calibrate` measured on this machine at `threads` per rank ({} if nothing)."""
    path = calibration_path()
    cache = json.loads(path.read_text()) if path.exists() else {}
    return cache.get(machine_key(threads), {})
