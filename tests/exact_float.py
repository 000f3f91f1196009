"""Exact rational arithmetic rounded as float32: the reference the CUDA optimizer emulations are held to."""

from __future__ import annotations

import math
from fractions import Fraction


def round_f32(x: Fraction) -> float:
    """x rounded once to the nearest float32, ties to even, subnormals included."""
    if x == 0:
        return 0.0
    magnitude = abs(x)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    quantum = max(exponent - 23, -149)  # below 2^-126 the spacing stays 2^-149
    rounded = round(magnitude / Fraction(2) ** quantum)  # Fraction rounds half to even
    return math.copysign(float(rounded * Fraction(2) ** quantum), float(x))


def f32(x: float | Fraction) -> float:
    """One float32 rounding of ``x`` (a float64 result of float32 operands, +-*/ and sqrt, rounds to the same float32
    as the exact one: 53 >= 2 * 24 + 2)."""
    return round_f32(Fraction(x))


def fma32(a: float, b: float, c: float) -> float:
    """fma(a, b, c) rounded once to float32."""
    return round_f32(Fraction(a) * Fraction(b) + Fraction(c))
