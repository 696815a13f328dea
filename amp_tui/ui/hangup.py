"""The terminal going away while the dashboard runs: stop the run, flush the session, leave.

It goes away with SIGHUP or SIGTERM, or with no signal at all: when a pseudo-terminal's other
side closes and the hang-up signal doesn't reach us (we are not in its foreground process group,
or not in its session), our input just reaches end of file. Textual handles none of these: it
installs no handler for the signals, and its input thread takes an empty read for "nothing yet",
so at end of file it spins a core forever and the app never learns. Worse, once the terminal is
gone its own shutdown can block for good (its output thread dies on the dead terminal and the
next write waits on a full queue).

So the work that matters happens on a separate thread that doesn't need the UI: ask the app to
exit, stop the run at a step boundary (bounded wait) with a checkpoint, as headless mode does for
an SSH drop, flush the session, and if the main thread still hasn't finished shortly after, end
the process. End of file is noticed by polling the input for a hang-up (never reading it: the
keys are Textual's).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading

from amp_tui.core.signals import install_handlers, restore_handlers
from amp_tui.ui.messages import TerminalGone

SIGNALS = (signal.SIGHUP, signal.SIGTERM)
GRACE_S = 3.0         # after the run stopped, how long the UI gets to exit normally
INPUT_POLL_S = 0.5    # how long each poll of the input waits (asleep, not spinning)
INPUT_CLOSED = "the terminal closed (its input reached end of file)"
# Poll results that mean the input is gone for good; a live terminal shows none of them.
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL if hasattr(select, "poll") else 0


def terminal_input() -> int | None:
    """The file descriptor Textual reads keys from (standard input), if it is a terminal."""
    try:
        fd = sys.__stdin__.fileno()
    except (AttributeError, ValueError, OSError):
        return None
    return fd if os.isatty(fd) else None


class HangupGuard:
    def __init__(self, app, source, run, stop_timeout: float, *, input_fd: int | None = None):
        self.app = app
        self.source = source
        self.run = run
        self.stop_timeout = stop_timeout
        self.input_fd = input_fd            # watched for end of file (None: not watched)
        self.finished = threading.Event()   # set by the caller once it is done (normal exit)
        self._once = threading.Lock()       # held from the first trigger on: one stop, not two
        self._previous: dict = {}

    def __enter__(self) -> "HangupGuard":
        self._previous = install_handlers(SIGNALS, self._on_signal)
        if self.input_fd is not None and _GONE:
            threading.Thread(target=self._watch_input, name="amp-tui-input-watch",
                             daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        restore_handlers(self._previous)
        self.finished.set()

    def _on_signal(self, signum, _frame) -> None:
        # Runs on the main thread between bytecodes: do nothing here that could block.
        self._trigger(signal.Signals(signum).name, 128 + signum)

    def _watch_input(self) -> None:
        poller = select.poll()
        poller.register(self.input_fd, 0)   # no POLLIN: hang-ups and errors are always reported
        while not self.finished.is_set():
            if any(mask & _GONE for _fd, mask in poller.poll(INPUT_POLL_S * 1000)):
                # the status a hang-up would give: that's what it is, minus the signal
                self._trigger(INPUT_CLOSED, 128 + signal.SIGHUP)
                return

    def _trigger(self, reason: str, exit_status: int) -> None:
        if self._once.acquire(blocking=False):
            threading.Thread(target=self._stop_and_leave, args=(reason, exit_status),
                             name="amp-tui-hangup", daemon=True).start()

    def _stop_and_leave(self, reason: str, exit_status: int) -> None:
        self.run.unattended()   # nobody can free space or answer: a full disk stops, as headless
        self.run.request_stop(checkpoint=True, reason=reason)   # keep the progress, then stop
        self.app.post_message(TerminalGone())      # the normal path, if the UI still runs
        if not self.source.stop(self.stop_timeout):
            self.run.close()                       # a step hangs: flush what is finished
        if not self.finished.wait(GRACE_S):
            os._exit(exit_status)                  # the UI is stuck on the dead terminal
