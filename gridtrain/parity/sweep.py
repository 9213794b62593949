"""Run cases of the parity matrix against one process and record each verdict.

Cases of one world size share torchrun launches (`chunk` at a time); the sweep runs each while the
comparing process judges the one before it (`_overlapped`). Each verdict is one line of a JSON-lines
file, written as soon as it is known, so an interrupted sweep resumes where it stopped: 'passed' or
'failed' (with the problems and the largest deviations), 'crashed' (with the error), or 'refused'
(validate's reason; never run). A case whose launch died without an error of its own, or whose error
is a peer's death seen through gloo (a read error, a reset or closed connection, a timeout), is run
once more alone: only a second death makes it 'crashed', and a case that then ran keeps the first
death in its line (`retried`), so a flaky launch is never hidden.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import string
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import torch

from gridtrain.parity.compare import deviation, problems, routing_of, tolerance
from gridtrain.parity.matrix import GLOBAL_BATCH, STEPS, Case, base_overrides, resume_layout
from gridtrain.parity.run import (LEG, Result, kill_launches, launch, load_result, resume_in_one_process,
                                  run_reference)


SHORT_DOCUMENTS = 30_000
"""Documents of the doc_mask cases' corpus (about 270,000 tokens): enough that its validation split
(data.val_fraction's 0.5%, about 1,300 tokens) fills the 4 validation micro-batches of 8
sequences that a case of one process reads."""


def write_short_documents(folder: Path, count: int = SHORT_DOCUMENTS, seed: int = 0) -> Path:
    """JSON lines of `count` documents of 4 to 12 lowercase letters (one byte token each, and the
    end-of-document token): any 13 tokens in a row hold an end of a document, so every 32-token
    sequence crosses at least two, and attention kept inside documents (data.doc_mask) differs
    from causal attention in every sequence. Deterministic in `seed`; the
    file is named by its content's hash, since the prepared-token cache is keyed by the path."""
    rng = random.Random(seed)
    lines = [json.dumps({"text": "".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 12)))})
             for _ in range(count)]
    text = "\n".join(lines) + "\n"
    path = folder / f"short-documents-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


class References:
    """The one-process runs the cases are compared with, one per model, precision, micro-batch size,
    embedding and attention choice (no recomputation in the reference: recomputation must
    not change the numbers either), each with the second leg's validation and last step. A case
    with data.doc_mask and its reference read the short documents (`write_short_documents`, in
    `work`), every other case `corpus`."""

    def __init__(self, corpus: Path, cache_dir: Path, work: Path) -> None:
        self.corpus, self.cache_dir, self.work = corpus, cache_dir, work
        self._runs: dict[tuple, Result] = {}
        self._documents: Path | None = None

    @staticmethod
    def key(overrides: dict[str, object]) -> tuple:
        return (overrides["model.preset"], overrides["train.precision"], overrides["train.micro_batch"],
                overrides["model.tie_embeddings"], overrides["train.steps"], LEG in overrides,
                bool(overrides.get("data.doc_mask", False)), overrides.get("data.doc_positions", "continue"))

    def get(self, overrides: dict[str, object]) -> Result:
        """The reference of a case; with the second leg's validation and last step where the case
        has a second leg (LEG in its overrides), else its whole run straight through."""
        key = self.key(overrides)
        if key not in self._runs:
            one = {k: v for k, v in overrides.items()
                   if not k.startswith("parallel.") and k not in ("train.recompute", LEG)}
            one.update(self.data_overrides(one), run_dir=str(self.work / f"reference-{len(self._runs)}"))
            self._runs[key] = run_reference(one, leg=LEG in overrides)
        return self._runs[key]

    def data_overrides(self, overrides: dict[str, object] | None = None) -> dict[str, object]:
        """The corpus a case of these overrides reads, and the cache of its prepared tokens."""
        masked = bool((overrides or {}).get("data.doc_mask", False))
        if masked and self._documents is None:
            self._documents = write_short_documents(self.work)
        corpus = self._documents if masked else self.corpus
        return {"data.corpus": str(corpus), "data.cache_dir": str(self.cache_dir)}


VAL_BATCHES = 4
"""Micro-batches of validation: the matrix's pipelines validate whole pipeline batches of up to 4
micro-batches, so that one process validates on the same sequences."""
LEG_OVERRIDES = {"train.steps": STEPS, "train.val_every": STEPS, "train.val_batches": VAL_BATCHES}
"""A case's first leg trains STEPS - 1 steps of its run of STEPS (the learning-rate schedule is
the whole run's), validates on VAL_BATCHES micro-batches and saves; its second leg takes the last
step after resuming. val_every only builds the validation split: the harness validates itself."""


