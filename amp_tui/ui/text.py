"""Turning user-controlled strings and numbers into display text.

Layer names, messages, paths and tracebacks come from the user's script: they are always wrapped
in `rich.text.Text` (never interpolated into markup), and control characters are made visible so
a name like "\\x1b[31m" can't repaint the terminal.
"""

from __future__ import annotations

import math

from rich.text import Text

from amp_tui.core.numfmt import number
from amp_tui.core.text import visible


def literal(value: object, style: str = "", *, keep_newlines: bool = False) -> Text:
    """A Text that shows `value` exactly as written: no markup, no terminal escapes."""
    return Text(visible(value, keep_newlines=keep_newlines), style=style)


def magnitude(value: float | None) -> str:
    """A per-layer figure: 3 significant digits, '-' when it wasn't measured."""
    return number(value, 3)


def loss_text(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return magnitude(value)
    return f"{value:.5g}"


def scale_text(value: float | None) -> str:
    """A loss scale: the number, and its power of two when it is one (65536 = 2^16)."""
    if value is None:
        return "none"
    if not math.isfinite(value) or value <= 0:
        return magnitude(value)
    exponent = math.log2(value)
    if exponent == int(exponent):
        return f"{value:g} (2^{int(exponent)})"
    return f"{value:g}"


def bits_text(bits: float | None) -> str:
    if bits is None:
        return "-"
    if math.isinf(bits):
        return "none" if bits < 0 else "∞"
    return f"{bits:.1f}"


def middle_ellipsis(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    keep = width - 1
    head = keep // 3
    return text[:head] + "…" + text[len(text) - (keep - head):]


def same_text(a: Text | None, b: Text | None) -> bool:
    """Equal as displayed (Text.__eq__ ignores the base style)."""
    if a is None or b is None:
        return a is b
    return a.plain == b.plain and a.style == b.style and a.spans == b.spans
