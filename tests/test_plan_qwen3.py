"""The planner on Qwen3 shapes: heads wider than dim / n_heads and QK-norm (an RMSNorm over each
head of q and k before RoPE). Parameters and FLOPs against hand counts and the model built on the
meta device; the activation census against the bytes the runtime saves, tensor by tensor, in one
process; dry runs of a tiny Qwen3-like model against `plan --check` and the search's model of a
rank, bucket by bucket; and `gridtrain plan` ranking layouts for both Qwen3 presets."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

from gridtrain.model.args import model_args
from gridtrain.plan.activations import held_bytes, qk_norm_bytes_per_token
from gridtrain.plan.flops import flops_per_token
from gridtrain.plan.shape import from_args, param_counts

QWEN3_30B = from_args(model_args("qwen3-30b-a3b"))


def test_qwen3_30b_parameters_are_the_models_and_the_hand_count():
    """`gridtrain model qwen3-30b-a3b` prints the planner's total and active parameters, and both
    are the model's own built on the meta device; a block's attention is Wq and Wo of 2048 x (32 x
    128), Wk and Wv of 2048 x (4 x 128) and QK-norm's two weights of 128, not 4 x 2048^2."""
    from gridtrain.cli import main
    from gridtrain.model.stats import build_meta

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["model", "qwen3-30b-a3b"]) == 0
    printed = {line.split()[0]: int(line.split()[1].replace(",", "")) for line in out.getvalue().splitlines()
               if line.strip().startswith(("total", "active", "attention"))}
    counts = param_counts(QWEN3_30B)
    assert printed == {"total": counts.total, "active": counts.active, "attention": counts.attention}
    model = build_meta(model_args("qwen3-30b-a3b"))
    assert counts.total == sum(p.numel() for p in model.parameters()) == 30_532_122_624
    routed = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name)
    assert counts.active == counts.total - routed + routed * 8 // 128
    assert counts.attention == 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128) == 905_981_952


def test_qwen3_30b_flops_count_attention_at_heads_times_head_dim():
    """6N + 12 L H Q T at seq 4096 with H = 32 x 128 = 4096 (twice the width), N the active
    parameters less the input embedding: 27,914,883,072 FLOPs per token, what `gridtrain model`
    prints."""
    n = param_counts(QWEN3_30B).active - 151_936 * 2048
    assert flops_per_token(QWEN3_30B, 4096) == 6 * n + 12 * 48 * 4096 * 4096 == 27_914_883_072


def _saved(args, precision: str, recompute: str) -> int:
    from test_plan_moe_search import _saved as measure  # the MoE census's measurement, reused

    return measure(args, precision, recompute)


SMALL = dict(dim=64, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)
SHAPES = [  # (preset, head_dim, QK-norm)
    ("tiny", 32, True), ("tiny", 24, True), ("tiny", 32, False), ("tiny", None, True), ("tiny-moe", 32, True)]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_wide_heads_and_qk_norm_census_equals_saved_bytes(precision, recompute):
    """A block's census (activations.py) equals what the runtime saves for backward, to the byte:
    the second block's bytes (two blocks less one) of 32 tokens, heads of 32 and 24 (q 128 and 96
    against dim 64), with and without QK-norm, dense and MoE."""
    moe = dict(num_experts=4, top_k=2, expert_ffn_dim=32, z_loss_coef=0.0, balance="aux_loss")
    for preset, head_dim, qk in SHAPES:
        extra = dict(moe=moe) if preset == "tiny-moe" else {}
        two, one = (model_args(preset, n_layers=n, explicit_head_dim=head_dim, qk_norm=qk, **SMALL, **extra)
                    for n in (2, 1))
        measured = _saved(two, precision, recompute) - _saved(one, precision, recompute)
        predicted = (held_bytes(from_args(two), {0: 1}, [2], 32, precision, recompute)
                     - held_bytes(from_args(one), {0: 1}, [1], 32, precision, recompute))
        assert measured == predicted, (preset, head_dim, qk)


def test_qk_norm_bytes_by_hand():
    """Qwen3-30B's QK-norm per token and block: fp32 input and output of 32 query heads and 4 KV
    heads of 128 (8 x 4608) and an rsqrt per head (4 x 36); nothing under recomputation."""
    assert qk_norm_bytes_per_token(QWEN3_30B, "none") == 8 * 4608 + 4 * 36 == 37_008
    assert qk_norm_bytes_per_token(QWEN3_30B, "selective") == qk_norm_bytes_per_token(QWEN3_30B, "full") == 0