def case_overrides(case: Case, refs: References) -> dict[str, object]:
    """The case's configuration with its second leg: the layout it resumes under (`resume_layout`;
    None: one process)."""
    other = resume_layout(case)
    resume = None if other is None else {**other.overrides, "train.recompute": other.choice("recompute")}
    return {**base_overrides(), **case.overrides, **refs.data_overrides(case.overrides), **LEG_OVERRIDES, LEG: resume}


def verdict(case: Case, result: Result | None, error: str, refs: References) -> dict[str, object]:
    """One line of the results: the case's status, problems and largest deviations, for its
    first leg and its second (checkpoint, resume under another layout, validation)."""
    line: dict[str, object] = {"name": case.name, "world": case.world, **dict(case.choices)}
    if result is None:
        return {**line, "status": "crashed", "problems": [last_error_line(error)]}
    overrides = case_overrides(case, refs)
    ref = refs.get(overrides)
    precision, tokens = str(overrides["train.precision"]), GLOBAL_BATCH * int(overrides["data.seq_len"])
    betas = float(overrides.get("train.beta1", 0.9)), float(overrides.get("train.beta2", 0.95))
    routing = routing_of(overrides)
    dev = deviation(result, ref)
    found = problems(dev, tolerance(precision, tokens, ref.lrs, *betas, routing))
    other = resume_layout(case)
    resumed_as, leg = "one process" if other is None else other.name, result.leg
    if leg is None and other is None and result.run_dir is not None:
        leg = resume_in_one_process(result, overrides)
    legs: dict[str, object] = {"resumed_as": resumed_as, "val_rel": _val_deviation(result, ref), "leg_loss_rel": None}
    if leg is None:
        found.append(f"the checkpoint did not resume under {resumed_as}")
    else:
        leg_dev = deviation(leg, ref.leg)
        leg_problems = problems(leg_dev, tolerance(precision, tokens, ref.leg.lrs, *betas, routing))
        found += [f"resumed as {resumed_as}: {p}" for p in leg_problems if p not in found]
        legs["leg_loss_rel"] = leg_dev.summary()["loss_rel"]
    val_tol = tolerance(precision, VAL_BATCHES * int(overrides["train.micro_batch"]) * int(overrides["data.seq_len"]),
                        ref.lrs, *betas).loss_rtol  # the fewest tokens validation reads
    if not legs["val_rel"] <= val_tol:
        found.append(f"validation loss {result.val_loss} vs {ref.val_loss} (relative {legs['val_rel']:.2e} "
                     f"> {val_tol:.2e})")
    timing = {"seconds": result.seconds} if result.seconds else {}
    found.sort(key=lambda p: not any(word in p for word in ("loss", "gradient norm")))  # the steps' first
    return {**line, "status": "failed" if found else "passed", "problems": found[:8], **dev.summary(), **legs, **timing}


def _val_deviation(result: Result, ref: Result) -> float:
    if result.val_loss is None or ref.val_loss is None:
        return math.inf
    return abs(result.val_loss - ref.val_loss) / max(abs(ref.val_loss), 1e-30)


