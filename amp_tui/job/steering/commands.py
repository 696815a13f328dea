"""Commands at a run's step boundaries: the queue any thread submits to, and the table of
handlers the run applies them with (one handler per action, no chain of ifs)."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Mapping

from amp_tui.core.commands import Command, Outcome

Handler = Callable[[Command], Outcome]


class CommandQueue:
    """Thread-safe FIFO that the run loop drains at step boundaries."""

    def __init__(self):
        self._queue: queue.Queue[Command] = queue.Queue()
        self.wakeup = threading.Event()

    def submit(self, command: Command) -> None:
        self._queue.put(command)
        self.wakeup.set()

    def idle(self) -> bool:
        """Nothing submitted (without the queue's lock: one submitted as this reads is applied
        at the next boundary)."""
        return not self._queue.queue

    def drain(self) -> list[Command]:
        if self._queue.empty():   # the common case, at every step boundary
            return []
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout: float) -> None:
        """Block until something is submitted (or the timeout passes)."""
        if self._queue.empty():
            self.wakeup.wait(timeout)
        self.wakeup.clear()


def apply_command(handlers: Mapping[str, Handler], command: Command,
                  on_failure: Callable[[Command, str], None]) -> Outcome:
    """Apply `command` with its handler and answer whoever sent it (`on_done`). A handler that
    raises refuses the command (`on_failure` records why): a command never stops the run."""
    handler = handlers.get(command.action)
    if handler is None:
        outcome = Outcome(False, f"unknown command {command.action!r}")
    else:
        try:
            outcome = handler(command)
        except Exception as exc:  # noqa: BLE001 - a refused command never stops the run
            outcome = Outcome(False, f"{command.text()} failed: {exc}")
            on_failure(command, outcome.message)
    if command.on_done is not None:
        command.on_done(outcome)
    return outcome