TINY_QWEN = ["--model.head_dim=32", "--model.qk_norm=true", "--data.seq_len=64", "--train.micro_batch=1"]
DRY_RUNS = [  # (world, rank, keys)
    (2, 1, ["--model.preset=tiny", "--train.global_batch=2", "--train.precision=bf16", "--parallel.dp_shard=2"]),
    (2, 1, ["--model.preset=tiny", "--train.global_batch=4", "--train.precision=fp32", "--parallel.pp=2",
            "--train.recompute=selective"]),
    (4, 3, ["--model.preset=tiny-moe", "--train.global_batch=4", "--train.precision=bf16", "--parallel.pp=2",
            "--parallel.dp_shard=2", "--parallel.ep=2"]),
    (2, 1, ["--model.preset=tiny", "--train.global_batch=2", "--train.precision=bf16", "--parallel.cp=2",
            "--train.recompute=selective"]),
]


@pytest.mark.parametrize("world, rank, keys", DRY_RUNS,
                         ids=["fsdp2-bf16", "pp2-fp32-selective", "pp2-fsdp2-ep2", "cp2-bf16-selective"])
def test_dry_run_of_a_tiny_qwen3_is_the_plan(tmp_path, world, rank, keys):
    """A tiny model with heads of 32 (q 128 at dim 64) and QK-norm, dry-run on one rank (the last
    CP rank keeps the most of ring attention's q-wide outputs under selective recomputation): every
    bucket and collective `plan --check` predicts is what the rank measured, to the byte; the
    search's own model of the rank (memory.rank_memory) holds the same state bytes, and without
    expert parallelism the same activations."""
    from gridtrain.plan import memory
    from gridtrain.plan.check_run import check_run
    from gridtrain.plan.run_collectives import run_layout
    from gridtrain.plan.state import StateBytes
    from gridtrain.rundir import RunRecord

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "gridtrain", "train", "--dry-run", f"--world={world}", f"--rank={rank}",
           *TINY_QWEN, *keys, f"--run_dir={run}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = check_run(run)
    assert {r.bucket for r in rows} >= {"weights", "gradients", "optimizer", "activations"}
    for row in rows:
        assert row.measured == row.predicted, (row.bucket, row.predicted, row.measured)
    record = json.loads((run / "accounting" / f"rank{rank}.jsonl").read_text().splitlines()[-1])
    run_record = RunRecord.load(run)
    cfg, dims = run_record.config, run_record.dims
    args = cfg.model.args()
    layout = run_layout(args, dims, cfg)
    act = 4 if cfg.train.precision == "fp32" else 2
    pp_rank = dims.coordinates(rank)["pp"]
    planned = memory.rank_memory(from_args(args), layout, StateBytes.gridtrain(cfg.train.precision), act,
                                 ranks=(pp_rank,))[0]
    for bucket in ("weights", "gradients", "optimizer") + (("activations",) if dims.ep == 1 else ()):
        assert getattr(planned, bucket) == record[f"memory/{bucket}_bytes"], bucket


def _plan(*argv: str) -> tuple[int, str, str]:
    from gridtrain.plan.app.command import run_plan
    from gridtrain.plan.app.options import plan_parser

    args, extra = plan_parser().parse_known_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    return run_plan(args, extra, out, err), out.getvalue(), err.getvalue()


@pytest.mark.parametrize("preset, gpus", [("qwen3-30b-a3b", 64), ("qwen3-235b-a22b", 256)])
def test_plan_ranks_layouts_for_qwen3(preset, gpus):
    """Both Qwen3 presets are planned: a ranked table and a chosen layout that fits, at tp 1, the
    only degree validate accepts beside QK-norm (the search ranks what `gridtrain train` runs)."""
    code, out, err = _plan("--model", preset, "--num-gpus", str(gpus))
    assert code == 0, err
    assert "heads of 128" in out and "QK-norm" in out and "Best layouts" in out
    chosen = out.split("chosen layout: --layout ")[1].split()[0]
    assert chosen.startswith("tp=1,"), chosen
    assert "does not fit" not in out.split("Memory of pipeline rank")[1].split("\n\n")[0]