def last_error_line(text: str) -> str:
    """The line of a traceback or launcher log that names the error; for a worker torchrun saw
    die, its rank, exit code and signal ("rank: 3 ... exitcode: -11 ... Signal 11 (SIGSEGV)")."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    died = [line for line in lines if re.match(r"(rank|exitcode|traceback)\s*:", line)]
    if died:
        return " ".join(died[:3])[:500]
    named = [line for line in lines if "Error" in line or "error" in line]
    return (named or lines or ["no result"])[-1][:500]


def read_results(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    return {rec["name"]: rec for rec in map(json.loads, path.read_text().splitlines())}


def run_cases(cases: Iterable[Case], refs: References, results: Path, chunk: int = 24,
              on_verdict: Callable[[dict], None] = lambda rec: None, overlap: bool = False,
              stop: Callable[[], bool] = lambda: False) -> dict[str, dict]:
    """Run every accepted case not yet in `results` (and record the refused ones); returns all
    verdicts by name. With `overlap`, each launch runs while this process judges the one before it
    (`_overlapped`: the sweep's); else one after another, as CI's subset runs. Once `stop()` is
    true, no launch starts: the one running ends and is judged, and the sweep returns, so a sweep
    given a time loses no launch's work (an interrupt kills the running launch)."""
    cases = list(cases)
    done = read_results(results)
    with open(results, "a") as f:
        def record(rec: dict) -> None:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            done[rec["name"]] = rec
            on_verdict(rec)

        for case in cases:
            if not case.accepted and case.name not in done:
                record({"name": case.name, "world": case.world, **dict(case.choices), "status": "refused",
                        "problems": [case.refused]})
        todo = [c for c in cases if c.accepted and c.name not in done]
        groups = [[c for c in todo if c.world == world] for world in sorted({c.world for c in todo})]
        queues = [group[start:start + chunk] for group in groups for start in range(0, len(group), chunk)]
        if overlap:
            _overlapped(queues, refs, record, stop)
        else:
            for queue in queues:
                if stop():
                    break
                _run_launch(queue, refs, record, {})
    return done


def _overlapped(queues: list[list[Case]], refs: References, record: Callable[[dict], None],
                stop: Callable[[], bool]) -> None:
    """Launch each queue in turn and judge the one before it (`_judge`) while it runs: launch N + 1
    starts once launch N has ended and launch N - 1 has been judged. What a launch's death left
    (its culprit alone, then the cases after it) is launched after it and judged without overlap.
    Judging a case that resumes in one process (every case wider than RESUME_MAX_WORLD, and
    narrower ones that draw it) resumes its checkpoint here: 59 s for a launch of 72 eight-rank MoE
    cases, time a sweep once added to each such launch (7 to 9 minutes). Once `stop()` is true no
    launch starts: the last one is judged, then it returns. An error or an interrupt kills the
    running launch."""
    ended: tuple[list[Case], Path, subprocess.CompletedProcess] | None = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside a launch: judging 12 such cases took 7.0 to 8.9 s of CPU, 9.1 to 9.8 s with 2
    pool = ThreadPoolExecutor(max_workers=1)  # a launch waits on its processes without the GIL
    try:
        for queue in [*queues, None]:
            last, running = queue is None or stop(), None
            if not last:
                out = Path(tempfile.mkdtemp(prefix=f"world{queue[0].world}-", dir=refs.work))
                spec = {c.name: case_overrides(c, refs) for c in queue}
                running = (queue, out, pool.submit(launch, queue[0].world, spec, out))
            retried: dict[str, str] = {}
            left = [] if ended is None else _judge(*ended, refs, record, retried)
            ended = None if running is None else (running[0], running[1], running[2].result())
            for again in left:
                _run_launch(again, refs, record, retried)
            if last:
                break
    except BaseException:
        kill_launches()  # else it would outlive this process, beside the launches of a resumed sweep
        raise
    finally:
        pool.shutdown(wait=False)
        torch.set_num_threads(threads)


PEER_DIED = re.compile(r"Read error|Connection reset|Connection closed by peer|[Tt]imed out")
"""What rank 0 raises when another rank of its launch died: not the case's own failure."""


def _run_launch(queue: list[Case], refs: References, record: Callable[[dict], None],
                retried: dict[str, str]) -> None:
    """Run the queue in one launch and judge it; then, one launch each, what its death left."""
    out = Path(tempfile.mkdtemp(prefix=f"world{queue[0].world}-", dir=refs.work))
    proc = launch(queue[0].world, {c.name: case_overrides(c, refs) for c in queue}, out)
    for again in _judge(queue, out, proc, refs, record, retried):
        _run_launch(again, refs, record, retried)


def _judge(queue: list[Case], out: Path, proc: subprocess.CompletedProcess, refs: References,
           record: Callable[[dict], None], retried: dict[str, str]) -> list[list[Case]]:
    """Record the verdicts of a launch of the queue (in `out`); returns the queues to launch
    again, in order. A case that raised is recorded as crashed; the first case the launch died on
    with no error of its own is run again alone (see the module's docstring), then the cases
    after it."""
    results = {c.name: load_result(out, c.name) for c in queue}
    for case in queue:
        if results[case.name] is not None:
            record(_noting_retry(verdict(case, results[case.name], "", refs), retried))
    missing = [c for c in queue if results[c.name] is None]
    if not missing:
        shutil.rmtree(out, ignore_errors=True)
        return []
    errors = [c for c in missing if (out / f"{c.name}.error.txt").exists()]
    culprit = errors[0] if errors else missing[0]
    error = (out / f"{culprit.name}.error.txt").read_text() if errors else proc.stderr[-4000:]
    shutil.rmtree(out, ignore_errors=True)
    missing.remove(culprit)
    if (errors and not PEER_DIED.search(error)) or culprit.name in retried:
        record(_noting_retry(verdict(culprit, None, error or f"exit status {proc.returncode}", refs), retried))
        return [missing] if missing else []
    retried[culprit.name] = last_error_line(error or f"exit status {proc.returncode}")
    return [[culprit], missing] if missing else [[culprit]]


def _noting_retry(rec: dict, retried: dict[str, str]) -> dict:
    return {**rec, "retried": retried[rec["name"]]} if rec["name"] in retried else rec


def summarize(verdicts: dict[str, dict]) -> dict[str, dict[int, int]]:
    """status -> world size -> number of cases."""
    table: dict[str, dict[int, int]] = {}
    for rec in verdicts.values():
        row = table.setdefault(rec["status"], {})
        row[rec["world"]] = row.get(rec["world"], 0) + 1
    return table
