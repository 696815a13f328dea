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


def scale_text(scale: float) -> str:
    """A loss scale: a far power of two as one ("2^-24", amp-tui's floor), any other as `:g`
    ("65536", "0.5")."""
    if not (math.isfinite(scale) and scale > 0):
        return number(scale)
    mantissa, exponent = math.frexp(scale)
    if mantissa == 0.5 and abs(exponent - 1) >= 20:
        return f"2^{exponent - 1}"
    return f"{scale:g}"
