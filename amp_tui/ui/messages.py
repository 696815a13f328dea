"""Messages posted to the app from other threads (the training thread, the stop worker).

Other threads only ever `post_message` (thread-safe); the handlers run on the UI thread.
"""

from __future__ import annotations

from textual.message import Message

from amp_tui.core.commands import Command, Outcome


class InterventionDone(Message):
    """The run applied (or refused) a command: `outcome.message` is what to tell the user."""

    def __init__(self, command: Command, outcome: Outcome) -> None:
        super().__init__()
        self.command = command
        self.outcome = outcome


class SourceStopped(Message):
    """The quit sequence finished waiting for the run to stop (`stopped` False: it timed out)."""

    def __init__(self, stopped: bool, timeout: float) -> None:
        super().__init__()
        self.stopped = stopped
        self.timeout = timeout


class TerminalGone(Message):
    """SIGHUP/SIGTERM arrived (an SSH drop, a kill): leave without waiting for the user."""
