"""Starting a layout without any rank holding the whole model: the model is built on the meta
device, split and sharded, and each rank allocates and initialises only its shards
(gridtrain/parallel/materialize.py). Measured on every rank with a dispatch mode (LiveBytes), and
the gathered initial weights compared with one process's bit for bit.

The model is the tiny one with 8 layers and a wide MLP (ffn 256), so one transformer block
(246 KB) is larger than the working set of initialising any single parameter (2.5 x the 82 KB
head), and with 8-token sequences the activations are small beside the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridtrain.model.args import model_args
from gridtrain.model.stats import build_meta
from gridtrain.parity.compare import deviation, problems, tolerance
from gridtrain.parity.matrix import base_overrides as parity_base
from gridtrain.parity.run import MEASURE, load_result, run_reference

pytestmark = pytest.mark.dist

WORLD = 4
LAYOUTS = {
    "fsdp4": {},
    "tp2_fsdp2": {"parallel.tp": 2},
    "pp2_interleaved_fsdp2": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                              "parallel.pp_virtual_stages": 2},
    "ddp4": {"parallel.zero_stage": 0},
}
SHARDED = ("fsdp4", "tp2_fsdp2", "pp2_interleaved_fsdp2")
MODEL = {"model.n_layers": 8, "model.ffn_dim": 256}


def overrides(tmp: Path, corpus: Path) -> dict[str, object]:
    return {**parity_base(), **MODEL, "data.seq_len": 8, "train.global_batch": 4, "train.micro_batch": 1,
            "train.steps": 2, "train.precision": "fp32", "model.tie_embeddings": False, "parallel.dp_shard": -1,
            "data.corpus": str(corpus), "data.cache_dir": str(tmp / "cache")}


def launch_cases(work: Path, corpus: Path) -> dict[int, dict[str, dict[str, object]]]:
    """The layouts, in the launch of 4 processes that the test modules share (tests/launches.py)."""
    base = overrides(work, corpus)
    return {WORLD: {name: {**base, **layout, MEASURE: True} for name, layout in LAYOUTS.items()}}


@pytest.fixture(scope="module")
def launched(launches) -> tuple[Path, dict[str, object]]:  # noqa: ANN001 - tests/launches.py
    return launches.out(__name__, WORLD), overrides(launches.work / __name__, launches.corpus)


def measured(out: Path, name: str) -> list[dict[str, int]]:
    return [json.loads((out / f"{name}.rank{rank}.bytes.json").read_text()) for rank in range(WORLD)]


def full_bytes() -> tuple[int, int]:
    """(bytes of the whole model's fp32 parameters, of its largest layer)."""
    args = model_args("tiny", n_layers=MODEL["model.n_layers"], ffn_dim=MODEL["model.ffn_dim"],
                      n_heads=8, n_kv_heads=4)
    model = build_meta(args)
    block = sum(p.numel() for p in model.layers["0"].parameters())
    head = args.vocab_size * args.dim
    return 4 * sum(p.numel() for p in model.parameters()), 4 * max(block, head)


def test_initial_weights_gathered_are_one_process_bit_for_bit(launched, tmp_path):
    """DDP 4, FSDP 4, TP 2 x FSDP 2 and PP 2 interleaved x FSDP 2: every gathered initial weight is
    one process's bit for bit, and two steps train as one process does."""
    out, base = launched
    ref = run_reference({k: v for k, v in base.items() if not k.startswith("parallel.")} | {"run_dir": str(tmp_path)})
    tol = tolerance("fp32", 4 * 8, ref.lrs, 0.9, 0.95)
    for name in LAYOUTS:
        dev = deviation(load_result(out, name), ref)
        assert not dev.init_differs and not dev.unmatched, (name, dev.init_differs, dev.unmatched)
        assert not problems(dev, tol), (name, problems(dev, tol))


@pytest.mark.parametrize("name", SHARDED)
def test_no_rank_holds_more_than_its_shards_and_a_layer(launched, name):
    """Measured on every rank: while the Trainer is built, the tensor bytes alive never exceed the
    rank's parameter shards plus one layer (the largest of a block and the head: a parameter's
    full value drawn, at most 2.5 times its bytes); during the first step, never more than its
    state (parameters, gradients and Adam's two moments) plus two layers (FSDP's gathered block
    and the one it prefetches, or a pipeline stage's activations in flight). Each is well below
    the whole model."""
    out, _ = launched
    model, layer = full_bytes()
    rope = 8 * 1024  # the RoPE table: 256 positions x 4 frequencies x complex64
    for rank, got in enumerate(measured(out, name)):
        assert got["build_peak"] <= got["params"] + layer + rope, (name, rank, got, layer)
        state = 2 * got["params"] + got["optimizer"]  # gradients: the parameters' shards, freed after the step
        assert got["step_peak"] <= state + 2 * layer, (name, rank, got, layer)
        assert got["params"] < model / 3 and got["build_peak"] < model / 2


def test_the_measurement_sees_a_whole_model(launched):
    """The same measurement on DDP, which holds the whole model on every rank, finds it: the
    bounds above can fail."""
    out, _ = launched
    model, layer = full_bytes()
    for got in measured(out, "ddp4"):
        assert got["params"] == model
        assert got["build_peak"] >= model
        assert got["step_peak"] >= 3 * model  # parameters, gradients, Adam's moments
