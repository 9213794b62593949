"""data.mix as written: `PATH=WEIGHT,PATH=WEIGHT,...`, parsed without torch (validation reads it), and
each source's samples per block of the interleaving (quotas: the planner's attention span weighs the
sources by them, as the mixture reader draws them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gridtrain.errors import BadInput


@dataclass(frozen=True)
class MixSource:
    name: str
    path: str
    weight: float


def parse_mix(spec: str) -> list[MixSource]:
    """`PATH=WEIGHT,PATH=WEIGHT,...` as MixSources named after their paths (BadInput when malformed).
    The weights are relative: 3 and 1 are 0.75 and 0.25."""
    sources: list[MixSource] = []
    for item in (part.strip() for part in spec.split(",")):
        path, sep, weight = item.rpartition("=")
        if not sep or not path.strip():
            raise BadInput(f"data.mix item '{item}' is not PATH=WEIGHT: write e.g. "
                           "--data.mix '/data/web=0.7,/data/code=0.3'")
        try:
            value = float(weight)
        except ValueError:
            raise BadInput(f"data.mix item '{item}': weight '{weight}' is not a number") from None
        if not value > 0 or not math.isfinite(value):
            raise BadInput(f"data.mix item '{item}': weight {value:g} must be a positive finite number "
                           "(leave a source out of the mix rather than give it weight 0)")
        name = Path(path.strip().rstrip("/")).name or path.strip()
        taken = {s.name for s in sources}
        name = name if name not in taken else next(f"{name}-{i}" for i in range(2, len(sources) + 3)
                                                   if f"{name}-{i}" not in taken)
        sources.append(MixSource(name, path.strip(), value))
    return sources


MIX_BLOCK = 1000
"""Samples per block of the interleaving: each source's share of any block is within 1/MIX_BLOCK of its weight."""


def quotas(weights: list[float], block: int = MIX_BLOCK) -> np.ndarray:
    """Each source's samples per block: block x weight share, rounded by largest remainder (ties to the
    earlier source); every source at least 1."""
    share = np.asarray(weights, np.float64) / sum(weights) * block
    counts = np.maximum(np.floor(share).astype(np.int64), 1)
    while counts.sum() < block:
        order = np.argsort(-(share - counts), kind="stable")
        counts[order[0]] += 1
    while counts.sum() > block:
        order = np.argsort(share - counts, kind="stable")
        counts[next(i for i in order if counts[i] > 1)] -= 1
    return counts
