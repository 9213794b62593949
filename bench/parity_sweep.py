"""The full parity sweep: every layout of the parity matrix at world sizes 1 to 8, each run that
`validate` accepts compared with one process (losses, gradient norms with clipping active,
gathered weights), every other one listed with validate's reason.

    python bench/parity_sweep.py [--results FILE] [--pairwise] [--only SUBSTRING] [--name NAME ...]
                                 [--choice AXIS=VALUE ...] [--chunk 24] [--minutes M] [--report]

Verdicts go to FILE (JSON lines, default runs/parity/results.jsonl) as they come, so a stopped
sweep resumes where it stopped; delete the file to start over. `--minutes M` starts no torchrun
launch after M minutes: the running one ends and is judged, and the sweep stops with the report
(an interrupt instead loses the running launch's cases). `--report` prints the report of
the verdicts FILE holds (of the cases --only and --name select) and runs nothing. The default
corpus (the Python standard library) is prepared once in the usual cache. At the end it prints
the counts by status and world size, the largest deviations that passed, per precision, and every
failure. The attention axis's cases (`--only .doc_`) read a corpus of short documents written
into the results' folder (`gridtrain.parity.sweep.write_short_documents`), whatever --corpus says.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.data.corpus import remember_readable_sources  # noqa: E402
from gridtrain.parity import matrix  # noqa: E402
from gridtrain.parity.matrix import AXES, all_cases, pairwise  # noqa: E402
from gridtrain.parity.sweep import References, read_results, run_cases, summarize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("runs/parity/results.jsonl"))
    parser.add_argument("--pairwise", action="store_true", help="only the pairwise subset CI runs")
    parser.add_argument("--only", default="", help="only cases whose name contains this")
    parser.add_argument("--name", action="append", default=[], help="only this case (repeatable)")
    parser.add_argument("--choice", action="append", default=[], metavar="AXIS=VALUE",
                        help="only cases with this choice on this axis, e.g. model=dense (repeatable)")
    parser.add_argument("--chunk", type=int, default=24, help="cases per torchrun launch")
    parser.add_argument("--minutes", type=float, default=math.inf,
                        help="start no launch after this many minutes; judge the running one and stop")
    parser.add_argument("--corpus", type=Path, default=None, help="default: the Python standard library")
    parser.add_argument("--report", action="store_true",
                        help="print the report of the verdicts already in --results and run nothing")
    parser.add_argument("--resume-world", type=int, default=matrix.RESUME_MAX_WORLD,
                        help="the widest world whose cases resume under another layout of their world "
                             "(wider ones resume in one process)")
    args = parser.parse_args()
    if not args.minutes > 0:
        parser.error(f"--minutes {args.minutes:g}: give a positive number of minutes")
    matrix.RESUME_MAX_WORLD = args.resume_world

    cases = all_cases()
    if args.pairwise:
        cases = pairwise(cases)
    chosen = _choices(parser, args.choice)
    cases = [c for c in cases if args.only in c.name and (not args.name or c.name in args.name)
             and all(c.choice(axis) == value for axis, value in chosen)]
    unknown = sorted(set(args.name) - {c.name for c in all_cases()})
    if unknown:
        parser.error(f"no case of the matrix is named {', '.join(unknown)}")
    if args.report:
        if not args.results.exists():
            parser.error(f"--report: {args.results} does not exist")
        done = read_results(args.results)
        verdicts = {c.name: done.get(c.name) or {"name": c.name, "world": c.world, **dict(c.choices),
                                                 "status": "refused", "problems": [c.refused]}
                    for c in cases if c.name in done or not c.accepted}
        print(report(verdicts))
        todo = sum(c.accepted and c.name not in done for c in cases)
        print(f"\n{todo} of {sum(c.accepted for c in cases)} accepted cases not yet run")
        return
    remember_readable_sources()  # the comparing process builds a run per case on one corpus too
    args.results.parent.mkdir(parents=True, exist_ok=True)
    work = args.results.parent / "work"
    work.mkdir(exist_ok=True)
    corpus = args.corpus.resolve() if args.corpus else _stdlib()
    refs = References(corpus, Path("~/.cache/gridtrain").expanduser(), work)
    start, count = time.time(), [0]
    runnable = sum(c.accepted for c in cases)

    def progress(rec: dict) -> None:
        if rec["status"] == "refused":
            return
        count[0] += 1
        mark = "" if rec["status"] == "passed" else f"  {rec['status'].upper()}: {rec['problems'][:2]}"
        print(f"[{count[0]}/{runnable} {time.time() - start:6.0f} s] {rec['name']}{mark}", flush=True)

    deadline = start + 60 * args.minutes
    verdicts = run_cases(cases, refs, args.results, args.chunk, progress, overlap=True,
                         stop=lambda: time.time() >= deadline)
    print(report({c.name: verdicts[c.name] for c in cases if c.name in verdicts}))
    todo = sum(c.name not in verdicts for c in cases)
    if todo:
        print(f"\nstopped after {args.minutes:g} minutes: {todo} accepted cases not yet run")


def _choices(parser: argparse.ArgumentParser, given: list[str]) -> list[tuple[str, str]]:
    """--choice AXIS=VALUE, each checked against the matrix's axes."""
    out = []
    for text in given:
        axis, _, value = text.partition("=")
        if axis not in AXES:
            parser.error(f"--choice {text}: the axes are {', '.join(AXES)}")
        if value not in AXES[axis]:
            parser.error(f"--choice {text}: {axis} is one of {', '.join(AXES[axis])}")
        out.append((axis, value))
    return out


