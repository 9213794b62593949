"""The calculation cards (gridtrain.plan.lessons): every card's answers at its worked problem's
inputs against values derived by hand, the corrections where a commonly quoted answer is wrong,
and the API's refusals. tests/test_explore_page.py checks the same answers as the page shows them."""

from __future__ import annotations

import math

import pytest

from gridtrain.explore import cards
from gridtrain.plan.lessons import CARDS as LESSONS

# Each card at its worked problem's inputs, against answers derived by hand (GB = 1e9 bytes).
CARDS = {
    "ring": {"bytes each GPU sends": 2 * 2 * 7 / 8, "steps": 14, "time": 70 + 0.07},
    "tree": {"ring": 70.07, "tree": 6 * (2 / 50 * 1e3 + 5e-3), "tree steps": 6},
    "zero-memory": {"no ZeRO": 7 * 16, "ZeRO-1": 7 * (4 + 12 / 64), "ZeRO-2": 7 * (2 + 14 / 64), "ZeRO-3": 7 * 16 / 64},
    "zero3-traffic": {"ZeRO-3 bytes per GPU": 3 * 14 * 63 / 64, "ZeRO-3 time": 3 * 14 * 63 / 64 / 100 * 1e3,
                      "ZeRO-1/2 bytes per GPU": 2 * 14 * 63 / 64, "ZeRO-3 / ZeRO-1/2": 1.5},
    "accumulation": {"accumulation steps": 64, "step time": 64 * 120 + 50, "throughput": 2048 / 7.730,
                     "communication share": 50 / 7730 * 100, "share if reduced every micro-batch": 3200 / 10880 * 100},
    "lr": {"linear scaling": 2.4e-3, "square-root scaling": 3e-4 * math.sqrt(8), "warmup steps": 8000, "warmup share": 8},
    "comm-compute": {"all-reduce time": 2 * 20 * 63 / 64 / 600 * 1e3, "compute time": 300,
                     "communication / compute": 65.625 / 300},
    "overlap": {"exposed": 1.5, "hidden": 97.5, "overhead on the backward": 0.75},
    "hierarchical": {"across nodes": 2 * 20 * 7 / 8 / 100 * 1e3, "inside the nodes": 2 * 20 / 600 * 1e3,
                     "MFU with it exposed": 50 * 242 / (242 + 350)},
    "bubble": {"bubble / ideal time": 25, "bubble / step": 20, "1F1B: first stage holds": 8,
               "GPipe: first stage holds": 24},
    "interleaved-sends": {"boundaries": 15, "bytes per step": 180, "time at bw": 300},
    "tp": {"column shard rows": 8192, "column shard columns": 1024, "bytes per all-reduce per GPU": 112,
           "forward: 2 per layer": 17.5, "one all-reduce at bw": 2 * 7 / 8 * 64 * 2**20 / 600e9 * 1e3},
    # 16,384 x 4Mi tokens x 2 bytes = 128 GiB; x 4 x 126 = 64,512 GiB = 69.27 TB; / 900 GB/s = 76.97 s; one GPU:
    # 8 layers x 4 x 2 x 7/8 x 16,384 x 4Mi / 192 x 2 bytes = 40.1 GB, / 450 GB/s = 89 ms.
    "tp-step": {"one all-reduce's payload": 128, "whole step, one TP group": 64512,
                "whole step in TB": 64512 * 2**30 / 1e12, "at bw": 64512 * 2**30 / 900e9,
                "per GPU per step": 8 * 4 * 2 * 7 / 8 * 16384 * 4 * 2**20 / 192 * 2 / 1e9,
                "per GPU at its link": 8 * 4 * 2 * 7 / 8 * 16384 * 4 * 2**20 / 192 * 2 / 450e9 * 1e3},
    # 989e12 / 3352e9 = 295.05; decode at batch 1 in 2-byte weights: 2 FLOPs per 2 bytes = 1, 3.352 TFLOP/s,
    # 0.339% of peak, 16 GB / 3352 GB/s = 4.77 ms a token; 4096 x 4096 / (2 x 4096 + 4096) = 1365.3, past the ridge.
    "roofline": {"ridge point": 989e12 / 3352e9, "decode intensity": 1, "decode reaches": 3.352,
                 "decode share of peak": 3.352 / 989 * 100, "decode time per token": 16e9 / 3352e9 * 1e3,
                 "training matmul intensity": 4096 / 3, "training matmul reaches": 989},
    "gqa": {"query heads per rank": 8, "KV heads per rank": 1, "copies of each KV head": 1},
    "checkpoint": {"size": 980, "one writer": 98, "parallel writers": 98 / 64},
    "young": {"Young interval": math.sqrt(2 * 98 * 86400) / 60, "steps between checkpoints": math.sqrt(2 * 98 * 86400) / 10,
              "lost per crash": math.sqrt(2 * 98 * 86400) / 120, "checkpoint overhead": 98 / math.sqrt(2 * 98 * 86400) * 100,
              "waste (overhead + lost work)": math.sqrt(2 * 98 / 86400) * 100,
              "cost of a crash": 512 * 2 * (math.sqrt(2 * 98 * 86400) / 2 + 98) / 3600, "crashes in the run": 30},
    "fp16": {"smallest normal": 2.0**-14, "smallest subnormal": 2.0**-24, "largest": 65504, "loss scale after": 16384},
}


