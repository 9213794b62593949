"""Attention's FLOPs under document masking (data.doc_mask) against hand-derived numbers: the
planner's span (plan/documents.py), a prepared corpus's span measured as training cuts it
(data/doc_span.py) against the model's own document rule, the step time, `plan --doc-len`, the
runtime's MFU numerator and `plan --check`'s refusal where the documents are unknown."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from gridtrain.data.doc_span import prepared_span, run_attention_span, window_span
from gridtrain.model.args import llama3_8b
from gridtrain.plan import flops, shape, steptime
from gridtrain.plan.documents import equal_documents_span, span_of_documents
from gridtrain.plan.specs import cluster

LLAMA3_8B = shape.from_args(llama3_8b())
ATTENTION_8K = 12 * 32 * 32 * 128 * 8192
"""llama3-8b's attention term at T = 8,192: 12 L H Q T = 12 x 32 layers x 32 heads x 128 x 8,192
= 384 x 4,096 x 8,192 = 12,884,901,888 FLOPs per token."""


def test_four_documents_of_2048_in_8192_cost_a_quarter():
    # Per sequence, counted in full (no causal halving): causal 8,192^2 = 67,108,864 query-key
    # pairs; masked 4 x 2,048^2 = 4 x 4,194,304 = 16,777,216 = 67,108,864 / 4. Per token the span is
    # 16,777,216 / 8,192 = 2,048 keys. (Halved conventions halve both: still 1/4.)
    assert span_of_documents([2048] * 4) == 2048
    assert equal_documents_span(8192, 2048) == 2048
    causal = flops.flops_per_token(LLAMA3_8B, 8192)
    masked = flops.flops_per_token(LLAMA3_8B, 8192, span=2048)
    assert ATTENTION_8K == 12_884_901_888
    assert causal - masked == ATTENTION_8K - ATTENTION_8K // 4 == 9_663_676_416
    # HFU's recomputed attention forward (4 L H Q T) shrinks by the same quarter.
    attn_fwd = 4 * 32 * 32 * 128 * 8192
    assert (flops.hardware_flops_per_token(LLAMA3_8B, 8192, "full")
            - flops.hardware_flops_per_token(LLAMA3_8B, 8192, "full", span=2048)) == 3 * (ATTENTION_8K + attn_fwd) // 4


def test_equal_documents_cut_at_the_sequence_end():
    # 8,192 = 2 x 3,000 + 2,192: (2 x 3,000^2 + 2,192^2) / 8,192 = (18,000,000 + 4,804,864) / 8,192
    # = 22,804,864 / 8,192 = 2,783.796875.
    assert equal_documents_span(8192, 3000) == 2783.796875
    assert equal_documents_span(8192, 8192) == equal_documents_span(8192, 100_000) == 8192
    assert span_of_documents([3, 5]) == (9 + 25) / 8
    with pytest.raises(ValueError):
        span_of_documents([4, 0])


def test_a_span_as_one_document_length():
    # 415.2 keys of 1,024 as one document length: L = 415 gives (2 x 415^2 + 194^2) / 1,024 =
    # 382,086 / 1,024 = 373.1 (the cut third document lowers it); L = 453: (2 x 453^2 + 118^2) / 1,024
    # = 424,342 / 1,024 = 414.4; L = 454: (2 x 454^2 + 116^2) / 1,024 = 425,688 / 1,024 = 415.7, the first.
    from gridtrain.plan.documents import doc_len_for_span

    assert equal_documents_span(1024, 415) == 382_086 / 1024
    assert equal_documents_span(1024, 454) == 425_688 / 1024
    assert doc_len_for_span(1024, 415.2) == 454
    assert all(equal_documents_span(1024, n) < 415.2 for n in range(1, 454))
    assert doc_len_for_span(8192, 2048.0) == 2048 and doc_len_for_span(1024, 1024.0) == 1024


def test_window_span_by_hand():
    # Documents start at 0, 3, 10 in a stream of 17 tokens, T = 8: windows (17 - 1) // 8 = 2,
    # [0, 8) cut at 3 -> 3 + 5, [8, 16) cut at 10 -> 2 + 6; (9 + 25 + 4 + 36) / 16 = 74 / 16.
    assert window_span(np.array([0, 3, 10]), 17, 8) == 74 / 16
    assert window_span(np.array([0]), 17, 8) == 8.0  # one document: the causal span


def _byte_corpus(root, lengths):
    root.mkdir(parents=True)
    with open(root / "docs.jsonl", "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"text": chr(97 + i % 26) * n}) + "\n")
    return root


def test_prepared_span_equals_the_models_documents(tmp_path):
    """The span of a prepared corpus equals, window by window, the squares of the documents that
    the model's own rule (document_ids: a document ends at its end-of-document token) finds in
    each training sample."""
    from gridtrain.data.sampler import num_windows
    from gridtrain.data.shards import TokenStore, prepare
    from gridtrain.data.tokenizer import ByteTokenizer
    from gridtrain.model.documents import document_ids

    rng = np.random.default_rng(0)
    root = _byte_corpus(tmp_path / "c", rng.integers(1, 90, size=300).tolist())
    out = prepare(root, ByteTokenizer(), tmp_path / "p", val_fraction=0.05, shard_tokens=997)
    store, seq = TokenStore(out, "train"), 64
    count = num_windows(store, seq)
    inputs = torch.from_numpy(np.stack([store.read(i * seq, seq).astype(np.int64) for i in range(count)]))
    ids = document_ids(inputs, store.eos_id)
    squares = sum(int((torch.bincount(row) ** 2).sum()) for row in ids)
    assert prepared_span(out, seq) == pytest.approx(squares / (count * seq), rel=1e-12)
    assert prepared_span(out, seq) < seq
    from gridtrain.data.stats import span_lines

    line, = span_lines(out)  # what `gridtrain data stats` prints of it
    assert f"1,024: {prepared_span(out, 1024):,.1f} ({prepared_span(out, 1024) / 1024:.3f} of causal)" in line


def test_a_mixture_weighs_its_sources_spans():
    # Three samples of the first source for one of the second, T tokens each: (3 x 100 + 400) / 4.
    from gridtrain.data.doc_span import mixture_span

    assert mixture_span([100.0, 400.0], [3.0, 1.0]) == 175.0


def test_layer_cost_counts_the_span():
    """The attention core's seconds shrink by 3 x 4 h (T - span) FLOPs a token (forward and
    backward, no recomputation) at the attention's share of the peak; nothing else changes."""
    node, eff, s = cluster("dgx-h100"), steptime.CALIBRATED, LLAMA3_8B
    whole = steptime.layer_cost(s, node, eff, 8192, 1, 1, 1, False, "none", True)
    docs = steptime.layer_cost(s, node, eff, 8192, 1, 1, 1, False, "none", True, span=2048.0)
    saved = 3 * 4 * s.hidden * (8192 - 2048) * 8192 / (node.accelerator.peak_flops * eff.attention_share)
    assert whole.matmul_s - docs.matmul_s == pytest.approx(saved, rel=1e-12)
    assert (whole.memory_bound_s, whole.tp_s) == (docs.memory_bound_s, docs.tp_s)


