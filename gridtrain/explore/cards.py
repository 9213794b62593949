"""The calculations page's API: the cards of gridtrain.plan.lessons as JSON, and a card's answers
for given inputs (POST /api/cards/ID with {"INPUT": number, ...})."""

from __future__ import annotations

import math
from typing import Callable

from gridtrain.plan.lessons import CARDS, card

MAX_INPUT, MAX_WHOLE = 1e18, 1_000_000
"""Inputs beyond these are refused (whole numbers count GPUs, layers or steps, some of them one by
one): no worked problem of distributed training needs more."""


def card_list() -> list[dict[str, object]]:
    """GET /api/cards: every card with its inputs, formula, sources and the answers at its defaults."""
    return [{"id": c.id, "title": c.title, "topic": c.topic, "formula": c.formula, "source": c.source,
             "quoted": c.quoted, "correction": c.correction, "explore": c.explore,
             "inputs": [{"name": i.name, "label": i.label, "default": i.default, "unit": i.unit, "whole": i.whole}
                        for i in c.inputs],
             "answers": _answers(c.answer({}))} for c in CARDS]


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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return 400, {"error": f"{key}: expected a finite number, got {value!r:.60}"}
        if not 0 < value <= MAX_INPUT and not (value == 0 and key in ("lat", "overflows", "clean_steps")):
            return 400, {"error": f"{key}: {value!r} is out of range (> 0 and <= {MAX_INPUT:g})"}
        if names[key].whole and (value != int(value) or value > MAX_WHOLE):
            return 400, {"error": f"{key}: {names[key].label} is a whole number up to {MAX_WHOLE:,}, got {value!r}"}
        values[key] = int(value) if names[key].whole else float(value)
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
