"""Layout search: the options it enumerates obey gridtrain's runtime rules, branch and bound returns
what brute force returns, and Llama 3 405B on 16,384 H100s gets a layout that fits and is
plausible. (Its time is measured in bench/bench_plan.py, not here.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gridtrain.model.args import llama3_8b, llama3_405b
from gridtrain.layout.schedules import stage_ranks
from gridtrain.plan import memory, search, shape, specs, state
from gridtrain.plan.layout import Layout
from gridtrain.plan.search import Constraints, Problem

DGX = specs.cluster("dgx-h100")
S405 = shape.from_args(llama3_405b())


@pytest.fixture(scope="module")
def llama405() -> tuple[Problem, search.SearchResult]:
    problem = Problem(S405, DGX, 16384, 8192, 2048)
    return problem, search.search(problem)


def test_405b_best_layout_fits_and_is_plausible(llama405):
    problem, result = llama405
    best = result.ranked[0]
    lay = best.layout
    assert lay.num_gpus == 16384 and lay.global_batch_tokens == 2048 * 8192
    # Fits in 80 GB (and in the 90% a plan may use), by the exact peak over every pipeline rank.
    exact = memory.peak_rank(memory.rank_memory(S405, lay))
    assert exact.total <= problem.memory_limit < 80e9
    # Plausible: tensor parallelism inside one node, a model-parallel group of a node or more
    # within TP x CP, pipeline stages of a few layers, a utilization in the published range.
    assert lay.tp in (4, 8) and lay.tp * lay.cp >= 8
    assert 8 <= lay.pp <= 32
    assert lay.zero_stage in (1, 2, 3) and lay.micro_batch == 1
    assert 0.35 <= best.time.mfu <= 0.6
    # Ranked by step time, all fitting, ten of them, from a large space.
    times = [c.time.total_s for c in result.ranked]
    assert times == sorted(times) and len(times) == 10
    assert all(c.memory.total <= problem.memory_limit for c in result.ranked)
    assert result.enumerated > 10_000 and result.evaluated < result.enumerated / 5


def test_branch_and_bound_equals_brute_force():
    # Every layout of the space evaluated and sorted gives the same top ten as the pruned search.
    problem = Problem(shape.from_args(llama3_8b()), DGX, 32, 4096, 64)
    pruned = search.search(problem)
    everything = []
    for fam in search.families(problem, Constraints()):
        for b in fam.micro_batches:
            for zero in search.zero_options(fam.dp, Constraints(), fam.cp):
                cand = search.evaluate(problem, search.with_zero(fam.layout(problem, b), zero))
                if cand.memory.total <= problem.memory_limit:
                    everything.append(cand)
    everything.sort(key=lambda c: c.time.total_s)
    assert len(everything) > 100
    assert [c.time.total_s for c in pruned.ranked] == pytest.approx([c.time.total_s for c in everything[:10]])
    assert pruned.ranked[0].layout == everything[0].layout


def test_constraints_are_kept():
    problem = Problem(S405, DGX, 16384, 8192, 2048)
    fixed = Constraints(tp=8, pp=16, cp=1, pp_schedule="interleaved-1f1b")
    result = search.search(problem, fixed, top=5)
    assert result.ranked
    for c in result.ranked:
        assert (c.layout.tp, c.layout.pp, c.layout.cp, c.layout.dp) == (8, 16, 1, 128)
        assert c.layout.pp_schedule == "interleaved-1f1b" and c.layout.pp_virtual_stages >= 2


def test_nothing_fits_reports_the_leanest():
    problem = Problem(S405, DGX, 64, 8192, 256)
    result = search.search(problem)
    assert result.ranked == []
    assert result.leanest is not None and result.leanest.memory.total > problem.memory_limit
    # 405B x 16 bytes of model state over 64 GPUs is over 100 GB each before any activation.
    assert result.leanest.memory.total > 405e9 * 16 / 64


def test_schedule_options_follow_the_runtime():
    free = Constraints()
    assert search.schedule_options(1, 32, 7, free) == [("1f1b", 1)]
    opts = search.schedule_options(4, 32, 8, free)
    assert ("1f1b", 1) in opts and ("zbv", 2) in opts
    assert {v for s, v in opts if s == "interleaved-zb"} == set(range(2, 9))
    # 1F1B needs m >= pp; ZB-V m >= 2 pp; interleaved runs micro-batches in rounds of pp.
    assert ("1f1b", 1) not in search.schedule_options(8, 32, 4, free)
    assert ("zbv", 2) not in search.schedule_options(8, 32, 8, free)
    assert not [p for p in search.schedule_options(4, 32, 9, free) if p[0] == "interleaved-zb"]  # 2 rounds, 9 % 2
    # A named schedule is the only one tried; without a pipeline the name is moot.
    named = Constraints(pp_schedule="interleaved-1f1b")
    assert {s for s, _ in search.schedule_options(4, 32, 8, named)} == {"interleaved-1f1b"}
    assert search.schedule_options(1, 32, 8, named) == [("1f1b", 1)]


def test_zero_options_and_degrees():
    assert search.zero_options(1, Constraints()) == ((0, 1, 1),)
    opts = search.zero_options(8, Constraints())
    assert (0, 8, 1) in opts and (1, 8, 1) in opts
    assert {(r, s) for z, r, s in opts if z == 3} == {(4, 2), (2, 4), (1, 8)}
    assert search.zero_options(8, Constraints(zero_stage=2, dp_shard=4)) == ((2, 2, 4),)
    problem = Problem(S405, DGX, 16384, 8192, 2048)
    assert search.tp_options(problem, Constraints()) == [1, 2, 4, 8]
    assert search.cp_options(problem, Constraints()) == [1, 2, 4, 8]
    assert all(16384 % (8 * pp) == 0 for pp in search.pp_options(problem, Constraints(), 8, 1))


def test_edge_ranks_and_rank_subsets():
    # memory.edge_ranks in O(1) names the owners stage_ranks gives the first and last stage.
    for pp, v, sched in [(4, 1, "1f1b"), (4, 3, "interleaved-1f1b"), (4, 2, "zbv"), (1, 1, "1f1b")]:
        lay = Layout(pp=pp, pp_virtual_stages=v, pp_schedule=sched)
        owners = stage_ranks(pp, v, sched)
        assert memory.edge_ranks(lay) == (owners[0], owners[-1])
    lay = Layout(tp=8, pp=16, dp_replicate=128, seq_len=8192, num_microbatches=16, sequence_parallel=True)
    full = memory.rank_memory(S405, lay)
    assert memory.rank_memory(S405, lay, ranks=(0, 15)) == [full[0], full[15]]
    assert state.state_bytes_per_param(1, 64) == pytest.approx(4 + 12 / 64)
    assert memory.rank_layers(S405, replace(lay, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)) == list(
        memory.layers_per_rank(126, 16, 2, "interleaved-1f1b"))


@pytest.mark.parametrize("argv", [
    ["--model", "llama3-405b", "--gpu", "h100", "--num-gpus", "16384", "--seq-len", "8192",
     "--global-batch-tokens", "16M"],
    ["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8"],
])
def test_plan_ranks_only_what_train_runs_and_prints_its_command(argv):
    """Every ranked layout passes gridtrain's own validation, and so does the printed command
    line for the first, parsed as `gridtrain train` parses it."""
    import contextlib
    import io
    import json
    import shlex

    from gridtrain.validate import validate
    from gridtrain.cli import main
    from gridtrain.config_load import load_config, parse_overrides

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", *argv, "--json"]) == 0
    report = json.loads(buf.getvalue())
    assert report["ranked"] and all(c["refused"] == "" for c in report["ranked"])
    words = shlex.split(report["train_command"])
    flags = words[words.index("train") + 1:]
    if words[:2] == ["gridtrain", "train"]:
        world = int(flags[flags.index("--nproc") + 1])
        flags = flags[2:]
    else:
        world = int(words[words.index("--nnodes") + 1]) * int(words[words.index("--nproc-per-node") + 1])
    dims = validate(load_config(None, parse_overrides(flags)), world=world)
    chosen = report["chosen"]["layout"]
    assert (dims.tp, dims.pp, dims.dp_shard, dims.dp_replicate) == (
        chosen["tp"], chosen["pp"], chosen["dp_shard"], chosen["dp_replicate"])
    # With --any-layout the layouts gridtrain refuses are ranked too, each with the reason: CP
    # beside ZeRO-1 (CP needs FSDP to sum its ranks' gradients) is one.
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", *argv, "--json", "--any-layout", "--layout", "cp=2,zero=1"]) == 0
    labelled = json.loads(buf.getvalue())["ranked"]
    assert labelled and all(c["refused"] for c in labelled)
    assert all(c["layout"]["cp"] == 2 and c["layout"]["zero_stage"] == 1 for c in labelled)
