"""gloo between two processes of this machine, for `gridtrain plan --gpu local` and `plan --check`:
the latency and bandwidth of an all-reduce, and FSDP2's own time per collective call beyond the
bytes it moves, each measured as two local ranks run them (two processes over loopback).

Why processes: between two threads of one process a one-element all-reduce took 0.1 ms here;
between processes, as `gridtrain train --nproc N` runs them, a 16 KB all-reduce took 0.27 ms over
2 and 4.5-7.7 ms over 4 on the 2 cores, whose ranks wait for the scheduler at every ring step.
Each tensor-parallel layer, pipeline send and FSDP unit pays it.

FSDP's host time per call: on a GPU, FSDP2's host work (copying a unit's parameters into the
all-gather's buffer and out of it, chunking the gradients into the reduce-scatter's, DTensor's
dispatch) runs ahead of the kernels and hides. On CPU ranks over gloo it is the step: the same
thread computes, copies and waits, once per FSDP unit, where DDP waits once per 25 MB bucket. On
the small model (4 layers, 6 FSDP units) over 2 ranks it made ZeRO-2 and ZeRO-3 steps 58-108 ms
slower than DDP where their bytes differ by a few ms. The measurement: the two processes run
gridtrain's transformer at a shape too small to compute anything (dim 16, 8 tokens; the layer
overhead's shape), with 2 and with 8 blocks, under DDP, ZeRO-2 and ZeRO-3 (FSDP2 as the runtime
applies it, bf16 gathers, gradient clipping and AdamW as the trainer steps). Per block added,
ZeRO-2 issues 2 more FSDP calls a step (one all-gather, one reduce-scatter) and ZeRO-3 3 (a
second all-gather in backward); DDP's buckets do not grow. So

    call = [(z2(8) - ddp(8)) - (z2(2) - ddp(2)) + (z3(8) - ddp(8)) - (z3(2) - ddp(2))] / (6 x (2 + 3))

less the latency the planner already charges for a call (one ring step between two ranks: half
the all-reduce's). The difference of differences leaves out the compute, the framework's time
per layer (both sides pay it) and what a step pays once.

Tensor parallelism's host time per layer per micro-batch, the same way: the tiny model sharded
over the two ranks (parallel/tensor_parallel.py, no sequence parallelism) against the same model
alone in each, per block added, less the latency of the 4 all-reduces a block's forward and
backward make (all the planner charges at these sizes): DTensor's dispatch, its redistributions
and its optimizer and clipping over DTensors (about 8 ms a block here, where a block alone
takes under 1 ms).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BLOCKS = (2, 8)
KINDS = ("alone", "ddp", "zero2", "zero3", "tp")
CALLS_PER_BLOCK = {"zero2": 2, "zero3": 3}
"""FSDP collectives a step issues per unit: ZeRO-2 an all-gather and a reduce-scatter, ZeRO-3 an
all-gather in forward and one in backward and a reduce-scatter."""


def per_call_seconds(times: dict[tuple[str, int], float], latency_s: float) -> float:
    """FSDP's time per collective call beyond its bytes (module docstring), from the step times
    `times[(kind, blocks)]` of the two-rank runs."""
    low, high = BLOCKS
    extra = sum((times[kind, high] - times["ddp", high]) - (times[kind, low] - times["ddp", low]) for kind in CALLS_PER_BLOCK)
    calls = (high - low) * sum(CALLS_PER_BLOCK.values())
    return max(0.0, extra / calls - latency_s)


TP_CALLS_PER_BLOCK = 4
"""Tensor-parallel all-reduces per block per micro-batch the planner charges without recomputation
(steptime.layer_cost): attention's and the MLP's outputs forward, their inputs' gradients backward."""


def tp_block_seconds(times: dict[tuple[str, int], float], latency_s: float) -> float:
    """Tensor parallelism's host time per block per micro-batch beyond the latency of its
    collectives (module docstring), from the step times `times[(kind, blocks)]`: TP over the two
    ranks against the same model alone in each."""
    low, high = BLOCKS
    extra = (times["tp", high] - times["alone", high]) - (times["tp", low] - times["alone", low])
    return max(0.0, extra / (high - low) - TP_CALLS_PER_BLOCK * latency_s)