def test_every_card_gives_the_worked_answers():
    shown = {c["id"]: {a["label"]: a["value"] for a in c["answers"]} for c in cards.card_list()}
    assert sorted(shown) == sorted(CARDS)  # no card left untested
    for card, expected in CARDS.items():
        assert {k: shown[card][k] for k in expected} == pytest.approx(expected, rel=1e-9), card


def test_every_card_states_its_formula_source_and_an_explorer_state_or_none():
    for c in LESSONS:
        assert c.formula and c.source and c.inputs
        assert bool(c.correction) <= bool(c.quoted)  # a correction corrects a quoted answer
        if c.explore:
            assert {"model", "num_gpus"} <= set(c.explore)


@pytest.mark.parametrize("body, status", [
    ({"N": "8"}, 400), ({"N": 2.5}, 400), ({"N": -1}, 400), ({"N": float("nan")}, 400), ({"X": 1}, 400),
    ({"N": 2_000_000}, 400), ([], 400), ({"N": 1}, 200), ({"lat": 0}, 200),
])
def test_a_card_refuses_inputs_it_cannot_answer(body, status):
    assert cards.answer("ring", body)[0] == status


def test_cards_refuse_what_their_formula_cannot_answer():
    assert cards.answer("tree", {"N": 1})[0] == 200  # no ring, no ratio: not a division by zero
    assert cards.answer("young", {"C": 1e6, "mtbf_h": 0.001})[0] == 422
    assert cards.answer("gqa", {"heads": 8, "kv": 64})[0] == 422
    interleaved = {a["label"]: a["value"] for a in cards.answer("interleaved-sends", {"pp": 1})[1]["answers"]}
    assert interleaved["boundaries"] == 0 and interleaved["bytes per step"] == 0


def test_the_roofline_card_draws_this_machines_roof_from_the_calibration(tmp_path, monkeypatch):
    import json

    from gridtrain.plan.machine import machine_key

    monkeypatch.setenv("GRIDTRAIN_CACHE", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cards.machine_roof() is None  # not calibrated: no roof drawn
    entry = {"peak_flops": {"fp32": 1e11, "bf16": 4e11}, "memory_bytes_per_s": 4e10}
    (tmp_path / "calibration.json").write_text(json.dumps({machine_key(1): entry}))
    roof = cards.machine_roof()
    assert roof["ridge"] == pytest.approx(10.0) and roof["precision"] == "bf16"  # 4e11 / 4e10
    assert roof["peak_tflops"]["bf16"] == pytest.approx(0.4) and roof["bw_gb_per_s"] == pytest.approx(40)
    listed = next(c for c in cards.card_list() if c["id"] == "roofline")
    assert listed["machine"] == roof
