"""argparse value types shared by the commands: numbers in a range, with one-line errors."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def number(kind: type, low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite `kind` (int or float) in [low, high] ((low, high] if low_open),
    or argparse's one-line error naming the value and the range."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"{text} must be {bound}" + (f" and <= {high:g}" if high < math.inf else ""))
        return value
    return parse
