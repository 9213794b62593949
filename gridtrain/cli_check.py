"""`gridtrain plan --check RUN_DIR`: a run's measured memory, collectives and step time beside what the
planner predicts for its layout (gridtrain/plan/check_run.py, check_device.py)."""

from __future__ import annotations

from pathlib import Path


def plan_check(run_dir: Path) -> int:
    """Print the check of the run in `run_dir` (exit 0; a missing or damaged record is one line, exit 2)."""
    from gridtrain.plan.check_run import (DOC_KERNEL_NOTE, check_run, check_step_time, format_check, format_step_time,
                                          span_line)
    from gridtrain.rundir import RunRecord
    from gridtrain.train.calibrate import local_machine

    record = RunRecord.load(run_dir)  # a missing or damaged record: one line, exit 2
    try:
        print(format_check(check_run(run_dir)))
    except FileNotFoundError as err:
        print(f"memory and collectives: {err}")
    if record.backend == "fake":
        print("step time: none to check, a dry run computes nothing")
        return 0
    doc_line, span_known = span_line(record.config)  # data.doc_mask: the attention the step time counts
    if doc_line:
        print(doc_line)
    if not span_known:
        print("step time: not predicted without the run's documents (above)")
        return 0
    if record.backend == "nccl":  # an accelerator's run: priced by its published peak
        from gridtrain.plan.check_device import check_device_memory, check_device_step_time

        try:
            row, parts, source = check_device_step_time(run_dir)
            print(format_step_time(row, parts, f"({source})"))
        except ValueError as err:
            print(f"step time: {err}")
        print("\n".join(check_device_memory(run_dir)))
        return 0
    try:
        calibration = local_machine(record.threads)  # measured now if not cached
        print(format_step_time(*check_step_time(run_dir, calibration)))
        if record.config.data.doc_mask:
            print(DOC_KERNEL_NOTE)
    except ValueError as err:
        print(f"step time: {err}")
    return 0
