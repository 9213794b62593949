"""What differs between the torch versions gridtrain supports, named in one place.

gridtrain runs on torch 2.11 and later (pyproject.toml): 2.11 is what the GPU images of the day
ship, 2.13 what this project's constraints pin and CI tests. Where an API differs, the code asks
here rather than comparing version strings itself.
"""

from __future__ import annotations

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]
"""torch's major and minor version, e.g. (2, 13)."""

OLDEST_TORCH = (2, 11)
"""The lowest torch gridtrain supports (and pyproject.toml declares)."""

PIPELINE_STAGE_META = TORCH_VERSION >= (2, 13)
"""torch 2.13's pipeline stages take their shapes as one static record (`_StageMeta`) and vote on
them at the schedule's warm-up; earlier ones keep `inputs_meta` and the outputs' metadata and skip
shape inference when the inputs' are set."""

TRUNC_NORMAL_REDRAWS = TORCH_VERSION >= (2, 13)
"""`nn.init.trunc_normal_` redraws the values outside the bounds from torch 2.13 on (what
gridtrain's initialiser reproduces bit for bit, on every version); earlier versions invert the
normal CDF, other numbers from the same seed."""
