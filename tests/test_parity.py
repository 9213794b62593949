"""The parity matrix (gridtrain/parity): every layout `validate` accepts trains as one process does.

The matrix is generated from the choices along each axis (data, tensor and pipeline parallelism,
embeddings, precision, recomputation, accumulation, context parallelism, model, expert parallelism,
attention); CI runs a deterministic subset that covers
every pair of choices, plus the layouts that once trained wrong in silence. The full sweep, every
accepted combination at world sizes 1 to 8, is `python bench/parity_sweep.py` (README, "Parity").
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gridtrain.parity.compare import Deviation, adam_ratio_bound, problems, tolerance
from gridtrain.parity.matrix import AXES, Case, all_cases, make_case, pairwise, resume_layout
from gridtrain.parity.run import load_result
from gridtrain.parity.sweep import References, case_overrides, run_cases, verdict

# Accepted once and trained wrong with no error: PP 2 x DDP 2 (1F1B), PP 2 x FSDP 2 under both
# zero-bubble schedules, TP 2 with tied embeddings. Always in the CI subset, in fp32.
REQUIRED = ("ddp.none.1f1b.untied.fp32.none.many.none", "zero3.none.zbv.untied.fp32.none.many.none",
            "zero3.none.interleaved-zb.untied.fp32.none.many.none", "none.tp.none.tied.fp32.none.one.none")
CASES = all_cases()
SUBSET = pairwise(CASES, REQUIRED)


def test_matrix_is_every_combination_of_the_axes():
    assert len(CASES) == math.prod(len(choices) for choices in AXES.values()) == 124416
    assert len({c.name for c in CASES}) == len(CASES)
    assert {c.world for c in CASES if c.accepted} == {1, 2, 4, 8}


@pytest.mark.parametrize("name,reason", [
    ("none.none.1f1b.tied.fp32.none.many.none", "model.tie_embeddings cannot be used with parallel.pp > 1"),
    ("zero1.tp.none.untied.fp32.none.one.none", "parallel.zero_stage 1 shards a plain optimizer"),
    ("hsdp.tp.1f1b.untied.fp32.none.many.none", "needs 16 processes"),
    ("zero3.none.zbv.untied.fp32.selective.many.none", "recompute 'selective' cannot run"),
    ("none.none.dualpipev.untied.fp32.none.one.none", "too few micro-batches for parallel.pp_schedule 'dualpipev'"),
    ("zero1.none.none.untied.fp32.none.one.none.moe.none", "is not compared under parallel.zero_stage 1"),
    ("none.tp.none.untied.fp32.none.one.none.moe.ep", "parallel.ep (2) borrows its ranks from the data- and"),
    ("ddp.none.none.untied.fp32.none.one.none.dense.ep", "parallel.ep (2) shards the routed experts of a mixture"),
    ("zero1.tp.none.untied.fp32.none.one.none.doc_mask", "parallel.zero_stage 1 shards a plain optimizer"),
    ("none.none.dualpipev.untied.fp32.none.one.none.moe.none.doc_restart", "too few micro-batches"),
    ("zero3.none.none.tied.fp16.full.one.none.moe.ep.doc_mask", "data.doc_mask beside model.preset 'tiny-moe'"),
])
def test_refused_layouts_carry_validates_reason(name, reason):
    case = next(c for c in CASES if c.name == name)
    assert reason in case.refused


def test_earlier_cases_keep_their_names():
    """The attention axis came later: a causal case is named as before it (a sweep's verdicts are
    keyed by name), a doc_mask or doc_restart case by its choice after the earlier ones."""
    causal = [c for c in CASES if c.choice("attention") == "causal"]
    assert not any("causal" in c.name for c in causal) and set(REQUIRED) <= {c.name for c in causal}
    masked = next(c for c in CASES if c.choice("attention") == "doc_restart" and c.choice("model") == "moe")
    assert masked.name.endswith(".moe.none.doc_restart") and masked.overrides["data.doc_positions"] == "restart"


def test_pairwise_subset_covers_every_pair_of_accepted_choices():
    possible = set().union(*(c.pairs() for c in CASES if c.accepted))
    covered = set().union(*(c.pairs() for c in SUBSET))
    assert covered == possible
    assert all(c.accepted for c in SUBSET) and [c.name for c in SUBSET[:len(REQUIRED)]] == list(REQUIRED)
    assert len(SUBSET) < 100  # what CI can afford; the full sweep runs the other 7,300


def test_subset_masks_documents_under_every_parallelism_in_fp32():
    """Issue 32's document masking under TP 2, PP 2 and CP 2, and beside each data parallelism, is
    proven by the subset: a doc_mask or doc_restart case of each, in fp32 (1e-5) for TP, PP and CP."""
    masked = [c for c in SUBSET if c.choice("attention") != "causal"]
    fp32 = [c for c in masked if c.choice("precision") == "fp32"]
    assert all(any(c.choice(axis) != "none" for c in fp32) for axis in ("tp", "pp", "cp"))
    assert {c.choice("dp") for c in masked} == set(AXES["dp"])
    assert {c.choice("attention") for c in fp32} == {"doc_mask", "doc_restart"}


def test_matrix_arithmetic_imports_no_torch():
    """In a fresh process, the matrix's verdicts (the subset's cases, and a case refused for each of
    the matrix's reasons: every branch of `validate` it reaches) import no torch, and come out as
    in this process."""
    refused = list({c.refused: c for c in CASES if c.refused}.values())
    sample = [dict(c.choices) for c in SUBSET + refused]
    code = ("import json, sys, gridtrain.parity.matrix as m\n"
            "cases = [m.make_case(c) for c in json.load(sys.stdin)]\n"
            "print(json.dumps(['torch' in sys.modules, [c.refused for c in cases]]))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(sample), capture_output=True, text=True,
                         check=True)
    torch_imported, reasons = json.loads(out.stdout)
    assert not torch_imported and len(refused) > 100
    assert reasons == [c.refused for c in SUBSET + refused]


def test_doc_mask_cases_read_sequences_that_cross_documents(tmp_path, corpus_dir):
    """A doc_mask case and its reference read the short documents: every sequence of its steps
    and of its validation holds at least 3 documents (2 ends of documents inside it), so a mask
    that leaked across them would show; a causal case reads the matrix's corpus."""
    import torch

    from gridtrain.config_load import load_config
    from gridtrain.model.documents import document_ids
    from gridtrain.train.build import build_data
    from gridtrain.train.distributed import World

    refs = References(corpus_dir, tmp_path / "cache", tmp_path)
    case = next(c for c in SUBSET if c.choice("attention") == "doc_mask" and c.world == 1)
    overrides = case_overrides(case, refs)
    assert overrides["data.corpus"] != str(corpus_dir) and overrides["data.doc_mask"] is True
    assert case_overrides(make_case({**dict(case.choices), "attention": "causal"}), refs)["data.corpus"] == str(corpus_dir)
    cfg = load_config(None, {k: v for k, v in overrides.items() if k.startswith(("data.", "train.", "model."))})
    data = build_data(cfg, World(0, 1, 0, 1, torch.device("cpu")))
    inputs, _ = data.train.read(0, cfg.train.steps * cfg.train.global_batch)
    val = torch.cat([x for x, _ in data.val.batches(cfg.train.micro_batch, cfg.train.val_batches)])
    for seqs in (inputs, val):
        docs = document_ids(seqs, data.eos_id).max(dim=1).values + 1  # documents per sequence
        assert docs.min().item() >= 3, docs.tolist()
    assert len(val) >= cfg.train.micro_batch * min(4, cfg.train.val_batches)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("parity")
    refs = References(corpus_dir, work / "cache", work)
    # One launch per world size (the sweep's chunks of 24 bound what a crash costs; here each
    # launch of 2, 4 and 8 processes costs 4 to 14 s before its first case).
    return run_cases(SUBSET, refs, work / "results.jsonl", chunk=len(SUBSET))


