"""The session format: an append-only JSON Lines record of one run, as written and as read.

Line 1 is the header; every other line is one record (`step`, `event`, or `end`); the fields are
in docs/session-format.md. Non-finite numbers are written as the strings "NaN", "Infinity",
"-Infinity" (see jsonsafe), so every line parses with a strict JSON parser. Readers skip a torn
last line, damaged lines (bare NaN/Infinity tokens included), unknown record types, and lines over
MAX_LINE_BYTES, which they never hold in memory.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from amp_tui.core import jsonsafe

FORMAT = "amp-tui-session"
VERSION = 1
FIGURE_DIGITS = 5  # significant digits kept for the grad norm
KNOWN_TYPES = ("header", "step", "event", "end")
# No record amp-tui writes comes near this (a step record of a 100,000-layer model is about 4 MB);
# a longer line is damage, or a hostile file, and is skipped without being read into memory.
MAX_LINE_BYTES = 16 << 20
# The leading fields of every step record, in the order they are written: the replay index reads
# them by position without parsing the per-layer arrays (amp_tui.recording.index builds its fast
# path from this tuple; a line that doesn't match is parsed in full).
STEP_HEAD = ("type", "step", "loss", "scale", "skipped", "skipped_total", "updates", "dtype",
             "micro_batches", "time", "duration")


class SessionFormatError(Exception):
    """The file is not a session we can read (not ours, damaged past reading, or from a newer
    version)."""


class SessionStarting(SessionFormatError):
    """The file holds a first line still being written (a run that has just started)."""


class NoSessionError(SessionFormatError):
    """The path names no session at all: neither a session file nor a run directory with one."""


LAYER_DIGITS = 4  # significant digits kept for per-layer magnitudes (act, grad, weight)
SHARE_DIGITS = 3  # significant digits kept for per-layer shares (underflow)
_INF = float("inf")
_SPEC = {d: f".{d}g" for d in range(1, 18)}
_INT_FROM = {d: 10.0 ** d for d in range(1, 18)}


def compact_figure(x: float | None, digits: int = LAYER_DIGITS) -> float | int | str | None:
    """A per-layer figure as a value whose JSON token is short: `digits` significant digits, and
    a whole number as an int (`1235`, `0`, not `1235.0`; from 10**digits to 10**(digits+1) all
    of its digits, `65504`, since they cost no byte more), so `json.dumps` writes tokens like
    `4.505e-05`, `0.5`, `1235`. Non-finite values become "NaN"/"Infinity"/"-Infinity" (strict
    JSON), None stays None (null: not measured). The value is exactly what a reader parses back."""
    if x is None:
        return None
    x = float(x)
    if x != x:
        return "NaN"
    if x == _INF or x == -_INF:
        return "Infinity" if x > 0 else "-Infinity"
    spec = _SPEC.get(digits) or f".{digits}g"
    a = abs(x)
    if a >= 1e15:
        return float(format(x, spec))
    whole = _INT_FROM.get(digits) or 10.0 ** digits
    if whole <= a < 10 * whole:
        return round(x)  # e.g. 65504 with 4 digits: one more digit costs no byte over 65500
    v = float(format(x, spec))
    if v.is_integer() and not (v == 0 and math.copysign(1.0, x) < 0):
        return int(v)  # 1235, 7, 0 instead of 1235.0, 7.0, 0.0; -0.0 keeps its sign
    return v


class EncodedStep(dict):
    """A `step` record that carries its JSON line (`line`, without the newline), built from the
    same pieces as its values: the writer takes the line instead of encoding the dict again."""

    __slots__ = ("line",)


_FORMATS = {d: f"{{:.{d}g}}".format for d in (LAYER_DIGITS, SHARE_DIGITS)}


def figures_json(values, digits: int = LAYER_DIGITS) -> str:
    """The JSON array of `compact_figure(v, digits)` for every value, exactly as `json.dumps`
    writes that list, without a Python call per value where it can.

    For a finite float below 10**digits in magnitude, `format(x, ".Ng")` is the token already:
    `float(token)` is the compact value and its repr is the token again (the same digits, and
    repr and "g" switch to an exponent below 1e-4 alike). The exceptions show in the joined text:
    "e+" (10**digits and up, written whole by compact_figure), "e-3" (down where float64 runs out
    of digits, 5e-324 and the like, and a little above), "n" ("nan", "inf") and a "-0" token
    (written "-0.0"); None can't be formatted. Those arrays take the value-by-value path."""
    fmt = _FORMATS.get(digits)
    if fmt is not None:
        try:
            text = ",".join(map(fmt, values))
        except (TypeError, ValueError):   # None, or not a number at all
            text = None
        if text is not None and "e+" not in text and "e-3" not in text and "n" not in text \
                and "-0," not in text + ",":
            return "[" + text + "]"
    return jsonsafe.dumps([compact_figure(v, digits) for v in values])


