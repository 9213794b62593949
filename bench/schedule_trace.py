"""Run `gridtrain train` under torchrun with every pipeline action timed (bench_schedules.py's worker).

    python -m torch.distributed.run --standalone --nproc-per-node P bench/schedule_trace.py OUT train ...

Each rank wraps torch's pipeline stage actions (forward, full or input backward, weight backward)
and the schedule's step, and writes OUT/rank<R>.json: one record per action, [step, kind, stage,
micro-batch, wall start, wall end, thread CPU seconds], kind F (forward), B (full backward), I
(input gradients) or W (weight gradients). Wall times come from the monotonic clock every process
on the machine shares; CPU seconds are the calling thread's (the ranks run one intra-op thread,
and on CPU autograd runs the backward on the calling thread).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import time
from pathlib import Path

from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

RECORDS: list[list] = []
STEP = [0]


def _timed(kind_of):
    def wrap(method):
        @functools.wraps(method)
        def timed(self, chunk_id, *args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            out = method(self, chunk_id, *args, **kwargs)
            RECORDS.append([STEP[0], kind_of(args, kwargs), self.stage_index, chunk_id, wall,
                            time.perf_counter(), time.thread_time() - cpu])
            return out
        return timed
    return wrap


def _backward_kind(args: tuple, kwargs: dict) -> str:
    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
    return "B" if full else "I"


def _counted(step):
    @functools.wraps(step)
    def counted(self, *args, **kwargs):
        STEP[0] += 1
        return step(self, *args, **kwargs)
    return counted


def install(out: Path) -> None:
    base = _PipelineStageBase
    base.forward_one_chunk = _timed(lambda a, k: "F")(base.forward_one_chunk)
    base.backward_one_chunk = _timed(_backward_kind)(base.backward_one_chunk)
    base.backward_weight_one_chunk = _timed(lambda a, k: "W")(base.backward_weight_one_chunk)
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        cls.step = _counted(cls.step)
    rank = int(os.environ.get("RANK", "0"))
    atexit.register(lambda: (out / f"rank{rank}.json").write_text(json.dumps(RECORDS)))


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    install(out_dir)
    from gridtrain.cli import main

    sys.exit(main(sys.argv[2:]))