@pytest.mark.dist
@pytest.mark.parametrize("name", [c.name for c in SUBSET])
def test_layout_trains_as_one_process(verdicts, name):
    rec = verdicts[name]
    assert rec["status"] == "passed", rec["problems"]


@pytest.mark.dist
def test_every_case_resumed_under_another_layout_and_validated(verdicts):
    """The second leg ran for every case of the subset: its checkpoint resumed under the layout
    drawn for it, in its own launch or in one process, and its validation loss was compared."""
    ran = [verdicts[c.name] for c in SUBSET]
    assert all(v["resumed_as"] and v["leg_loss_rel"] is not None and math.isfinite(v["val_rel"]) for v in ran)
    where = {v["resumed_as"] == "one process" for v in ran}
    assert where == {True, False}  # both ways of resuming were exercised


def test_the_resume_layout_is_another_accepted_one_of_the_same_run():
    """Drawn deterministically; same world, precision, embeddings and micro-batch; never the case
    itself; one process among the options wherever it is another layout."""
    drawn = {c.name: resume_layout(c) for c in SUBSET}
    assert drawn == {c.name: resume_layout(c) for c in SUBSET}
    for case in SUBSET:
        other = drawn[case.name]
        if other is None:
            assert case.world > 1 or case.choice("recompute") != "none"
            continue
        assert other.accepted and other.name != case.name and other.world == case.world
        assert all(other.choice(a) == case.choice(a) for a in ("precision", "embeddings"))
        assert other.overrides["train.micro_batch"] == case.overrides["train.micro_batch"]
    assert len({d.name if d else None for d in drawn.values()}) > len(SUBSET) // 2  # spread, not one favourite


