"""`gridtrain plan --check` of a run on an accelerator: the planner's step time for the device the
run recorded (its published peak, the kernels' measured share of it: reference_gpu for one GPU,
steptime.IMPLEMENTATIONS beside others; eager or compiled as the run's train.compile), and its
peak memory against what the caching allocator held (`max_memory_reserved`, which decides an
out-of-memory error), with what lies beyond the planner's buckets named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from gridtrain.plan.check_run import CheckRow, measured_data_wait, measured_step_seconds, run_span
from gridtrain.plan.memory import rank_memory
from gridtrain.plan.reference_gpu import ONE_GPU
from gridtrain.plan.run_collectives import run_layout
from gridtrain.plan.shape import from_args
from gridtrain.plan.specs import accelerator_of_device, cluster
from gridtrain.plan.state import StateBytes
from gridtrain.plan.steptime import IMPLEMENTATIONS, step_time
from gridtrain.rundir import RunRecord

GiB = 2**30


def check_device_step_time(run_dir: Path) -> tuple[CheckRow, dict[str, float], str]:
    """Predicted against measured (median of plain steps) seconds per step of an accelerator run,
    the prediction's parts, and which efficiencies priced it."""
    record = RunRecord.load(run_dir)
    spec = accelerator_of_device(record.device)
    if spec is None:
        raise ValueError(f"no published figures for the device {record.device!r}: add it to plan/specs.py")
    cfg, args = record.config, record.config.model.args()
    implementation = "compiled" if cfg.train.compile else "eager"
    one = record.dims.world_size == 1
    eff = ONE_GPU[implementation] if one else IMPLEMENTATIONS[implementation]
    node = dataclasses.replace(cluster("dgx-h100"), accelerator=spec)
    act_bytes = 4 if cfg.train.precision == "fp32" else 2
    layout = dataclasses.replace(run_layout(args, record.dims, cfg), attention_span=run_span(cfg))
    st = step_time(from_args(args), layout, node, eff,
                   StateBytes.gridtrain(cfg.train.precision), act_bytes)
    parts = {"compute_s": st.compute_s, "bubble_s": st.bubble_s, "comm_s": st.tp_s + st.cp_s + st.pp_s + st.dp_s,
             "optimizer_s": st.optimizer_s}
    source = (f"{implementation}, {'one GPU as gridtrain measured it' if one else 'as torchtitan published'}: "
              f"matmul share {eff.matmul:.3f} of {spec.name}'s {spec.peak_flops / 1e12:.0f} TFLOP/s")
    return CheckRow(0, "step_time_s", st.total_s, measured_step_seconds(run_dir),
                    data_wait=measured_data_wait(run_dir)), parts, source


def check_device_memory(run_dir: Path) -> list[str]:
    """The planner's peak (its buckets on pipeline rank 0) against the run's allocator peaks, and
    the terms beyond the buckets: the allocator's cache and fragmentation (reserved - allocated),
    what the step holds beyond the buckets at its peak (allocated - buckets: the loss's fp32
    logits and their gradient, kernels' workspaces; negative where the sum counts gradients and
    activations that do not all live at once), and the CUDA context, outside both."""
    record = RunRecord.load(run_dir)
    cfg, args = record.config, record.config.model.args()
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return [f"memory peak: {path} is missing: the run recorded no allocator peaks"]
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    last = next((r for r in reversed(records) if "memory/reserved_peak_GiB" in r), None)
    if last is None:
        return ["memory peak: the run recorded no allocator peaks (memory/reserved_peak_GiB)"]
    act_bytes = 4 if cfg.train.precision == "fp32" else 2
    predicted = rank_memory(from_args(args), run_layout(args, record.dims, cfg),
                            StateBytes.gridtrain(cfg.train.precision), act_bytes, ranks=(0,))[0].total / GiB
    allocated, reserved = last["memory/peak_GiB"], last["memory/reserved_peak_GiB"]
    return [f"memory peak: planned {predicted:.2f} GiB, allocated {allocated:.2f} GiB at most, reserved "
            f"{reserved:.2f} GiB at most (max_memory_reserved, what an out-of-memory error is decided by), "
            f"reserved/planned {reserved / predicted:.3f}",
            f"  beyond the buckets: {allocated - predicted:+.2f} GiB allocated at the peak against the planned sum "
            f"(+: the loss's fp32 logits and their gradient, kernel workspaces; -: gradients and activations that "
            f"the sum counts together but that do not all live at once), {reserved - allocated:+.2f} GiB held by "
            f"the caching allocator (cached blocks, fragmentation); the CUDA context (about 0.5 GiB) lies outside both"]
