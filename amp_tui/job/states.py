"""The states of a run that are more than a word: what a full disk does, why a run is paused, and
how it ended (the exit status the CLI returns)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from amp_tui.core import fixes


class IoPolicy(enum.Enum):
    """What a disk that refuses the recording does to the run."""
    STOP = "stop"          # headless: stop with a non-zero status
    PAUSE = "pause"        # someone watches (the dashboard): pause until space is freed
    CARRY_ON = "carry_on"  # the user's own loop: say so once, keep the records, write them later


class PauseReason(enum.Enum):
    COMMAND = "command"      # pause from a key, ctl or --at
    NONFINITE = "nonfinite"  # --on-nonfinite pause
    IO = "io"                # held until the disk takes writes again


EXIT_OK = 0
EXIT_ERROR = 1          # the script raised, or the session/checkpoints could not be written
EXIT_NONFINITE_STOP = 3  # --on-nonfinite stop ended the run


@dataclass(frozen=True)
class LoopKind:
    """Whose loop runs the steps, in the terms the run speaks to its user in."""

    way: str                 # what a fix is worded as (core/fixes.py: TRAIN, MONITOR)
    stop_answer: str         # what a stop command answers
    stops_at_once: bool      # a stop ends the run at once (the loop reads should_stop right after)


TRAIN_LOOP = LoopKind(fixes.TRAIN, "stopping at this step boundary", stops_at_once=False)
MONITOR_LOOP = LoopKind(fixes.MONITOR, "stopping: monitor.should_stop is now True", stops_at_once=True)
