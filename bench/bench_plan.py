"""How long the layout search takes: Llama 3 405B on 16,384 H100s (dgx-h100), sequence 8,192,
2,048 x 8,192 = 16M tokens per step.

    python bench/bench_plan.py [--repeats 5]

Each repeat starts cold: the planner's caches (layer costs, activation bytes, link levels) are
cleared first, so the time is what one `gridtrain plan` pays. Prints the minimum and median wall
time, the size of the search space, how many layouts were timed, and the best layout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.model.args import llama3_405b  # noqa: E402
from gridtrain.layout import pipeline_order, schedules  # noqa: E402
from gridtrain.plan import (activations, census, memory, placement, replay, search, shape, specs, state,  # noqa: E402
                            steptime)

CACHED = (steptime.layer_cost, steptime.edge_flops_per_token, steptime._busiest, memory.layer_activation_bytes,
          memory.head_activation_bytes, memory.layers_per_rank, state.state_bytes_per_param,
          memory.census_activations, activations.block_bytes_per_token, census.rank_elements,
          census.zero1_shares, census._local_elements, census.peak_dp_index, memory.stage_counts,
          schedules.forwards_held, placement.axis_levels, search._divisors,
          search.zero_options, search._buffers, search._class_representatives,
          pipeline_order.rank_order, pipeline_order.held_at_peak, replay.replay, replay.step_bubble)


def clear_caches() -> None:
    for fn in CACHED:
        fn.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    problem = search.Problem(shape.from_args(llama3_405b()), specs.cluster("dgx-h100"), 16384, 8192, 2048)
    times = []
    for _ in range(args.repeats):
        clear_caches()
        start = time.perf_counter()
        result = search.search(problem)
        times.append(time.perf_counter() - start)
    best = result.ranked[0]
    lay, st = best.layout, best.time
    print(f"search: min {min(times):.3f} s, median {statistics.median(times):.3f} s over {args.repeats} cold runs")
    print(f"space: {result.enumerated:,} layouts; timed {result.evaluated:,}; ranked {len(result.ranked)}")
    print(f"best: tp={lay.tp} cp={lay.cp} pp={lay.pp} dp={lay.dp} zero={lay.zero_stage} mb={lay.micro_batch} "
          f"m={lay.num_microbatches} {lay.pp_schedule} v={lay.pp_virtual_stages} recompute={lay.recompute}")
    print(f"      step {st.total_s:.3f} s, MFU {st.mfu:.1%}, peak {best.memory.total / 2**30:.1f} GiB on "
          f"pipeline rank {best.memory.rank} (limit {problem.memory_limit / 2**30:.1f} GiB of 80 GB)")


if __name__ == "__main__":
    main()