def _step_seconds(kind: str, blocks: int, steps: int) -> float:
    """Median step of gridtrain's tiny transformer with `blocks` blocks under `kind` on this rank."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh

    from gridtrain.config import TrainConfig
    from gridtrain.model.args import ModelArgs
    from gridtrain.model.llama import Transformer
    from gridtrain.parallel.data_parallel import apply_fsdp
    from gridtrain.parallel.grads import clip_grad_norm
    from gridtrain.parallel.tensor_parallel import apply_tp
    from gridtrain.train.optim import build_optimizer

    torch.manual_seed(0)
    args = ModelArgs(dim=16, n_layers=blocks, n_heads=2, n_kv_heads=2, vocab_size=32, max_seq_len=8, ffn_dim=32)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = Transformer(args)
    if kind == "ddp":
        replicate(model, device_mesh=mesh, bucket_cap_mb=25)
    elif kind == "tp":
        apply_tp(model, mesh, sequence_parallel=False)
    elif kind != "alone":
        apply_fsdp(model, mesh, reshard_after_forward=kind == "zero3", param_dtype=torch.bfloat16)
    optimizer = build_optimizer(model, TrainConfig())  # the trainer's AdamW, as it picks its kernel
    tokens = torch.randint(0, args.vocab_size, (1, 8))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(tokens)
        out.float().sum().backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


SMALL = 4096
"""Elements of the small all-reduce whose time is the latency: 16 KB (gloo reduces one element
another way: over 4 processes on 2 cores it took 0.35-0.4 ms, 16 KB 4.5-7.7 ms)."""


def _all_reduce_seconds(numel: int, repeats: int) -> float:
    """Median time of back-to-back all-reduces of `numel` fp32 elements over the default group."""
    t, times = torch.ones(numel), []
    dist.all_reduce(t)
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, world: int, store_path: str, out_path: str, threads: int, steps: int) -> None:
    """One process of a launch: with 2 processes every measurement, with more the latency alone."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        times: dict[str, float] = {"latency": _all_reduce_seconds(SMALL, 40)}
        if world == 2:
            times["bandwidth"] = _all_reduce_seconds(1 << 20, 12)
            # Twice over, alternating, so a drift of the machine falls on every kind alike; the best.
            for _ in range(2):
                for blocks in BLOCKS:
                    for kind in KINDS:
                        t = _step_seconds(kind, blocks, steps)
                        times[f"{kind}/{blocks}"] = min(times.get(f"{kind}/{blocks}", t), t)
        if rank == 0:
            Path(out_path).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def _launch(world: int, threads: int, steps: int) -> dict[str, float]:
    """Run `world` processes of _rank; rank 0's measurements. Every process started is gone when
    this returns or raises (one that failed to start leaves none behind waiting for it)."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "times.json")
        ranks: list[subprocess.Popen] = []
        errors: list[str] = []
        try:
            for r in range(world):
                ranks.append(subprocess.Popen([sys.executable, "-m", __name__, str(r), str(world), store, out,
                                               str(threads), str(steps)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            errors = [p.communicate(timeout=300)[1].strip() for p in ranks]
            return json.loads(Path(out).read_text())
        except (OSError, ValueError, subprocess.SubprocessError) as err:
            raise OSError("; ".join([str(err), *(e.splitlines()[-1] for e in errors if e)])) from err
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()


MOST_PROCESSES = 32
"""The largest launch the latency is measured over: beyond it local.ring_step_seconds scales the
widest measurement in proportion (a 64-core machine would otherwise start 128 processes)."""


def launch_sizes(cores: int, threads: int) -> list[int]:
    """Process counts the ring step is measured over: 2, the cores' worth of ranks and twice that
    (where ranks outnumber the cores), at most MOST_PROCESSES."""
    ranks = max(1, cores // threads)
    return sorted({min(n, MOST_PROCESSES) for n in (2, max(2, ranks), 2 * ranks)})


def measure_processes(threads: int, cores: int, steps: int = 12) -> dict:
    """gloo between processes of `threads` threads each (module docstring): from two, the
    all-reduce's bandwidth (payload bytes / time of a 4 MiB one) and latency (a 16 KB one),
    medians, FSDP's time per collective call and tensor parallelism's per layer beyond their
    bytes, as if the two processes had the `cores` to themselves (plan/local.py shares them out
    again by the plan's ranks); and the time per ring step of the small all-reduce over 2, `cores`
    and twice `cores` processes (launch_sizes), as measured (ranks beyond the cores wait for the scheduler at every
    step: 0.13 ms over 2 processes here, 0.75 ms over 4 in the cached calibration). {} where the
    processes cannot start."""
    try:
        raw = _launch(2, threads, steps)
        steps_by_ranks = {n: (raw["latency"] if n == 2 else _launch(n, threads, steps)["latency"]) / (2 * (n - 1))
                          for n in launch_sizes(cores, threads)}
    except OSError as err:
        log.warning("gloo between processes not measured (%s): between two threads instead", err)
        return {}
    times = {(key.split("/")[0], int(key.split("/")[1])): t for key, t in raw.items() if "/" in key}
    contention = max(1.0, 2 * threads / cores)
    latency = raw["latency"] / contention
    return {"gloo_bytes_per_s": 4 * (1 << 20) / raw["bandwidth"] * contention, "gloo_latency_s": latency,
            "gloo_ring_step_s": {str(n): t for n, t in steps_by_ranks.items()},
            "fsdp_call_s": per_call_seconds(times, raw["latency"] / 2) / contention,
            "tp_block_s": tp_block_seconds(times, raw["latency"]) / contention}


PROCESS_KEYS = ("gloo_ring_step_s", "fsdp_call_s", "tp_block_s")
"""What only measure_processes measures: the thread fallback has nothing to put in their place."""


def merge_processes(entry: dict, measured: dict) -> None:
    """Put measure_processes' figures into the calibration `entry`; where the processes could not
    start ({}), drop what an earlier calibration measured between processes, so that the entry
    holds this calibration's between-thread figures (the ring step table would otherwise take
    precedence over them: plan/local.ring_step_seconds)."""
    if not measured:
        for key in PROCESS_KEYS:
            entry.pop(key, None)
    entry.update(measured)


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
