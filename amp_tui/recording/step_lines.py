"""A step line read at the byte level: the fast path of the replay index (index.py).

A step line is indexed from its leading scalar fields, which `format.step_record` writes first in
the order `format.STEP_HEAD` declares, without parsing the per-layer arrays. These are the pattern
that finds them, the readers of their numbers and flags, and the check for a bare NaN/Infinity
token that sends a line to the strict parse.
"""

from __future__ import annotations

import math
import re

from amp_tui.recording.format import STEP_HEAD

# Flag bits, one byte per step record.
F_SKIPPED = 1
F_LOSS_NONE = 2                # "loss" null or missing
F_SCALE_NONE = 4               # "scale" null (no GradScaler active)
F_NONFINITE_LOSS = 8
F_NONFINITE_GRADIENTS = 16
F_NONFINITE_OTHER = 32
F_CALIBRATION = 64             # a skip of GradScaler finding its scale at the start ("calibration")


def _step_head_pattern(p: bytes) -> re.Pattern:
    """The leading fields of a step line (format.STEP_HEAD, in that order, compact separators).

    Character classes rather than the exact JSON number grammar keep this fast (a few
    microseconds a line); each captured value is then parsed (a bad one sends the line to the full
    parse), and the line is parsed strictly anyway when the replay shows it. `p` is b"+" for
    possessive repeats (Python >= 3.11: no backtracking state to keep, faster) or b"" (3.10).
    Both match the same lines: no repeated class can match the character that follows it."""
    val = rb'(-?[0-9][0-9.eE+-]*' + p + rb'|"[A-Za-z-]+' + p + rb'"|null)'
    count = rb'[0-9]+' + p
    # What each leading field's value looks like; a capture group is a value the index keeps.
    values = {
        "type": rb'"step"', "step": rb'([0-9]{1,18}' + p + rb')', "loss": val, "scale": val,
        "skipped": rb'(true|false)', "skipped_total": count, "updates": count,
        "dtype": rb'"([A-Za-z0-9_]{1,64}' + p + rb')"', "micro_batches": count, "time": val,
        "duration": rb'[^,{}]+' + p,
    }
    if tuple(values) != STEP_HEAD:   # the writer's order and this one must be the same
        raise AssertionError(f"the replay index reads {tuple(values)}, the writer writes {STEP_HEAD}")
    head = b",".join(b'"' + name.encode() + b'":' + values[name] for name in STEP_HEAD)
    # A field after them holds a value without commas, or a list of numbers (a run of several
    # ranks writes `rank_loss` and `rank_step_time` so).
    field = rb'(?:\[[^\[\]{}]*' + p + rb'\]|[^,{}\[]+' + p + rb')'
    rest = rb'((?:,"[a-z_]+' + p + rb'":' + field + rb')*' + p + rb')(,"layers":\{|\})'
    return re.compile(rb'\{' + head + rest)


try:
    STEP_LINE = _step_head_pattern(b"+")
except re.error:
    STEP_LINE = _step_head_pattern(b"")
_SPECIAL = {b'"NaN"': math.nan, b'"Infinity"': math.inf, b'"-Infinity"': -math.inf, b"null": None}
BAD = object()
NONFINITE_FLAGS = {"loss": F_NONFINITE_LOSS, "gradients": F_NONFINITE_GRADIENTS}


def step_numbers(lt: bytes, sc: bytes, tt: bytes) -> tuple:
    """A step line's loss, scale and time as floats, with the flags of a null loss or scale; the
    loss is `BAD` when any of the three doesn't parse (the line goes the slow way)."""
    f = 0
    try:
        lv = float(lt)
    except ValueError:
        lv = _SPECIAL.get(lt, BAD)
        if lv is None:
            f = F_LOSS_NONE
            lv = math.nan
    try:
        sv = float(sc)
    except ValueError:
        sv = _SPECIAL.get(sc, BAD)
        if sv is None:
            f |= F_SCALE_NONE
            sv = math.nan
    try:
        tv = float(tt)
    except ValueError:
        tv = math.nan if tt in _SPECIAL else BAD
    if sv is BAD or tv is BAD:
        lv = BAD
    return f, lv, sv, tv


def rest_flags(rest: bytes) -> int:
    """The flags a step line's fields after the head carry: its kind of non-finite, a calibration skip."""
    f = 0
    if b'"nonfinite":"' in rest:
        f |= (F_NONFINITE_LOSS if b'"nonfinite":"loss"' in rest else
              F_NONFINITE_GRADIENTS if b'"nonfinite":"gradients"' in rest else F_NONFINITE_OTHER)
    if b'"calibration":true' in rest:
        f |= F_CALIBRATION
    return f


def bare_constant(buf: bytes, start: int, end: int) -> bool:
    """True when buf[start:end] may hold a bare NaN/Infinity token (not JSON: the strict parse
    refuses the line); the quoted strings step_record writes don't count. A step line holds no
    other capital N or I, so most lines cost two byte scans."""
    if buf.find(b"N", start, end) < 0 and buf.find(b"I", start, end) < 0:
        return False
    if buf.find(b"NaN", start, end) >= 0 \
            and buf.count(b"NaN", start, end) != buf.count(b'"NaN"', start, end):
        return True
    if buf.find(b"Infinity", start, end) >= 0:
        quoted = buf.count(b'"Infinity"', start, end) + buf.count(b'"-Infinity"', start, end)
        return buf.count(b"Infinity", start, end) != quoted
    return False
