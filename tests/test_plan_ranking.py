"""`gridtrain plan`'s ranking explains itself: rows that differ in one choice and not measurably in
step time are one row, ties go to the simpler layout, and the plan says why #1 leads #2."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import fields

import pytest

from gridtrain.cli import main
from gridtrain.plan.app.ranking import TIE
from gridtrain.plan.layout import Layout

ARGS = ["plan", "--model", "llama3-70b", "--gpu", "h100", "--num-gpus", "256", "--seq-len", "8192",
        "--global-batch", "512"]


def plan(*extra: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*ARGS, *extra]) == 0
    return out.getvalue()


def test_rows_that_differ_in_nothing_measurable_are_one_row():
    """Llama 3 70B on 256 H100s: the interleaving factors within 0.5% of each other's step time
    are one row naming them; no two rows left differ in one choice within that tolerance."""
    report = json.loads(plan("--json"))
    rows = report["ranked"]
    collapsed = [r for r in rows if r.get("varies")]
    assert collapsed, "nothing collapsed"
    for row in collapsed:
        assert len(row["values"]) == len(row["same_as"]) + 1 >= 2
        for other in row["same_as"]:
            differ = [f.name for f in fields(Layout) if other[f.name] != row["layout"][f.name]]
            implied = {"micro_batch": "num_microbatches", "dp_shard": "dp_replicate"}
            assert [d for d in differ if d != implied.get(row["varies"])] == [row["varies"]]
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            differ = [f.name for f in fields(Layout) if a["layout"][f.name] != b["layout"][f.name]
                      and not (f.name == "num_microbatches" and a["layout"]["micro_batch"] != b["layout"]["micro_batch"])
                      and not (f.name == "dp_replicate" and a["layout"]["dp_shard"] != b["layout"]["dp_shard"])]
            # (a row shows one varying choice: a variant in another choice stays a row of its own)
            assert not (len(differ) == 1 and b["step_s"] <= a["step_s"] * (1 + TIE)
                        and a.get("varies") in (None, differ[0])), (differ, a["step_s"], b["step_s"])
    text = plan()
    from gridtrain.plan.app.render import SHORT

    for row in collapsed:
        assert f"{SHORT[row['varies']]} {', '.join(map(str, row['values']))} alike" in text
    assert "'alike': layouts differing only in that choice" in text


FIVE_TWELVE = ("--num-gpus", "512")


def test_the_plan_says_why_the_first_leads_part_by_part():
    """Llama 3 70B on 256 H100s: the explanation's part differences add up to the gap between #1
    and #2 (each part of the step as the report prints it), and it names the memory each leaves spare."""
    report = json.loads(plan("--json"))
    a, b = report["ranked"][0], report["ranked"][1]
    (line,) = report["why_first"]
    gap = b["step_s"] - a["step_s"]
    assert sum(b["parts_s"][k] - a["parts_s"][k] for k in a["parts_s"]) == pytest.approx(gap)
    assert line.startswith(f"#1 beats #2 by {gap:.3f} s a step") and "GiB of memory spare" in line
    biggest = max(a["parts_s"], key=lambda k: abs(b["parts_s"][k] - a["parts_s"][k]))
    names = {"pp": "pipeline sends", "bubble": "bubble", "dp": "exposed DP/FSDP", "tp": "TP collectives",
             "compute": "compute", "cp": "CP ring", "optimizer": "optimizer"}
    assert f"on {names[biggest]} " in line  # the largest difference first
    assert line in plan()


def test_a_tie_at_the_top_is_explained_as_one():
    """Llama 3 70B on 512 H100s: the first two rows are within 0.5% of each other; the plan says
    they tie, with both step times, what decided it, and the memory each leaves spare."""
    report = json.loads(plan("--json", *FIVE_TWELVE))
    a, b = report["ranked"][0], report["ranked"][1]
    assert abs(b["step_s"] - a["step_s"]) <= TIE * a["step_s"]
    (line,) = report["why_first"]
    assert line.startswith(f"#1 and #2 tie on step time ({a['step_s']:.3f} s against {b['step_s']:.3f}")
    assert "#1 is simpler" in line and "GiB of memory spare" in line


def test_a_tie_goes_to_the_simpler_layout():
    """Two layouts within 0.5%: the one with fewer parallel axes ranks first."""
    from gridtrain.plan.app import ranking
    from gridtrain.plan.search import Candidate

    class Time:
        def __init__(self, s): self.total_s = s
        def parts(self): return {"compute": self.total_s}

    class Memory:
        total = 1.0

    plain = Layout(dp_replicate=8, micro_batch=1, seq_len=8192, num_microbatches=8)
    piped = Layout(pp=2, dp_replicate=4, micro_batch=1, seq_len=8192, num_microbatches=8)
    fast, slow = Candidate(piped, Time(10.0), Memory()), Candidate(plain, Time(10.03), Memory())
    assert [c.layout for c in ranking.order([fast, slow])] == [plain, piped]
    assert [c.layout for c in ranking.order([fast, Candidate(plain, Time(10.2), Memory())])] == [piped, plain]
    (line,) = ranking.why_first(ranking.collapse(ranking.order([fast, slow])), 2.0)
    assert "tie on step time" in line and "#1 is simpler (fewer parallel axes)" in line
