"""The device a process trains on, and its memory readings, without assuming CUDA."""

from __future__ import annotations

import os
import resource

import torch

from gridtrain.plan.machine import cpu_model_name


def pick_device() -> torch.device:
    """The current accelerator when one is present (CUDA, XPU, ...), else the CPU."""
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        return torch.device(acc.type, local_rank % torch.accelerator.device_count())
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return cpu_model_name()
    return torch.get_device_module(device.type).get_device_name(device)


def memory_gib(device: torch.device) -> dict[str, float]:
    """Memory now and at peak: the accelerator's allocator, or the process's resident set on CPU."""
    gib = 2**30
    if device.type != "cpu":
        mod = torch.get_device_module(device.type)
        # Reserved is what the caching allocator holds from the device: the figure an
        # out-of-memory error is decided by (allocated plus the allocator's cached blocks).
        return {"memory/allocated_GiB": mod.memory_allocated(device) / gib,
                "memory/peak_GiB": mod.max_memory_allocated(device) / gib,
                "memory/reserved_peak_GiB": mod.max_memory_reserved(device) / gib}
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return {"memory/rss_GiB": _rss_bytes() / gib, "memory/peak_GiB": peak_kib * 1024 / gib}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
