"""Number formats and loss scaling: the ranges that decide whether gradients underflow.

A binary float with e exponent bits and m mantissa bits has bias 2^(e-1) - 1, smallest normal
2^(1 - bias), smallest subnormal 2^(1 - bias - m), and (IEEE) largest finite (2 - 2^-m) 2^bias.
FP8 E4M3 in its "fn" form (OCP, NVIDIA) has no infinities and spends only the all-ones pattern
on NaN, which lifts its largest value to 1.75 x 2^8 = 448.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FloatFormat:
    name: str
    exponent_bits: int
    mantissa_bits: int
    finite_only: bool = False
    """No infinities, one NaN pattern (FP8 E4M3 "fn")."""

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def max(self) -> float:
        if self.finite_only:
            top_exponent = 2**self.exponent_bits - 1 - self.bias
            return (2 - 2.0 ** (1 - self.mantissa_bits)) * 2.0**top_exponent
        return (2 - 2.0 ** -self.mantissa_bits) * 2.0**self.bias

    @property
    def epsilon(self) -> float:
        """Gap between 1 and the next value: 2^-m."""
        return 2.0 ** -self.mantissa_bits

    @property
    def values_per_binade(self) -> int:
        """Representable fractions per power of two: 2^m (E4M3: 8)."""
        return 2**self.mantissa_bits


FP32 = FloatFormat("fp32", 8, 23)
BF16 = FloatFormat("bf16", 8, 7)
FP16 = FloatFormat("fp16", 5, 10)
FP8_E4M3 = FloatFormat("fp8-e4m3", 4, 3, finite_only=True)
FP8_E5M2 = FloatFormat("fp8-e5m2", 5, 2)


def dynamic_loss_scale(overflows: list[bool], init_scale: float = 65536.0,
                       growth_interval: int = 2000, backoff: float = 0.5, growth: float = 2.0) -> float:
    """The scale after a run of steps (dynamic loss scaling, Micikevicius et al. 2018, by
    torch.amp.GradScaler's rule): an overflow skips the step and multiplies the scale by
    `backoff`; `growth_interval` clean steps in a row multiply it by `growth`."""
    scale, clean = init_scale, 0
    for overflow in overflows:
        if overflow:
            scale, clean = scale * backoff, 0
        else:
            clean += 1
            if clean >= growth_interval:
                scale, clean = scale * growth, 0
    return scale


def activation_bytes_per_layer_simple(batch: int, seq_len: int, hidden: int, bytes_per_value: float,
                                      tensors: int = 2) -> float:
    """A rough count: `tensors` (the attention and FFN inputs) of b x s x d values (memory.py
    has Korthikanti et al. 2022's full one)."""
    return tensors * batch * seq_len * hidden * bytes_per_value
