"""The one public error, the internal one that carries a problem up to it, and message helpers."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint could not be written, read or restored; str(e) is one line naming the file."""


class Problem(Exception):
    """Internal: what is wrong with a file or with the live objects; the caller adds the file name."""


class Unencodable(Exception):
    """Internal: a piece of run state that a checkpoint cannot hold."""


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return one_line(str(exc)) or type(exc).__name__


def few(names, limit: int = 3) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def dtype_name(dtype) -> str:
    """"float16" for torch.float16."""
    return str(dtype).removeprefix("torch.")
