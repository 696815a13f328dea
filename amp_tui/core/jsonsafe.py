"""Strict JSON for records that may hold non-finite numbers.

JSON has no NaN or Infinity. A non-finite float is written as the string "NaN", "Infinity" or
"-Infinity", which every strict parser accepts; readers turn those strings back into floats.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_float(x: float | None, digits: int | None = None) -> float | str | None:
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if digits is not None:
        # Magnitudes need a few significant digits, not 17: this keeps records small.
        return float(f"{x:.{digits}g}")
    return x


def read_float(value: Any) -> float | None:
    """A recorded number (which may be "NaN"/"Infinity"/"-Infinity") as a float; None when it is
    missing, null or not a number at all: readers of a recording never raise on a bad value."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:   # a whole number past float's range, as 1e400 parses to inf
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str):
        return NONFINITE_STRINGS.get(value)
    return None


def read_floats(values: Any, n: int) -> list[float | None]:
    """A recorded per-layer array as `n` floats (None where missing or bad)."""
    if not isinstance(values, list):
        return [None] * n
    out = [read_float(v) for v in values[:n]]
    return out + [None] * (n - len(out))


def read_float_rows(values: Any, n: int, width: int) -> list[list[float | None] | None]:
    """A recorded per-layer array of rows (each `width` numbers, or null) as `n` rows of floats:
    None for a layer without one, or whose row is bad."""
    if not isinstance(values, list):
        return [None] * n
    out = [read_floats(v, width) if isinstance(v, list) and len(v) == width else None for v in values[:n]]
    return out + [None] * (n - len(out))


def _reject_constant(token: str):
    raise ValueError(f"non-standard JSON token {token}")


# allow_nan=False makes a stray float('nan') an error here instead of a broken file later. One
# encoder for every record: json.dumps with options builds a new one on every call.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def dumps(obj: Any) -> str:
    return _ENCODER.encode(obj)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys; a file that names a key twice is ambiguous.
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(obj: Any) -> Any:
    if isinstance(obj, str):
        return _SURROGATE.sub("\ufffd", obj)
    if isinstance(obj, dict):
        return {_text(key): _text(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_text(value) for value in obj]
    return obj


def loads_text(text: str) -> Any:
    """`loads`, with every string of the result text that can be written out: a `\\udXXX` escape
    standing alone (half of a surrogate pair, which no UTF-8 file, pipe or terminal can hold)
    becomes U+FFFD, as undecodable bytes do. Only a line that holds such an escape is walked."""
    obj = loads(text)
    return _text(obj) if _SURROGATE_ESCAPE.search(text) else obj


def loads(text: str | bytes, *, unique_keys: bool = False) -> Any:
    """Parse strictly: bare NaN/Infinity tokens are refused, and with `unique_keys` an object that
    names a key twice."""
    return json.loads(text, parse_constant=_reject_constant,
                      object_pairs_hook=_unique_keys if unique_keys else None)


def strict(obj: Any) -> Any:
    """`obj` with every non-finite float (a value parsed from 1e400 is one) written as the session
    format writes it: "NaN", "Infinity", "-Infinity". Lists, tuples and dicts are copied."""
    if isinstance(obj, float):
        return encode_float(obj)
    if isinstance(obj, dict):
        return {key: strict(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(value) for value in obj]
    return obj


def output_json(obj: Any, *, indent: int | None = None) -> str:
    """What a `--json` option prints: strict JSON whatever numbers `obj` holds, never an error
    for a non-finite one (a damaged session's value, say). ASCII only: a string read from a
    damaged file may hold a lone surrogate, which no terminal or pipe could take as text."""
    return json.dumps(strict(obj), indent=indent, allow_nan=False)
