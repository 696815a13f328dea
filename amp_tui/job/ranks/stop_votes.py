"""A stop asked for on one rank and the signal it names, apart from distributed.py's collectives."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class StopVote:
    """A stop asked for on one rank (a signal, a key, a full disk), to be agreed at a boundary."""

    checkpoint: bool
    reason: str | None
    signum: int = 0


def signal_number(reason: str | None) -> int:
    try:
        return int(signal.Signals[reason]) if reason else 0
    except KeyError:
        return 0


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