def _stdlib() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


def report(verdicts: dict[str, dict]) -> str:
    table = summarize(verdicts)
    worlds = sorted({w for row in table.values() for w in row})
    lines = [f"axes: {', '.join(f'{a} ({len(c)})' for a, c in AXES.items())}; {len(verdicts)} combinations",
             "", "| status | " + " | ".join(f"world {w}" for w in worlds) + " | all |",
             "|---|" + "---|" * (len(worlds) + 1)]
    for status in ("passed", "failed", "crashed", "refused"):
        row = table.get(status, {})
        lines.append(f"| {status} | " + " | ".join(str(row.get(w, 0)) for w in worlds) + f" | {sum(row.values())} |")
    lines += ["", legs_table(verdicts, worlds), "", "largest deviations among passed cases:"]
    for precision in AXES["precision"]:
        passed = [v for v in verdicts.values() if v["status"] == "passed" and v["precision"] == precision]
        if passed:
            worst = {k: max(v[k] for v in passed) for k in ("loss_rel", "grad_norm_rel", "update_rel", "max_abs")}
            worst.update((k, max(v[k] for v in passed if v.get(k) is not None))  # the second leg's
                         for k in ("val_rel", "leg_loss_rel") if any(v.get(k) is not None for v in passed))
            lines.append(f"  {precision}: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    bad = [v for v in verdicts.values() if v["status"] in ("failed", "crashed")]
    lines += ["", f"{len(bad)} failed or crashed:"] + [f"  {v['name']}: {v['problems'][:3]}" for v in bad]
    retried = [v for v in verdicts.values() if "retried" in v]
    lines += ["", f"{len(retried)} launches died and were run again alone:"]
    lines += [f"  {v['name']}: died ({v['retried']}), then {v['status']} alone" for v in retried]
    refused: dict[str, int] = {}
    for v in verdicts.values():
        if v["status"] == "refused":
            reason = v["problems"][0].split(":")[0]
            refused[reason] = refused.get(reason, 0) + 1
    lines += ["", "refused, by reason:"] + [f"  {n:5d}  {r}" for r, n in sorted(refused.items(), key=lambda x: -x[1])]
    return "\n".join(lines)


LEGS = {"steps": "its steps as one process",
        "resume": "its SIGTERM checkpoint resumed under another layout, the next step as one process",
        "validation": "its validation loss as one process"}


def leg_of(problem: str) -> str:
    """Which part of a case a verdict's problem belongs to (gridtrain.parity.sweep.verdict)."""
    if problem.startswith(("resumed as", "the checkpoint did not resume")):
        return "resume"
    return "validation" if problem.startswith("validation loss") else "steps"


def legs_table(verdicts: dict[str, dict], worlds: list[int]) -> str:
    """Cases that ran, by world size, whose each part held (a crashed case held none)."""
    ran = [v for v in verdicts.values() if v["status"] in ("passed", "failed", "crashed")]
    lines = ["| of the cases that ran | " + " | ".join(f"world {w}" for w in worlds) + " | all |",
             "|---|" + "---|" * (len(worlds) + 1)]
    for leg, text in LEGS.items():
        held = [v for v in ran if v["status"] != "crashed" and leg not in {leg_of(p) for p in v["problems"]}]
        counts = [sum(v["world"] == w for v in held) for w in worlds]
        lines.append(f"| {text} | " + " | ".join(map(str, counts)) + f" | {len(held)} of {len(ran)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
