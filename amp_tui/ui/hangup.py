"""SIGHUP and SIGTERM while the dashboard runs: stop the run, flush the session, leave.

Textual installs no handler for either, and when the terminal disappears its own shutdown can
block for good (its output thread dies on the dead terminal and the next write waits on a full
queue). So the work that matters happens on a separate thread that doesn't need the UI: ask the
app to exit, stop the run at a step boundary (bounded wait), flush the session, and if the main
thread still hasn't finished shortly after, end the process.
"""

from __future__ import annotations

import os
import signal
import threading

from amp_tui.ui.messages import TerminalGone

SIGNALS = (signal.SIGHUP, signal.SIGTERM)
GRACE_S = 3.0   # after the run stopped, how long the UI gets to exit normally


class HangupGuard:
    def __init__(self, app, source, run, stop_timeout: float):
        self.app = app
        self.source = source
        self.run = run
        self.stop_timeout = stop_timeout
        self.finished = threading.Event()   # set by the caller once it is done (normal exit)
        self._thread: threading.Thread | None = None
        self._previous: dict = {}

    def __enter__(self) -> "HangupGuard":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self.finished.set()

    def _on_signal(self, signum, _frame) -> None:
        # Runs on the main thread between bytecodes: do nothing here that could block.
        if self._thread is None:
            self._thread = threading.Thread(target=self._stop_and_leave, args=(signum,),
                                            name="amp-tui-hangup", daemon=True)
            self._thread.start()

    def _stop_and_leave(self, signum: int) -> None:
        self.app.post_message(TerminalGone())      # the normal path, if the UI still runs
        if not self.source.stop(self.stop_timeout):
            self.run.close()                       # a step hangs: flush what is finished
        if not self.finished.wait(GRACE_S):
            os._exit(128 + signum)                 # the UI is stuck on the dead terminal