@pytest.mark.dist
def test_subset_really_ran_parallel_layouts(verdicts):
    """Guard against a harness that silently ran one process: tensor parallelism rounds partial
    sums in bf16, so its bf16 runs cannot be bit-identical to one process."""
    tp_bf16 = [v for v in verdicts.values() if v["tp"] != "none" and v["precision"] == "bf16"]
    assert tp_bf16 and all(v["update_rel"] > 0 for v in tp_bf16)


DRY_RUN = [c for c in SUBSET if c.world > 1 and c.choice("model") == "dense"]
"""The dry run refuses a mixture of experts (its all-to-alls need the routing of real tokens)."""


@pytest.mark.dist  # not several processes, but a rank of each: 2 minutes in all
@pytest.mark.parametrize("name", [c.name for c in DRY_RUN])
def test_every_layout_of_the_subset_dry_runs_its_last_rank_as_planned(tmp_path, name):
    """`--dry-run` of the last rank (the loss's) of every multi-rank layout of the subset runs,
    and `plan --check` of it finds the planner's state bytes and saved activations to the byte
    and a prediction for every collective: exact, or marked estimated (composed axis by axis).
    It found what the steps' parity could not: fp16 pipelines died on their loss scale, CP beside
    an interleaved pipeline on its stages' shapes, DDP and ZeRO-1 were refused; the planner
    counted a tied embedding's gradient twice under TP, put fp16's overflow flag on an axis the
    run does not name, and left out fp16's saved loss scale."""
    from gridtrain.config_load import load_config
    from gridtrain.parity.matrix import base_overrides
    from gridtrain.plan.check_run import check_run
    from gridtrain.train.dry_run import dry_run

    case = next(c for c in DRY_RUN if c.name == name)
    rank = case.world - 1
    overrides = dict(case.overrides)
    if case.choice("pp") != "none":  # a dry run cannot mask under a pipeline (it refuses): the same bytes unmasked
        overrides = {k: v for k, v in overrides.items() if k not in ("data.doc_mask", "data.doc_positions")}
    dry_run(load_config(None, {**base_overrides(), **overrides, "run_dir": str(tmp_path)}), case.world, rank)
    rows = check_run(tmp_path)
    assert {r.rank for r in rows} == {rank}
    assert {"weights", "gradients", "optimizer", "activations"} <= {r.bucket for r in rows}
    assert not [r.bucket for r in rows if r.missing]
    off = [(r.bucket, r.predicted, r.measured) for r in rows if not r.estimated and r.measured != r.predicted]
    assert not off


