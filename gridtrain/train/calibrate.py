"""Peak FLOP/s of the device a run uses: published dense peaks for accelerators, a measured one
for CPUs (`gridtrain calibrate`: large matmuls, the result cached per machine and thread count;
the cache's place and keys are the planner's, gridtrain/plan/machine.py, which reads it without torch).

Beside the matmul peak, `calibrate` measures what `gridtrain plan --check` needs to predict a
local run's step time: the attention kernel's rate, the memory bandwidth of elementwise work, and
gloo's all-reduce bandwidth and latency and FSDP's host time per collective call between two
processes on this machine (calibrate_gloo.py; between two threads where processes cannot start).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from datetime import timedelta

import torch

from gridtrain.plan.machine import cached_entry, calibration_path, machine_key
from gridtrain.plan.specs import ACCELERATORS, accelerator_of_device
from gridtrain.plan.local import usable_cores
from gridtrain.train.calibrate_gloo import measure_processes, merge_processes
from gridtrain.train.calibrate_kernels import best_seconds, measure_kernels

log = logging.getLogger(__name__)

CALIBRATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_matmul_flops(dtype: torch.dtype, size: int, seconds: float) -> float:
    """Best achieved FLOP/s of a (size x size) @ (size x size) matmul over about `seconds`."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b  # warm-up: first-call dispatch and packing
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def measure_peak(dtype: torch.dtype, seconds: float, sizes: tuple[int, ...] = (512, 1024, 2048, 4096)) -> float:
    """The best over growing square sizes; stops growing when one matmul would outlast the budget
    (fp16 has no fast path on many CPUs, where a 4096^3 product takes minutes)."""
    best = 0.0
    for size in sizes:
        if best and 2 * size**3 / best > seconds / 2:
            break
        best = max(best, measure_matmul_flops(dtype, size, seconds / len(sizes)))
    return best


ATTENTION_SHAPE = (4, 8, 512, 64)
"""(batch, heads, sequence, head_dim) at which `measure_attention_flops` times the kernel."""


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward + backward FLOPs of attention counted in full (no causal halving), as the
    planner counts them: 2 matmuls of 2 s^2 d per head forward, twice that backward."""
    return 3 * 4 * batch * heads * seq * seq * head_dim


def measure_attention_flops(dtype: torch.dtype, seconds: float,
                            shape: tuple[int, int, int, int] = ATTENTION_SHAPE) -> float:
    """Best achieved rate of causal SDPA forward + backward at `shape`, in the FLOPs of
    `attention_flops`: on CPUs the attention kernel runs far below the matmul peak (by head size
    and sequence length: calibrate_kernels.measure_attention_grid)."""
    q, k, v = (torch.randn(*shape).to(dtype).requires_grad_() for _ in range(3))

    def once() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return attention_flops(*shape) / best_seconds(once, seconds)


def measure_memory_bandwidth(seconds: float, numel: int = 1 << 25) -> float:
    """Bytes/s of an elementwise add over fp32 tensors far larger than the caches (two reads and
    one write per element)."""
    a, b, out = torch.ones(numel), torch.ones(numel), torch.empty(numel)
    torch.add(a, b, out=out)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.add(a, b, out=out)
        best = max(best, 3 * 4 * numel / (time.perf_counter() - start))
    return best


def measure_gloo(numel: int = 1 << 20, repeats: int = 8) -> dict[str, float]:
    """All-reduce between two gloo ranks of this process (threads over loopback, as two local
    processes talk): bandwidth = payload bytes / time of a 4 MiB all-reduce, latency = time of a
    one-element all-reduce, each the best of `repeats` (one slow call, another process taking the
    core a moment, moved the mean latency tenfold)."""
    store, times = torch.distributed.HashStore(), {}

    def rank(r: int) -> None:
        group = torch.distributed.ProcessGroupGloo(store, r, 2, timedelta(seconds=60))
        for n in (1, numel):
            t = torch.ones(n)
            group.allreduce([t]).wait()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                group.allreduce([t]).wait()
                best = min(best, time.perf_counter() - start)
            times[r, n] = best

    workers = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"gloo_bytes_per_s": 4 * numel / max(times[r, numel] for r in range(2)),
            "gloo_latency_s": max(times[r, 1] for r in range(2))}


def measure_layer_overhead(seconds: float) -> dict[str, float]:
    """Seconds per layer per micro-batch of gridtrain's transformer blocks' forward and backward
    under bf16 autocast at a shape too small to compute anything (dim 16, 8 tokens): the
    framework's own time (op dispatch, autograd, autocast's casts, and under recomputation the
    checkpoint machinery and its policy), for each recomputation mode. Three blocks against one,
    so what a micro-batch pays once (the loss, autograd's start) falls out; the best of the runs."""
    from gridtrain.model.args import ModelArgs
    from gridtrain.model.llama import Transformer, rope_frequencies
    from gridtrain.parallel.parallelize import apply_recompute

    out = {}
    for mode in ("none", "selective", "full"):
        times = []
        for blocks in (1, 3):
            args = ModelArgs(dim=16, n_layers=blocks, n_heads=2, n_kv_heads=1, vocab_size=32, max_seq_len=8, ffn_dim=32)
            model = Transformer(args)
            apply_recompute(model, mode)
            freqs, x = rope_frequencies(args), torch.randn(1, 8, 16, requires_grad=True)

            def once() -> None:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    h = x
                    for layer in model.layers.values():
                        h = layer(h, freqs)
                h.float().sum().backward()

            once()
            best, deadline = float("inf"), time.perf_counter() + seconds / 6
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                once()
                best = min(best, time.perf_counter() - start)
            times.append(best)
        out[mode] = max(0.0, (times[1] - times[0]) / 2)
    return out


LOADED_SHARE = 0.75
"""A calibration whose process got less than this share of its threads' CPU time ran beside
another busy process: its figures are low (on this 2-core machine, with two busy processes beside
it, about half), so they serve the run that measured them and are not cached."""
ROUNDS = 3
"""The peak is the best of this many rounds of measurements, spread over the time given."""


def calibrate(threads: int | None = None, seconds: float = 2.0, modes: tuple[str, ...] = tuple(CALIBRATION_DTYPES),
              local: bool = True) -> tuple[dict, str]:
    """Measure this CPU's peak matmul FLOP/s for each precision mode, the best of ROUNDS rounds,
    and cache it (merged with what the cache holds for this machine) unless the process did not
    get its threads' CPU time while it measured. With `local`, also the attention rate per mode,
    memory bandwidth and gloo's (local_machine()). Returns the machine's entry with what was
    measured, and why it was not cached ('' when it was)."""
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    key = machine_key(threads)
    wall, cpu = time.perf_counter(), time.process_time()
    peaks = {mode: 0.0 for mode in modes}
    for _ in range(ROUNDS):
        for mode in modes:
            peaks[mode] = max(peaks[mode], measure_peak(CALIBRATION_DTYPES[mode], seconds / ROUNDS))
    share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * threads)
    path = calibration_path()
    cache = json.loads(path.read_text()) if path.exists() else {}
    entry = cache.setdefault(key, {"peak_flops": {}})
    entry["peak_flops"].update(peaks)
    if local:
        entry.setdefault("attention_flops", {}).update(
            {mode: measure_attention_flops(CALIBRATION_DTYPES[mode], seconds / 4) for mode in modes if mode != "fp16"})
        entry["memory_bytes_per_s"] = measure_memory_bandwidth(seconds / 4)
        entry.update(measure_gloo())
        merge_processes(entry, measure_processes(threads, usable_cores()))  # as local ranks talk, where they can start
        overhead = measure_layer_overhead(seconds / 2)
        entry["layer_overhead_s"] = overhead["none"]
        entry["recompute_overhead_s"] = {mode: max(0.0, overhead[mode] - overhead["none"])
                                         for mode in ("selective", "full")}
        entry.update(measure_kernels([m for m in modes if m != "fp16"], seconds, entry))
    entry.update(measured_at=time.time(), machine=platform.node(), cpu_share=share)
    if share < LOADED_SHARE:
        why = (f"not cached: this process had {share:.0%} of its {threads} thread(s)' CPU time while it measured "
               f"(another process is busy on this machine), so the figures are low; they serve this run only: "
               "run `gridtrain calibrate` again when the machine is idle")
        log.warning("calibration %s", why)
        return entry, why
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=2))
    os.replace(tmp, path)
    return entry, ""


