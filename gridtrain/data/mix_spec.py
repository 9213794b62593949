"""data.mix as written: `PATH=WEIGHT,PATH=WEIGHT,...`, parsed without torch (validation reads it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

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
