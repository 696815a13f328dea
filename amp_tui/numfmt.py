"""Numbers for people: a few significant digits, non-finite values spelled the same everywhere."""

from __future__ import annotations

import math


def number(value: float | None, digits: int = 3, missing: str = "-") -> str:
    """`digits` significant digits; "NaN", "inf", "-inf" for non-finite values; `missing` for None."""
    if value is None:
        return missing
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}g}"
