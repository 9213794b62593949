"""The small rules every part of validation uses: a choice among options, a lower bound, a range,
and the model's shape where its keys make one."""

from __future__ import annotations

from gridtrain.config import Config
from gridtrain.model.args import PRESETS, ModelArgs


def choice(key: str, value: str, options: tuple[str, ...]) -> list[str]:
    if value in options:
        return []
    return [f"{key} = '{value}' is not one of {', '.join(options)}"]


def at_least(key: str, value: float, low: float) -> list[str]:
    return [] if value >= low else [f"{key} = {value} must be >= {low}"]


def in_range(key: str, value: float, low: float, high: float) -> list[str]:
    return [] if low <= value <= high else [f"{key} = {value} must lie in [{low}, {high}]"]


def shape_of(cfg: Config) -> ModelArgs | None:
    """The model's shape, or None where its keys cannot make one (validate._check_model says why)."""
    if cfg.model.preset not in PRESETS:
        return None
    try:
        return cfg.model.args()
    except ValueError:  # MoE keys on a dense preset
        return None