def _detection_cases(work: Path, corpus: Path, precision: str) -> tuple[Case, Case, References, dict[str, dict]]:
    """FSDP 2 (and its doc_mask case), its references, and the runs that must fail: on another
    corpus, without clipping, from another seed, and (fp32) the doc_mask case without its mask."""
    from conftest import write_corpus

    refs = References(corpus, work / "cache", work)
    case = make_case({"dp": "zero3", "tp": "none", "pp": "none", "embeddings": "untied",
                      "precision": precision, "recompute": "none", "accumulation": "many", "cp": "none"})
    same = case_overrides(case, refs)
    masked = make_case({**dict(case.choices), "attention": "doc_mask"})
    spec = {"same": same, "other-data": {**same, "data.corpus": str(write_corpus(work / "other", seed=1))},
            "no-clip": {**same, "train.grad_clip": 0.0}, "other-init": {**same, "train.seed": 1}}
    if precision == "fp32":
        spec["no-mask"] = {**case_overrides(masked, refs), "data.doc_mask": False}
    return case, masked, refs, spec


def launch_cases(work: Path, corpus: Path) -> dict[int, dict[str, dict[str, object]]]:
    """The detection runs of both precisions, in the launch of 2 processes that the test modules
    share (tests/launches.py)."""
    return {2: {f"detect-{precision}-{name}": overrides for precision in ("fp32", "bf16")
                for name, overrides in _detection_cases(work / f"detect-{precision}", corpus, precision)[3].items()}}


@pytest.mark.dist
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parity_check_fails_on_other_data_and_without_clipping(launches, corpus_dir, precision):
    """The check can fail: FSDP 2 runs on another corpus, and without the reference's gradient
    clipping, each differ from one process beyond the tolerance (in losses and in the weights'
    updates); from another seed, its initial weights differ; the same layout on the same data
    does not. In fp32, the doc_mask case of that layout run without the mask (attention across
    its short documents) differs from its reference in the same way."""
    out = launches.out(__name__, 2)
    case, masked, refs, spec = _detection_cases(launches.work / __name__ / f"detect-{precision}", corpus_dir, precision)
    found = {name: verdict(masked if name == "no-mask" else case, load_result(out, f"detect-{precision}-{name}"), "",
                           refs) for name in spec}
    assert found["same"]["status"] == "passed", found["same"]["problems"]
    for name in ("other-data", "no-clip") + (("no-mask",) if precision == "fp32" else ()):
        rec = found[name]
        assert rec["status"] == "failed", name
        assert any("loss" in p for p in rec["problems"]), (name, rec["problems"])
        assert any("update differs" in p or "elements differ" in p for p in rec["problems"]), (name, rec["problems"])
    assert not any("initial weights" in p for p in found["no-clip"]["problems"])
    assert any("initial weights are not one process's" in p for p in found["other-init"]["problems"]), found["other-init"]