def _plan(argv):
    from gridtrain.cli import build_parser
    from gridtrain.plan.app.command import run_plan

    args, extra = build_parser().parse_known_args(["plan", *argv])
    out, err = io.StringIO(), io.StringIO()
    return run_plan(args, extra, out, err), out.getvalue(), err.getvalue()


def test_plan_doc_len_changes_flops_and_mfu():
    fixed = ["--model", "llama3-8b", "--num-gpus", "8", "--seq-len", "8192", "--global-batch", "64",
             "--layout", "tp=1,cp=1,pp=1,dp=8,zero=3,mb=1,recompute=full", "--json"]
    rc, out, _ = _plan(fixed)
    rc2, out2, _ = _plan([*fixed, "--doc-len", "2048"])
    assert rc == rc2 == 0
    whole, docs = json.loads(out), json.loads(out2)
    assert whole["chosen"]["model_flops_per_token"] - docs["chosen"]["model_flops_per_token"] == 9_663_676_416
    assert docs["chosen"]["step_s"] < whole["chosen"]["step_s"]
    assert docs["problem"]["attention_span"] == 2048
    assert "--data.doc_mask true" in docs["train_command"]
    assert any("0.250 x the causal" in n for n in docs["notes"])


def test_plan_doc_len_ranks_only_what_train_runs_with_the_mask():
    """validate refuses data.doc_mask beside a mixture of experts in fp16 on several ranks, so a plan
    with --doc-len never prints that command: it was appended after the runnability check."""
    rc, out, err = _plan(["--model", "tiny-moe", "--num-gpus", "4", "--precision", "fp16", "--seq-len", "256",
                          "--doc-len", "64"])
    assert rc != 0 and out == "" and "data.doc_mask beside" in err
    rc, out, _ = _plan(["--model", "tiny-moe", "--num-gpus", "4", "--seq-len", "256", "--doc-len", "64", "--json"])
    assert rc == 0 and "--data.doc_mask true" in json.loads(out)["train_command"]


@pytest.mark.parametrize("value, says", [("0", "--doc-len = '0' must be a positive"),
                                         ("2k5", "--doc-len = '2k5' is not a count")])
def test_plan_doc_len_refusals(value, says):
    rc, out, err = _plan(["--model", "llama3-8b", "--num-gpus", "8", "--doc-len", value])
    assert rc == 2 and out == "" and says in err and err.count("\n") == 1


def test_plan_doc_len_of_a_folder_that_is_not_prepared(tmp_path):
    rc, _, err = _plan(["--model", "llama3-8b", "--num-gpus", "8", "--doc-len", str(tmp_path)])
    assert rc == 2 and "is not a prepared data directory" in err and err.count("\n") == 1


def test_the_explorer_asks_and_answers_with_a_document_length(tmp_path):
    """The page's document length becomes --doc-len (a number only: a request names no folder), and
    a doc_mask run opens the explorer with its measured span's whole tokens."""
    from gridtrain.config_load import load_config
    from gridtrain.data.shards import prepare
    from gridtrain.data.tokenizer import ByteTokenizer
    from gridtrain.explore.api import BadRequest, plan_args
    from gridtrain.explore.runs import doc_len_state

    args = plan_args({"model": "llama3-8b", "num_gpus": 8, "doc_len": 2048})
    assert args[args.index("--doc-len") + 1] == "2048"
    with pytest.raises(BadRequest, match="doc_len: expected a number"):
        plan_args({"model": "llama3-8b", "num_gpus": 8, "doc_len": "/etc"})
    out = prepare(_byte_corpus(tmp_path / "c", [40, 7, 90, 3] * 60), ByteTokenizer(), tmp_path / "p", val_fraction=0.05)
    keys = {"model.preset": "tiny", "data.corpus": str(out), "data.seq_len": "64"}
    assert doc_len_state(load_config(None, keys)) == {}
    span = prepared_span(out, 64)
    length = doc_len_state(load_config(None, keys | {"data.doc_mask": "true"}))["doc_len"]
    assert equal_documents_span(64, length) >= span > equal_documents_span(64, length - 1)
    gone = load_config(None, keys | {"data.doc_mask": "true", "data.corpus": str(tmp_path / "c")})
    assert doc_len_state(gone) == {}  # not prepared in its cache: nothing to measure
