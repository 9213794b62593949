"""Every refusal `gridtrain plan` can give a layout, in one table: an input that triggers it, the
relation (refusals.RELATIONS) it must be classed under, and the words and numbers it must print.
The issue's three cases name their root relation: v for an interleaved or V schedule with v = 1,
dp against the batch for the lecture's DP 192 and batch 2,048, the replicas for 32 HSDP replicas."""

from __future__ import annotations

import contextlib
import io

import pytest

from gridtrain.cli import main
from gridtrain.explore import api
from gridtrain.plan.app.command import build_problem
from gridtrain.plan.app.inputs import parse_layout
from gridtrain.plan.app.refusals import RELATIONS, layout_refusal, no_layout_reason
from gridtrain.plan.search import search

B8 = ["--model", "llama3-8b", "--gpu", "h100"]
B405 = ["--model", "llama3-405b", "--gpu", "h100", "--seq-len", "8192"]

TABLE = [  # (relation, arguments after `gridtrain plan`, what the refusal must say)
    ("tp", B8 + ["--num-gpus", "8", "--layout", "tp=3"], ["tp=3 cannot split", "choose tp among [1, 2, 4, 8]"]),
    ("cp", B8 + ["--num-gpus", "8", "--layout", "cp=3"], ["cp=3", "2 x cp equal chunks", "dividing 4,096"]),
    ("pp", B8 + ["--num-gpus", "64", "--layout", "pp=64"], ["pp=64 exceeds the model's 32 layers"]),
    ("gpus", B405 + ["--num-gpus", "16384", "--layout", "tp=8,pp=16,dp=64,cp=1"],
     ["8,192 != 16,384 GPUs", "set dp to 128"]),
    ("gpus", B8 + ["--num-gpus", "12", "--layout", "tp=8"], ["tp(8) = 8 does not divide 12 GPUs"]),
    # The lecture's Llama 3 recipe on 24,576 GPUs: 2,048 is a power of two, 192 does not divide it.
    ("dp_batch", B405 + ["--num-gpus", "24576", "--global-batch", "2048", "--layout", "tp=8,pp=16,cp=1"],
     ["dp = 24,576 GPUs / (tp 8 x pp 16 x cp 1) = 192 does not divide the global batch of 2,048",
      "multiple of 192 (2,112 or 1,920)", "pp=12 (dp 256)"]),
    ("dp_batch", B8 + ["--num-gpus", "24", "--global-batch", "16", "--layout", "dp=24"], ["dp=24 does not divide"]),
    ("dp_shard", B8 + ["--num-gpus", "32", "--layout", "tp=1,pp=1,cp=1,zero=3,dp_shard=3"],
     ["dp_shard=3 must divide dp=32"]),
    ("shard_stage", B8 + ["--num-gpus", "32", "--layout", "zero=1,dp_shard=4"], ["dp_shard=4", "zero=1"]),
    # 32 HSDP replicas (the page's "dp replicas" 32 on 32 GPUs): one shard each.
    ("replicas", B8 + ["--num-gpus", "32", "--layout", "tp=1,pp=1,cp=1,zero=3,dp_shard=1"],
     ["32 replicas of 1 shard each", "ZeRO-3 nothing to shard", "4 replica(s) x 8 shards"]),
    ("shard_sizes", B8 + ["--num-gpus", "24", "--global-batch", "48", "--layout", "tp=1,pp=1,cp=1,zero=3,dp_shard=3"],
     ["dp_shard=3", "power of two or all of dp=24", "[2, 4, 8, 24]"]),
    ("zero1_runtime", B8 + ["--num-gpus", "16", "--layout", "tp=2,zero=1"], ["zero=1 with tp=2", "without tp and pp"]),
    ("zero1_moe", ["--model", "mixtral-8x7b", "--gpu", "h100", "--num-gpus", "64", "--layout", "zero=1"],
     ["zero=1 with a mixture of experts (8 experts)", "choose zero=2"]),
    ("cp_zero", B8 + ["--num-gpus", "16", "--seq-len", "8192", "--layout", "cp=2,zero=0"], ["cp=2 with zero=0"]),
    ("v_pipeline", B8 + ["--num-gpus", "8", "--layout", "pp=1,v=2"], ["v=2", "pp=1"]),
    # An interleaved or V schedule with v = 1 (the 405B / 128-GPU preset's layout): v, not dp_shard.
    ("v_schedule", B405 + ["--num-gpus", "128", "--global-batch", "64", "--layout",
                           "tp=8,pp=4,cp=1,zero=3,dp_shard=4,schedule=interleaved-1f1b,v=1"],
     ["schedule=interleaved-1f1b interleaves v >= 2", "v=1", "choose v among [2,"]),
    ("v_schedule", B405 + ["--num-gpus", "128", "--global-batch", "64", "--layout",
                           "tp=8,pp=4,cp=1,zero=3,dp_shard=4,schedule=zbv,v=1"],
     ["schedule=zbv holds exactly 2", "v=1", "set v=2"]),
    ("v_schedule", B8 + ["--num-gpus", "16", "--layout", "pp=2,schedule=1f1b,v=2"], ["schedule=1f1b runs one stage"]),
    ("v_layers", B8 + ["--num-gpus", "64", "--layout", "pp=8,v=8,schedule=interleaved-1f1b"],
     ["pp=8 x v=8 = 64 stages exceeds the model's 32 layers", "v <= 4"]),
    ("mb_batch", B8 + ["--num-gpus", "8", "--layout", "tp=1,pp=1,cp=1,mb=3"],
     ["mb=3 does not divide the 64 sequences each replica takes"]),
    ("m_schedule", B8 + ["--num-gpus", "64", "--global-batch", "32", "--layout", "tp=1,pp=8,cp=1,schedule=1f1b"],
     ["pp=8 with at most 4 micro-batch(es) per replica", "need(s) m >= 8", "at least 64"]),
    ("gpus_batch", B8 + ["--num-gpus", "16M"], ["more GPUs than this model and batch can keep busy, at most 1,048,576"]),
    ("degrees_batch", B405 + ["--num-gpus", "24576", "--global-batch", "2047", "--layout", "tp=8"],
     ["no tp x cp x pp leaves a dp that divides the global batch of 2,047", "4, 6, 8, 12", "loosen --layout"]),
    ("schedule_batch", B8 + ["--num-gpus", "64", "--global-batch", "4", "--layout", "tp=1,pp=8,schedule=1f1b"],
     ["leaves a valid micro-batch and schedule", "1F1B needs m >= pp"]),
    ("zero_variants", B8 + ["--num-gpus", "64", "--layout", "pp=1,zero=3,dp_shard=3"],
     ["dp_shard=3 with zero=3 matches no ZeRO variant", "the search shards over [2, 4"]),
    ("runtime", B8 + ["--num-gpus", "8", "--layout", "recompute=attention"], ["gridtrain train refuses"]),
    ("memory", B405 + ["--num-gpus", "8", "--global-batch", "64"], ["no layout of this model fits on 8", "try: plan for"]),
]


def relation_of(args: list[str]) -> str:
    """The relation the planner's own functions class these inputs' refusal under."""
    parsed, extra = api._parser().parse_known_args(args)
    problem, *_ = build_problem(parsed, extra)
    constraints = parse_layout(parsed.layout or "")
    found = layout_refusal(problem, constraints)
    if found:
        return found[0]
    result = search(problem, constraints, top=1)
    assert not result.ranked, "these inputs have a plan"
    if result.leanest is None:
        return no_layout_reason(problem, constraints, "")[0]
    return "runtime" if result.refused else "memory"


@pytest.mark.parametrize("relation, args, says", TABLE, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(TABLE)])
def test_each_refusal_names_its_relation(relation, args, says):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *args])
    text = " ".join(err.getvalue().split())
    assert code == 2 and out.getvalue() == "" and "Traceback" not in text
    for words in says:
        assert words in text, (words, text)
    assert relation_of(args) == relation


def test_the_table_covers_every_relation():
    assert {relation for relation, _, _ in TABLE} == set(RELATIONS)
