"""The calculations page's API: the cards of gridtrain.plan.lessons as JSON, and a card's answers
for given inputs (POST /api/cards/ID with {"INPUT": number, ...})."""

from __future__ import annotations

import math
from typing import Callable

from gridtrain.explore.api import BadRequest, Field, _value
from gridtrain.plan.lessons import CARDS, card

MAY_BE_ZERO = ("lat", "overflows", "clean_steps")
"""Inputs that may be 0 (a latency, a count of steps); the others are sizes, rates or counts > 0."""
MAX_INPUT, MAX_WHOLE = 1e18, 1_000_000
"""Inputs beyond these are refused (whole numbers count GPUs, layers or steps, some of them one by
one): no worked problem of distributed training needs more."""


def card_list() -> list[dict[str, object]]:
    """GET /api/cards: every card with its inputs, formula, sources and the answers at its defaults;
    the roofline card also with this machine's roof as `gridtrain calibrate` measured it."""
    out = [{"id": c.id, "title": c.title, "topic": c.topic, "formula": c.formula, "source": c.source,
            "quoted": c.quoted, "correction": c.correction, "explore": c.explore,
            "inputs": [{"name": i.name, "label": i.label, "default": i.default, "unit": i.unit, "whole": i.whole}
                       for i in c.inputs],
            "answers": _answers(c.answer({}))} for c in CARDS]
    for c in out:
        if c["id"] == "roofline":
            c["machine"] = machine_roof()
    return out


def machine_roof() -> dict[str, object] | None:
    """This machine's roof from `gridtrain calibrate`'s cache (one process's threads, else one): its measured
    matmul peak in each precision and memory bandwidth, and the ridge they make; None if not
    calibrated."""
    from gridtrain.plan.local import rank_threads
    from gridtrain.plan.machine import cached_entry

    for threads in dict.fromkeys((rank_threads(1), 1)):  # all the cores, else one (calibrate's default)
        entry = cached_entry(threads)
        peaks, bandwidth = entry.get("peak_flops") or {}, entry.get("memory_bytes_per_s")
        if peaks and bandwidth:
            best = max(peaks, key=peaks.get)
            return {"peak_tflops": {k: v / 1e12 for k, v in peaks.items()}, "bw_gb_per_s": bandwidth / 1e9,
                    "ridge": peaks[best] / bandwidth, "precision": best, "threads": threads}
    return None


def _answers(rows: list[tuple[str, float, str]]) -> list[dict[str, object]]:
    return [{"label": label, "value": value, "unit": unit} for label, value, unit in rows]


def answer(card_id: str, body: object) -> tuple[int, dict]:
    """The card's answers for the inputs in `body` (missing ones take their defaults)."""
    c = card(card_id)
    if c is None:
        return 404, {"error": f"no card {card_id[:80]!r}; the cards are {', '.join(x.id for x in CARDS)}"}
    if not isinstance(body, dict):
        return 400, {"error": "the body must be a JSON object of the card's inputs"}
    names = {i.name: i for i in c.inputs}
    values: dict[str, float] = {}
    for key, value in body.items():
        if key not in names:
            return 400, {"error": f"{key[:80]}: not an input of {c.id}; it takes {', '.join(names)}"}
        whole = names[key].whole
        field = Field("int" if whole else "float", 0, MAX_WHOLE if whole else MAX_INPUT, low_open=key not in MAY_BE_ZERO)
        try:
            values[key] = _value(key, value, field)
        except BadRequest as e:
            return 400, {"error": str(e)}
    try:
        rows = c.answer(values)
    except (ValueError, ZeroDivisionError, OverflowError) as e:
        return 422, {"error": f"{c.id}: these inputs have no answer: {e}"}
    if any(isinstance(v, float) and not math.isfinite(v) for _, v, _ in rows):
        return 422, {"error": f"{c.id}: these inputs give no finite answer"}
    return 200, {"id": c.id, "answers": _answers(rows)}


def answer_route(path: str) -> Callable[[object], tuple[int, dict]]:
    card_id = path.removeprefix("/api/cards/")
    return lambda body: answer(card_id, body)
