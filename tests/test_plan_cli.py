"""`gridtrain plan` through gridtrain.cli.main: the plan for Llama 3 405B on 16,384 H100s, --layout,
--json, --explain, GPT blocks, and inputs that make no sense (exit 2, the reason and a fix on
stderr, never a traceback)."""

from __future__ import annotations

import json

import pytest

from gridtrain.cli import main
from gridtrain.plan.app.inputs import batch_sequences, parse_count, parse_layout
from gridtrain.plan.search import Constraints, PlanError

EXAMPLE = ["plan", "--model", "llama3-405b", "--gpu", "h100", "--num-gpus", "16384", "--seq-len", "8192",
           "--global-batch-tokens", "16M", "--tokens", "15.6T"]


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_example_plan(capsys):
    rc, out, err = run(capsys, EXAMPLE)
    assert rc == 0, err
    for part in ("Units of one step", "Tensor-parallel group", "Data-parallel replica", "Best layouts",
                 "Memory of pipeline rank", "activations", "Step time", "pipeline bubble", "MFU",
                 "days at the predicted throughput", "GPU-hours", "GWh", "checkpoint every", "Daly"):
        assert part in out, part
    assert "16,777,216 tokens" in out  # 16M read as 2^20 x 16 = 2,048 sequences of 8,192
    assert "reading M as binary" in out
    ranked = [line for line in out.splitlines() if line[:2].strip().isdigit() and "%" in line]
    assert len(ranked) == 10


def test_json_has_everything(capsys):
    rc, out, _ = run(capsys, EXAMPLE + ["--json", "--top", "3"])
    assert rc == 0
    plan = json.loads(out)
    assert {"problem", "units", "ranked", "chosen", "memory", "budget", "checkpoint", "explain"} <= set(plan)
    chosen = plan["chosen"]["layout"]
    assert chosen["tp"] * chosen["cp"] * chosen["pp"] * chosen["dp"] == 16384
    assert len(plan["ranked"]) == 3 and plan["memory"]["fits"]
    assert plan["units"]["num_nodes"] == 2048
    assert plan["budget"]["pf_days_6nd"] == pytest.approx(6 * plan["problem"]["params"] * 15.6e12 / 8.64e19)
    assert plan["checkpoint"]["daly_s"] < plan["checkpoint"]["young_s"]


def test_explain_shows_formulas(capsys):
    rc, out, _ = run(capsys, EXAMPLE + ["--explain", "--top", "1"])
    assert rc == 0
    for formula in ("6N + 12 L H Q T", "GPUs = tp x cp x pp x dp", "tokens/s = global batch tokens / step",
                    "MFU = tokens/s x model FLOPs/token", "sqrt(2 C M)", "days = tokens / tokens/s"):
        assert formula in out, formula


def test_fixed_layout_fills_the_rest(capsys):
    rc, out, _ = run(capsys, EXAMPLE + ["--layout", "tp=8,pp=16,dp=128", "--top", "2"])
    assert rc == 0
    assert "--layout tp=8,pp=16,dp=128: fits" in out
    assert "chosen layout: --layout tp=8,cp=1,pp=16,dp=128," in out


def test_gpt_blocks(capsys):
    # Megatron's 1T GPT on 3,072 A100s: GELU blocks, ffn = 4h, learned positions.
    rc, out, err = run(capsys, ["plan", "--arch", "gpt", "--model.dim", "25600", "--model.n_layers", "128",
                                "--model.n_heads", "160", "--model.vocab_size", "51200",
                                "--model.max_seq_len", "2048", "--gpu", "a100", "--num-gpus", "3072",
                                "--global-batch", "3072", "--layout", "tp=8,pp=64", "--top", "1", "--json"])
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["problem"]["shape"]["block"] == "gpt" and plan["problem"]["shape"]["ffn"] == 4 * 25600
    assert plan["problem"]["params"] == pytest.approx(1008e9, rel=1e-3)
    assert plan["problem"]["cluster"] == "selene-a100"


@pytest.mark.parametrize("argv, says", [
    (["--gpu", "h900"], ["unknown accelerator 'h900'", "did you mean"]),
    (["--layout", "tp=8,pp=16,dp=64,cp=1"], ["8,192 != 16,384 GPUs", "set dp to 128"]),
    (["--layout", "tp=3"], ["choose tp among [1, 2, 4, 8]"]),
    (["--layout", "tpp=8"], ["did you mean 'tp'"]),
    (["--num-gpus", "64", "--global-batch-tokens", "4M"], ["no layout of this model fits on 64", "try: plan for"]),
    (["--layout", "tp=8,pp=16,cp=1,recompute=none"], ["no layout with", "try: recompute none -> "]),
    (["--num-gpus", "lots"], ["is not a count"]),
    (["--model.dimm", "1024"], ["did you mean 'model.dim'"]),
])
def test_nonsense_gets_an_explanation(capsys, argv, says):
    base = ["plan", "--model", "llama3-405b", "--num-gpus", "16384", "--global-batch-tokens", "16M"]
    rc, out, err = run(capsys, base + argv)
    assert rc == 2 and out == ""
    assert "Traceback" not in err
    for text in says:
        assert text in err, (text, err)


def test_unknown_preset(capsys):
    rc, _, err = run(capsys, ["plan", "--model", "llama3-4O5b"])
    assert rc == 2 and "did you mean llama3-405b" in err


def test_counts_and_layout_parsing():
    assert parse_count("15.6T", "x") == pytest.approx(15.6e12)
    assert parse_count("16K", "x") == 16_000 and parse_count("16_384", "x") == 16384
    assert parse_count("2B", "x") == 2e9 and parse_count("3m", "x") == 3e6
    with pytest.raises(PlanError):
        parse_count("-4", "x")
    assert batch_sequences("4194304", 8192) == (512, None)
    seqs, note = batch_sequences("16M", 8192)
    assert seqs == 2048 and "binary" in note
    with pytest.raises(PlanError, match="whole number"):
        batch_sequences("1000", 8192)
    assert parse_layout("tp=8, pp=16,zero=1,mb=2,recompute=full,schedule=zbv,v=2") == Constraints(
        tp=8, pp=16, zero_stage=1, micro_batch=2, recompute="full", pp_schedule="zbv", pp_virtual_stages=2)
    with pytest.raises(PlanError, match="choose one of"):
        parse_layout("recompute=some")