def step_record(result) -> EncodedStep:
    """A StepResult as a `step` record (per-layer figures as compact arrays in layer order), with
    its JSON line.

    The fields of STEP_HEAD come first, in that order, each written once; any other field comes
    after them.
    """
    enc = jsonsafe.encode_float
    record = EncodedStep(
        type="step",
        step=result.step,
        loss=enc(result.loss),
        scale=enc(result.scale),
        skipped=result.skipped,
        skipped_total=result.skipped_total,
        updates=result.updates_applied,
        dtype=result.dtype,
        micro_batches=result.micro_batches,
        time=round(result.wall_time, 3),
        duration=round(result.duration, 6),
        next_scale=enc(result.next_scale),
    )
    if result.lr is not None:
        record["lr"] = enc(result.lr)
    if result.grad_norm is not None:
        record["grad_norm"] = enc(result.grad_norm, FIGURE_DIGITS)
    if result.nonfinite:
        record["nonfinite"] = result.nonfinite
    if getattr(result, "calibration", False):   # a skip of GradScaler finding its scale at the start
        record["calibration"] = True
    probes = getattr(result, "probes", None)
    if probes is not None:   # the adaptive schedule's state, for the status bar
        record["probes"] = probes
    ranks = getattr(result, "per_rank", None)
    if ranks is not None:   # several ranks: theirs, in rank order (the layers hold their maximum)
        record["rank_loss"] = [enc(v) for v in ranks.loss]
        record["rank_step_time"] = [round(v, 6) for v in ranks.step_time]
    head = jsonsafe.dumps(record)
    if result.figures is None:
        record.line = head
        return record
    f = result.figures
    arrays = {"act": figures_json(f.act), "grad": figures_json(f.grad)}
    if f.weight is not None:   # read on some probed steps only
        arrays["weight"] = figures_json(f.weight)
    if f.underflow is not None:
        arrays["underflow"] = figures_json(f.underflow, SHARE_DIGITS)
    if f.underflow_scaled is not None:
        arrays["underflow_scaled"] = figures_json(f.underflow_scaled, SHARE_DIGITS)
    if f.fp8 is not None:   # in fp8: each fp8 layer's amax, [input, weight, grad_output]
        arrays["fp8"] = json.dumps([[compact_figure(v) for v in row] if row is not None else None
                                    for row in f.fp8], separators=(",", ":"))
    eta = getattr(result, "eta", None)
    if eta is not None:   # the headroom forecast: whole steps, null where a layer shows no trend
        arrays["eta"] = json.dumps(eta)
    text = "{" + ",".join(f'"{name}":{array}' for name, array in arrays.items()) + "}"
    record["layers"] = json.loads(text)   # the compact values, parsed back from their tokens
    record.line = head[:-1] + ',"layers":' + text + "}"
    return record


def event_record(step: int, kind: str, message: str, **fields: Any) -> dict:
    return {"type": "event", "step": step, "kind": kind, "message": message,
            "time": round(time.time(), 3), **fields}
