"""Text from recordings and scripts, made safe to show and kept to a size.

Layer names, messages, paths and tracebacks come from the user's script or from a file anyone may
have written: shown as they are, an escape sequence could repaint the terminal and a megabyte
string would stall a screen. Two ways to make them safe, one per kind of output:

- `visible`: control characters shown as escapes (`\\x1b`), for the dashboard, where the text is
  drawn literally and seeing the byte matters;
- `one_line`: escape sequences and control characters removed and white space folded, for lines
  printed to a terminal or a pipe (the headless timeline, `--at` arguments).

And one way to cut: `clip` keeps the start (and with `middle=True` the end too) and says how much
went; `clip_strings` applies it to every string in a parsed record.
"""

from __future__ import annotations

import re
import unicodedata

ELLIPSIS = "…"

_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]"            # CSI: colours, cursor moves
                      r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: titles, hyperlinks
                      r"|\x1b[@-_]?|\x9b[0-?]*[ -/]*[@-~]")
# C0/C1 controls, bidirectional overrides and the BOM go; tabs and line breaks become spaces.
_REMOVED = {c: None for c in (*range(0x00, 0x20), *range(0x7F, 0xA0), 0x200E, 0x200F,
                              *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0xFEFF)}
_REMOVED.update({0x09: " ", 0x0A: " ", 0x0D: " "})
_SHOWN_AS_ESCAPES = ("Cc", "Cf", "Cs", "Co", "Zl", "Zp")


def visible(value: object, *, keep_newlines: bool = False) -> str:
    """`value` as a string whose control characters are shown as escapes (\\x1b, \\r, ...)."""
    text = str(value)
    if text.isprintable():   # the common case: nothing to escape
        return text
    out = []
    for ch in text:
        if ch == "\n" and keep_newlines:
            out.append(ch)
        elif ch == "\t":
            out.append("    " if keep_newlines else " ")
        elif unicodedata.category(ch) in _SHOWN_AS_ESCAPES:
            out.append(ascii(ch)[1:-1])  # '\x1b' -> \x1b, '\u202e' -> \u202e
        else:
            out.append(ch)
    return "".join(out)


def one_line(value: object, limit: int | None = None) -> str:
    """`value` as one line of plain text: escape sequences and control characters removed, white
    space folded, cut to `limit` characters (an ellipsis at the end)."""
    text = " ".join(_ESCAPES.sub("", str(value)).translate(_REMOVED).split())
    return text if limit is None else clip(text, limit)


def clip(text: str, limit: int, *, middle: bool = False, count: bool = False) -> str:
    """`text` in at most about `limit` characters. The end is cut (`middle`: the middle, so a
    layer's own name or a traceback's last frame stays); `count` says how many characters went."""
    if len(text) <= limit:
        return text
    if middle:
        half = limit // 2
        return f"{text[:half]}{ELLIPSIS}[{len(text) - 2 * half:,} characters cut]{ELLIPSIS}{text[-half:]}"
    if count:
        return f"{text[:limit]}{ELLIPSIS} ({len(text) - limit:,} more characters)"
    return text[:limit - 1] + ELLIPSIS


def clip_strings(value, limit: int):
    """A parsed record with every string in it, keys and values, clipped in the middle."""
    if isinstance(value, str):
        return clip(value, limit, middle=True)
    if isinstance(value, dict):
        return {clip_strings(k, limit): clip_strings(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [clip_strings(v, limit) for v in value]
    return value


def plural(n: int, word: str, many: str | None = None) -> str:
    """"1 step", "3 steps", "2 batches" (with `many`)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
