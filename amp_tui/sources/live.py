"""A live run as a `Source`: the run on its own training thread, its records fed to a buffer."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from amp_tui.sources.buffer import RunBuffer
from amp_tui.sources.protocol import Snapshot

if TYPE_CHECKING:
    from amp_tui.core.commands import Command

TRAINING_SWITCH_INTERVAL_S = 0.0005  # GIL hand-over while a UI shares the process with training


class LiveSource:
    """A Run on its own training thread (a plain thread: a Textual worker can't be stopped)."""

    mode = "live"
    can_steer = True
    detaches = False
    playback = None
    output_path = None   # the run's output is this terminal

    def __init__(self, run):
        self.run = run   # a job.run.Run (duck-typed here: sources don't import the job)
        # Someone is watching: a full disk pauses the run, to be resumed once space is freed,
        # instead of stopping it as headless does.
        run.watched()
        self.buffer = RunBuffer("live")
        run.observers.append(self.buffer.feed)
        self._thread: threading.Thread | None = None
        self.exit_status: int | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        # Python hands the GIL to a waiting thread only after 5 ms by default: every op the
        # training thread finishes while the UI renders would wait that long for it.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, TRAINING_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._main, name="amp-tui-training", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self.exit_status = self.run.run()
            self.buffer.set_state(self.run.state)
        finally:
            sys.setswitchinterval(self._switch_interval)

    def snapshot(self) -> Snapshot:
        return self.buffer.snapshot()

    def send(self, command: Command) -> tuple[bool, str]:
        if not self.alive:
            return False, "the run has ended"
        self.run.submit(command)
        return True, f"{command.text()} queued for the next step boundary"

    def checkpoints(self) -> list:
        return self.run.checkpoints()

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir

    @property
    def session_path(self) -> Path:
        return self.run.session_path

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0, *, give_up_unwritten: bool = False) -> bool:
        self.run.request_stop(give_up_unwritten=give_up_unwritten)
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout
        while self._thread.is_alive():
            remaining = deadline - time.monotonic()
            if self.run.stop_held.is_set() or remaining <= 0:
                return False
            self._thread.join(min(remaining, 0.05))
        return True

    def held_stop(self) -> str | None:
        return self.run.held_message if self.run.stop_held.is_set() else None
