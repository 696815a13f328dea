"""How a lost rank shows (`RanksLost`), apart from distributed.py so that rank_gathers.py raises it too."""

from __future__ import annotations

import torch.distributed as dist

from amp_tui.core.text import one_line


class RanksLost(RuntimeError):
    """Another rank died or stopped answering: every collective of the group fails from now on."""


def backend_words(exc: BaseException) -> str:
    """The backend's own first sentence, without the source path gloo puts in front of it."""
    text = one_line(str(exc))
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0][:300]


def communication_failure(exc: BaseException) -> bool:
    """An exception from a collective (ours or DDP's): the process group lost a rank."""
    if isinstance(exc, RanksLost) or isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(mark in text for mark in ("gloo", "Gloo", "NCCL", "Connection closed by peer",
                                         "Connection reset by peer", "Timed out waiting",
                                         "pair closure", "ProcessGroup"))