def test_adam_ratio_bound_holds_and_is_attained():
    """|m_hat / sqrt(v_hat)| over random gradient sequences never exceeds the bound, and the
    Cauchy-Schwarz equality case (g_s proportional to (b1/b2)^(t-s)) reaches it."""
    b1, b2 = 0.9, 0.95
    rng = random.Random(0)
    for t in range(1, 7):
        bound = adam_ratio_bound(t, b1, b2)
        for _ in range(2000):
            g = [rng.gauss(0, 1) * rng.choice((1e-3, 1.0, 1e3)) for _ in range(t)]
            m = (1 - b1) * sum(b1 ** (t - 1 - s) * g[s] for s in range(t)) / (1 - b1 ** t)
            v = (1 - b2) * sum(b2 ** (t - 1 - s) * g[s] ** 2 for s in range(t)) / (1 - b2 ** t)
            assert abs(m) / math.sqrt(v) <= bound * (1 + 1e-12)
        g = [(b1 / b2) ** (t - 1 - s) for s in range(t)]
        m = (1 - b1) * sum(b1 ** (t - 1 - s) * g[s] for s in range(t)) / (1 - b1 ** t)
        v = (1 - b2) * sum(b2 ** (t - 1 - s) * g[s] ** 2 for s in range(t)) / (1 - b2 ** t)
        assert abs(m) / math.sqrt(v) == pytest.approx(bound, rel=1e-12)
    assert adam_ratio_bound(1, b1, b2) == pytest.approx(1.0)


def test_tolerances_scale_with_the_unit_roundoff():
    lrs = [1e-3, 1e-3]
    fp32, bf16, fp16 = (tolerance(p, 256, lrs, 0.9, 0.95) for p in ("fp32", "bf16", "fp16"))
    assert fp32.loss_rtol == fp32.norm_rtol == fp32.weight_tol == 1e-5 and fp32.update_rtol is None
    # bf16's unit roundoff is 2^-8: loss 4u/sqrt(256 tokens), norm u, update 16u x 2 steps.
    assert bf16.loss_rtol == pytest.approx(2 ** -8 / 4) and bf16.norm_rtol == 2 ** -8
    assert bf16.update_rtol == pytest.approx(2 ** -8 * 32) and bf16.weight_tol is None
    assert fp16.update_rtol == pytest.approx(bf16.update_rtol / 8)
    # 8 experts, top-2: a routing flip moves 2 E / (T k) = 16 / 512 of an expert's update a step.
    # That is the experts', the router's and their FFN norm's bound; every other tensor keeps 16u.
    moe = tolerance("fp16", 256, lrs, 0.9, 0.95, routing=(8, 2))
    assert moe.routed_update_rtol == pytest.approx(fp16.update_rtol + 2 / 32)
    assert (moe.loss_rtol, moe.norm_rtol, moe.update_rtol) == (fp16.loss_rtol, fp16.norm_rtol, fp16.update_rtol)
    assert tolerance("fp32", 256, lrs, 0.9, 0.95, routing=(8, 2)) == fp32
    dev = Deviation([], [], {}, {}, {}, {}, [], [])
    for key in ("layers.1.moe.experts.w2", "layers.1.moe.router.gate.weight", "layers.1.ffn_norm.weight",
                "layers.1.attention.wq.weight", "tok_embeddings.weight"):
        dev.max_abs[key], dev.beyond[key], dev.numel[key], dev.update[key] = 0.0, 0, 1, 0.05
    assert [p.split(":")[0] for p in problems(dev, moe)] == ["layers.1.attention.wq.weight", "tok_embeddings.weight"]
    assert bf16.max_abs == pytest.approx(2 * (1e-3 + 1e-3 * adam_ratio_bound(2, 0.9, 0.95)))


SEGFAULT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
[0]:
  time      : 2026-11-20_06:01:02
  host      : box
  rank      : 3 (local_rank: 3)
  exitcode  : -11 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 11 (SIGSEGV) received by PID 4242
