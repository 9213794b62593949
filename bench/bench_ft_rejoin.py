"""A torchft replica group dies and rejoins, measured (issue 35): a lighthouse on loopback, 2
replica groups x FSDP 2 (HSDP 2 x 2), the tiny model, 20 steps. Group 1 kills a rank at the start
of step 5; group 0 is then inside step 5, fails its all-reduce across groups, does not commit and
runs step 5 again alone, reading the whole global batch; torchrun restarts group 1, which takes the
step, weights and optimizer state from group 0 over torchft's HTTP transport (no checkpoint is
read) and trains with it to the end. Group 0 pauses 1.5 s a step from step 6 on, so that the
restart (4-8 s on this 2-core machine) lands before step 12.

Checks: group 0 logs every step once; group 1 rejoins by step 12; every logged loss of either
group equals the one-process run's; the final weights of the two groups are equal; the log names
the steps run with one group. Prints the times. `python bench/bench_ft_rejoin.py` (36-45 s);
`--checkpoint-every 2`: group 1 also saves every 2 steps, so its restart first resumes its own
step 4 and then takes the live step from group 0.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from conftest import write_corpus  # noqa: E402
from test_fault_tolerance import check, run_groups, short_steps  # noqa: E402

STEPS, KILL_AT, REJOIN_BY, PAUSE_S = 20, 5, 12, 1.5


def clock(log: str, pattern: str) -> float:
    """Seconds of the day of the first log line matching `pattern` (HH:MM:SS at its start)."""
    line = next(l for l in log.splitlines() if re.search(pattern, l))
    h, m, s = map(int, line[:8].split(":"))
    return h * 3600 + m * 60 + s


def main(argv: list[str]) -> None:
    every = argv[argv.index("--checkpoint-every") + 1] if "--checkpoint-every" in argv else ""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        corpus = write_corpus(tmp / "corpus")
        start = time.perf_counter()
        group1 = ["--checkpoint.interval", every] if every else []
        out = run_groups(tmp, corpus, STEPS, KILL_AT, PAUSE_S, *group1)
        wall = time.perf_counter() - start
        g0, g1 = out.losses
        assert sorted(g0) == list(range(1, STEPS + 1)), sorted(g0)  # none lost or run twice
        rejoined = sorted(s for s in g1 if s >= KILL_AT)
        assert rejoined and rejoined[0] <= REJOIN_BY and rejoined == list(range(rejoined[0], STEPS + 1)), rejoined
        assert "rejoined: it took a live peer's state" in out.logs[1]
        # group 0 was inside step 5 (its all-reduce across groups) when group 1 died
        assert f"step {KILL_AT} did not complete on every live replica group" in out.logs[0]
        check(tmp, corpus, out, STEPS)
        if every:
            assert re.search(r"resumed from \S+ at step 4", out.logs[1]), out.logs[1][-3000:]
        killed = clock(out.logs[1], "kills itself")
        back = clock(out.logs[1], "rejoined: it took")
        print(f"group 1 killed at the start of step {KILL_AT}; group 0 ran steps {short_steps(out.logs[0])} alone; "
              f"group 1 rejoined at step {rejoined[0]}, {back - killed:.0f} s after the kill (log clock); "
              f"losses of both groups = the one-process run's, final weights equal; {wall:.1f} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