_MEASURED: dict[tuple[int, str], float] = {}
"""Peaks this process measured (threads, precision): a busy machine's figures are not cached,
and a process that builds many Trainers (a parity launch builds two a case) measured 1.5 s for
each of them, on every rank, while its own ranks kept the machine busy."""


def cpu_peak_flops(precision: str, threads: int | None = None, remeasure: bool = False) -> float:
    """The cached measured peak for this CPU and thread count; measured now if not cached (or
    `remeasure`), once a process (_MEASURED)."""
    threads = threads or torch.get_num_threads()
    if (threads, precision) in _MEASURED:
        return _MEASURED[threads, precision]
    peaks = cached_entry(threads).get("peak_flops", {})
    if precision not in peaks or remeasure:
        log.info("%s %s calibration for this CPU with %d threads: measuring the matmul peak now "
                 "(`gridtrain calibrate` does it ahead)", "re-measuring the" if remeasure else "no", precision,
                 threads)
        peaks = calibrate(threads, seconds=1.5, modes=(precision,), local=False)[0]["peak_flops"]
        _MEASURED[threads, precision] = peaks[precision]
    return peaks[precision]


def local_machine(threads: int) -> dict:
    """The cached calibration of this CPU at `threads` per rank (calibrate() fills it; measured now,
    and used uncached if the machine is busy, when there is none)."""
    entry = cached_entry(threads)
    if "gloo_bytes_per_s" not in entry:
        log.info("no full calibration for this CPU with %d threads: measuring it now "
                 "(`gridtrain calibrate --threads %d` does it ahead)", threads, threads)
        torch.set_num_threads(threads)
        entry = calibrate(threads, seconds=2.0)[0]
    return entry


def peak_flops(device: torch.device, device_name: str, precision: str) -> float:
    """The dense peak that MFU divides by: the precision's matmul peak on this device."""
    if device.type == "cpu":
        return cpu_peak_flops(precision)
    spec = accelerator_of_device(device_name)
    if spec is None:
        spec = ACCELERATORS["H100-SXM"]
        log.warning("unknown accelerator %r: MFU is reported against the H100 peak", device_name)
    # fp32 runs on TF32 tensor cores at half the 16-bit rate on these parts.
    return spec.peak_flops / 2 if precision == "fp32" else spec.peak_flops
