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


_BYTE_UNITS = ("kB", "MB", "GB", "TB")


def byte_size(count: int) -> str:
    """A file size in decimal units with 3 significant digits: `512 B`, `48.2 kB`, `3.1 MB`.

    A fixed unit would print a small checkpoint as "0.0 MB"."""
    if count < 1000:
        return f"{int(count)} B"
    value = float(count)
    for unit in _BYTE_UNITS:
        value /= 1000.0
        if value < 999.5:
            return f"{value:.3g} {unit}"
    return f"{value:.0f} {_BYTE_UNITS[-1]}"
