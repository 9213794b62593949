"""Inconsistent layouts are refused before any process starts: `gridtrain train --nproc N ...`
returns 2 with the relation, the numbers and a fix, and never reaches torchrun."""

from __future__ import annotations

import re

import pytest

from gridtrain import cli
from gridtrain.validate import parallel_dims, validate
from gridtrain.config import ConfigError
from gridtrain.config_load import load_config
from gridtrain.layout.dims import stage_layer_counts
from gridtrain.layout.schedules import stage_ranks

# (name, nproc, overrides, text that must appear in the message)
BAD_LAYOUTS = [
    ("tp-kv-heads", 4, {"parallel.tp": 4}, "parallel.tp (4) must divide model.n_kv_heads (2)"),
    ("pp-over-layers", 4, {"parallel.pp": 4, "train.global_batch": 8, "train.micro_batch": 2},
     "model.n_layers (2) is too few for parallel.pp (4)"),
    ("world-product", 4, {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp_shard": 2},
     "= 8 != world size 4"),
    ("few-microbatches", 2, {"parallel.pp": 2, "train.global_batch": 4, "train.micro_batch": 4},
     "too few micro-batches for parallel.pp_schedule '1f1b'"),
    ("batch-vs-dp", 4, {"train.global_batch": 6, "train.micro_batch": 1},
     "train.global_batch (6 sequences) must be divisible by train.micro_batch (1) x data-parallel degree (4)"),
    ("zero0-sharded", 2, {"parallel.zero_stage": 0, "parallel.dp_shard": 2}, "parallel.dp_shard = 2"),
    ("interleaved-rounds", 2, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                               "parallel.pp_virtual_stages": 2, "train.global_batch": 10, "train.micro_batch": 2},
     "runs micro-batches in 2 rounds, which must divide the micro-batches per step (5)"),
    ("zbv-one-stage", 2, {"parallel.pp": 2, "parallel.pp_schedule": "zbv"}, "needs exactly 2 stages per rank"),
    ("cp-seq", 2, {"parallel.cp": 2, "parallel.dp_shard": 1, "data.seq_len": 30},
     "2 x cp = 4 equal chunks, which data.seq_len (30) does not divide: set data.seq_len to 28"),
    ("cp-ddp", 4, {"parallel.cp": 2, "parallel.zero_stage": 0, "parallel.dp_replicate": 2, "parallel.dp_shard": 1},
     "parallel.zero_stage 0 does not: set parallel.zero_stage to 2 or 3"),
    ("cp-zero1", 2, {"parallel.cp": 2, "parallel.zero_stage": 1, "parallel.dp_shard": 1},
     "parallel.zero_stage 1 does not: set parallel.zero_stage to 2 or 3"),
    ("sp-without-tp", 2, {"parallel.sequence_parallel": True}, "parallel.sequence_parallel needs parallel.tp > 1"),
    ("tied-pp", 2, {"parallel.pp": 2, "model.tie_embeddings": True}, "model.tie_embeddings cannot be used"),
    ("zero1-tp", 2, {"parallel.zero_stage": 1, "parallel.tp": 2, "parallel.dp_replicate": 1},
     "parallel.zero_stage 1"),
    ("dp-shard-fill", 3, {"parallel.tp": 2}, "parallel.dp_shard = -1 cannot fill world size 3"),
]


@pytest.mark.parametrize("name,nproc,overrides,expected", BAD_LAYOUTS, ids=[b[0] for b in BAD_LAYOUTS])
def test_bad_layout_refused_before_launch(monkeypatch, capsys, tmp_path, name, nproc, overrides, expected):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started for an invalid layout")

    monkeypatch.setattr(cli, "launch", no_launch)
    argv = ["train", "--nproc", str(nproc), "--model.preset", "tiny", "--run_dir", str(tmp_path / "run")]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert not (tmp_path / "run").exists()