"""


@pytest.mark.parametrize("deaths, status", [(1, "passed"), (2, "crashed")])
def test_a_launch_that_dies_is_retried_alone_once_and_says_so(monkeypatch, tmp_path, deaths, status):
    """A launch that dies with no error of the case's own (a signal, say) runs that case once more
    alone: once is recorded with the first death beside the verdict, twice is a crash."""
    import gridtrain.parity.sweep as sweep

    cases = [c for c in CASES if c.accepted and c.world == 2][:3]
    victim, launches = cases[1].name, []

    def fake_launch(world, spec, out):
        launches.append(list(spec))
        dies = victim in spec and sum(victim in names for names in launches) <= deaths
        for name in spec:
            if dies and name == victim:
                break  # the launch died here: nothing from this case or any after it
            (out / f"{name}.pp0.pt").touch()
        return subprocess.CompletedProcess([], 1 if dies else 0, "", SEGFAULT if dies else "")

    monkeypatch.setattr(sweep, "launch", fake_launch)
    monkeypatch.setattr(sweep, "load_result", lambda out, name: "ran" if (out / f"{name}.pp0.pt").exists() else None)
    monkeypatch.setattr(sweep, "verdict", lambda case, result, error, refs: {
        "name": case.name, "status": "passed" if result else "crashed", "problems": [] if result else [error]})
    refs = References(tmp_path, tmp_path, tmp_path)
    done = run_cases(cases, refs, tmp_path / "results.jsonl")

    assert [done[c.name]["status"] for c in cases] == ["passed", status, "passed"]
    assert done[victim]["retried"] == "rank      : 3 (local_rank: 3) exitcode  : -11 (pid: 4242) traceback : Signal 11 (SIGSEGV) received by PID 4242"
    assert launches[1] == [victim]  # alone, before the cases after it
    assert "retried" not in done[cases[2].name]


def test_each_launch_runs_while_the_one_before_it_is_judged(monkeypatch, tmp_path):
    """Judging a launch's cases (their one-process resumptions) keeps one core busy; the next
    launch runs meanwhile, never beside another launch. Every verdict is recorded, in order."""
    import threading

    import gridtrain.parity.sweep as sweep

    cases = [c for c in CASES if c.accepted and c.world == 2][:3]
    started = {c.name: threading.Event() for c in cases}
    overlapped, running = [], []

    def fake_launch(world, spec, out):
        running.append(out)
        assert len(running) == 1, "two launches at once"
        for name in spec:
            started[name].set()
            (out / f"{name}.pp0.pt").touch()
        time.sleep(0.2)
        running.remove(out)
        return subprocess.CompletedProcess([], 0, "", "")

    def fake_verdict(case, result, error, refs):
        following = cases.index(case) + 1
        if following < len(cases):  # the next launch starts while this one is judged
            overlapped.append(started[cases[following].name].wait(timeout=10))
        return {"name": case.name, "status": "passed", "problems": []}

    monkeypatch.setattr(sweep, "launch", fake_launch)
    monkeypatch.setattr(sweep, "load_result", lambda out, name: "ran" if (out / f"{name}.pp0.pt").exists() else None)
    monkeypatch.setattr(sweep, "verdict", fake_verdict)
    recorded = []
    run_cases(cases, References(tmp_path, tmp_path, tmp_path), tmp_path / "results.jsonl", chunk=1,
              on_verdict=lambda rec: recorded.append(rec["name"]), overlap=True)

    assert overlapped == [True, True] and not running
    assert recorded == [c.name for c in cases]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_sweep_told_to_stop_judges_the_launch_that_ran_and_starts_no_other(monkeypatch, tmp_path, overlap):
    """`bench/parity_sweep.py --minutes`: once stop() holds, the launch that ran is judged (its
    verdicts kept) and no launch starts; the cases after it stay for a resumed sweep."""
    import gridtrain.parity.sweep as sweep

    cases = [c for c in CASES if c.accepted and c.world == 2][:4]
    launches = []

    def fake_launch(world, spec, out):
        launches.append(list(spec))
        for name in spec:
            (out / f"{name}.pp0.pt").touch()
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(sweep, "launch", fake_launch)
    monkeypatch.setattr(sweep, "load_result", lambda out, name: "ran" if (out / f"{name}.pp0.pt").exists() else None)
    monkeypatch.setattr(sweep, "verdict", lambda case, result, error, refs: {
        "name": case.name, "status": "passed", "problems": []})
    results = tmp_path / "results.jsonl"
    done = run_cases(cases, References(tmp_path, tmp_path, tmp_path), results, chunk=1, overlap=overlap,
                     stop=lambda: len(launches) >= 2)

    assert launches == [[cases[0].name], [cases[1].name]]
    assert list(done) == [cases[0].name, cases[1].name]
    assert [json.loads(line)["name"] for line in results.read_text().splitlines()] == list(done)
    launches.clear()
    done = run_cases(cases, References(tmp_path, tmp_path, tmp_path), results, chunk=1, overlap=overlap)
    assert launches == [[cases[2].name], [cases[3].name]] and list(done) == [c.name for c in cases]


def test_an_error_while_judging_kills_the_launch_running_beside(monkeypatch, tmp_path):
    """torchrun runs in a session of its own, which an error or an interrupt of the sweep does not
    reach: left alone, the launch running beside the judging would outlive the sweep."""
    import signal

    import gridtrain.parity.run as run
    import gridtrain.parity.sweep as sweep

    cases = [c for c in CASES if c.accepted and c.world == 2][:2]
    beside = []

    def fake_launch(world, spec, out):
        if cases[1].name in spec:  # the launch that runs while the first is judged
            proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
            run._RUNNING.add(proc)
            beside.append(proc)
            proc.wait()
            run._RUNNING.discard(proc)
        for name in spec:
            (out / f"{name}.pp0.pt").touch()
        return subprocess.CompletedProcess([], 0, "", "")

    def failing_verdict(case, result, error, refs):
        for _ in range(1000):
            if beside:
                break
            time.sleep(0.01)
        raise ValueError("the judging failed")

    monkeypatch.setattr(sweep, "launch", fake_launch)
    monkeypatch.setattr(sweep, "load_result", lambda out, name: "ran" if (out / f"{name}.pp0.pt").exists() else None)
    monkeypatch.setattr(sweep, "verdict", failing_verdict)
    with pytest.raises(ValueError, match="the judging failed"):
        run_cases(cases, References(tmp_path, tmp_path, tmp_path), tmp_path / "results.jsonl", chunk=1, overlap=True)

    assert beside and beside[0].wait(timeout=10) == -signal.SIGKILL


GLOO_READ_ERROR = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                   "[127.0.0.1]:62643: Connection reset by peer")


@pytest.mark.parametrize("error, launches_of_victim, status", [
    (GLOO_READ_ERROR, 2, "passed"),  # a peer died under the case: run it again alone
    ("ValueError: the case's own bug", 1, "crashed"),  # its own error: no second chance
])
def test_a_case_that_saw_a_peer_die_is_retried_alone(monkeypatch, tmp_path, error, launches_of_victim, status):
    import gridtrain.parity.sweep as sweep

    cases = [c for c in CASES if c.accepted and c.world == 2][:3]
    victim, launches = cases[1].name, []

    def fake_launch(world, spec, out):
        launches.append(list(spec))
        first = victim in spec and sum(victim in names for names in launches) == 1
        for name in spec:
            if first and name == victim:
                (out / f"{name}.error.txt").write_text(f"Traceback (most recent call last):\n{error}\n")
                break
            (out / f"{name}.pp0.pt").touch()
        return subprocess.CompletedProcess([], 1 if first else 0, "", "")

    monkeypatch.setattr(sweep, "launch", fake_launch)
    monkeypatch.setattr(sweep, "load_result", lambda out, name: "ran" if (out / f"{name}.pp0.pt").exists() else None)
    monkeypatch.setattr(sweep, "verdict", lambda case, result, error, refs: {
        "name": case.name, "status": "passed" if result else "crashed", "problems": [] if result else [error]})
    done = run_cases(cases, References(tmp_path, tmp_path, tmp_path), tmp_path / "results.jsonl")

    assert [done[c.name]["status"] for c in cases] == ["passed", status, "passed"]
    assert sum(victim in names for names in launches) == launches_of_victim
    assert ("retried" in done[victim]) == (status == "passed")