def test_world_size_message_suggests_a_fix():
    cfg = load_config(None, {"model.preset": "tiny", "parallel.tp": 4, "parallel.dp_shard": 2,
                             "parallel.nproc": 8, "model.n_kv_heads": 4})
    with pytest.raises(ConfigError) as info:
        validate(cfg, world=4)
    assert "dp_replicate(1) * dp_shard(2) * cp(1) * tp(4) * pp(1) = 8 != world size 4" in str(info.value)
    assert "set parallel.tp to 2" in str(info.value)


def test_dp_shard_fills_the_world_and_zero0_fills_replicas():
    cfg = load_config(None, {"parallel.tp": 2})
    assert parallel_dims(cfg, 8).dp_shard == 4
    cfg = load_config(None, {"parallel.zero_stage": 0})
    dims = parallel_dims(cfg, 4)
    assert (dims.dp_replicate, dims.dp_shard) == (4, 1)


def test_stage_layer_counts_llama3_405b_edges():
    # 126 layers over 16 stages, one fewer on the first and last (they hold embedding and head).
    counts = stage_layer_counts(126, 16, 1)
    assert sum(counts) == 126 and counts[0] == counts[-1] == 7 and set(counts[1:-1]) == {8}
    assert stage_layer_counts(80, 4) == [20, 20, 20, 20]  # Llama 3 70B: 80 layers, PP=4
    assert stage_layer_counts(10, 4) == [2, 3, 3, 2]


def test_stage_ranks_loop_and_v():
    assert stage_ranks(2, 2, "interleaved-1f1b") == [0, 1, 0, 1]
    assert stage_ranks(2, 2, "zbv") == [0, 1, 1, 0]


def test_coordinates_follow_the_rank_grid():
    dims = parallel_dims(load_config(None, {"parallel.pp": 2, "parallel.tp": 2}), 8)
    # arange(8).view(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert dims.coordinates(5) == {"tp": 1, "cp": 0, "dp_shard": 0, "dp_replicate": 0, "pp": 1, "dp": 0}
    assert dims.coordinates(3)["dp"] == 1 and dims.coordinates(3)["pp"] == 0


def test_units_table_llama3_70b_example():
    """Worked example (an illustrative layout): Llama 3 70B on 16,384 GPUs with TP=8, PP=4, DP=512,
    micro-batch 4 x 8,192 tokens, accumulation 4: 67,108,864 tokens per step."""
    from gridtrain.train.units import units_table

    cfg = load_config(None, {"model.preset": "llama3-70b", "data.seq_len": 8192, "parallel.tp": 8,
                             "parallel.pp": 4, "train.micro_batch": 4, "train.global_batch": 4 * 4 * 512,
                             "train.steps": 10})
    dims = parallel_dims(cfg, 16384)
    assert dims.dp == 512 and dims.model_parallel == 32
    table = units_table(cfg, dims, num_nodes=16384 // 8)
    rows = {row[0]: row[1:3] for row in (re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[3:13])}
    assert rows == {"GPU": ["16,384", "1 process"], "Node": ["2,048", "8 GPUs"],
                    "Tensor-parallel group": ["2,048", "8 GPUs (TP=8)"],
                    "Pipeline stage": ["2,048", "8 GPUs (TP x CP=1)"],  # a stage's TP group, per replica
                    "Model-parallel group": ["512", "32 GPUs (TP x CP x PP=4)"],
                    "Data-parallel replica": ["512", "32 GPUs"],
                    "Micro-batch": ["512 per fwd/bwd", "4 x 8,192 = 32,768 tokens"],
                    "Gradient accumulation": ["4 steps", "micro-batches before sync"],
                    "Global batch": ["1 per optimizer step", "67,108,864 tokens"],
                    "Optimizer step": ["10 total", "one weight update"]}
    assert "stage 3 (pp rank 3): layers 60-79" in table  # 80 layers, 20 per stage
