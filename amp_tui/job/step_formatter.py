"""Step records formatted on a thread of their own, while the training thread trains.

Formatting a step's record (its fields and its JSON line) was the largest part of what every step
paid amp-tui, and the training thread did it with its caches cold from the step. Torch's ops
release the GIL while they compute, so a thread of its own formats the records during the next
step. Nothing else moves: the training thread still writes the records, in order, with the events
between them (job/recorder.py), so a full disk is still met there, and the observers (the
dashboard's buffer, TensorBoard) are still called there.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable


class PendingStep:
    """A step whose record is being made: `record` once `ready` (or the `error` that made it fail)."""

    __slots__ = ("result", "record", "error", "ready", "sent")

    def __init__(self, result: Any):
        self.result = result
        self.record: dict | None = None
        self.error: BaseException | None = None
        self.ready = False
        self.sent = False   # handed to the thread (else the training thread makes it itself)


class StepFormatter:
    """One daemon thread, started with the first batch, that makes the records of the batches it
    is sent, in order. `make` must read nothing the training thread still changes."""

    def __init__(self, make: Callable[[Any], dict]):
        self.make = make
        self._batches: queue.SimpleQueue[list[PendingStep] | None] = queue.SimpleQueue()
        self._made = threading.Condition()
        self._thread: threading.Thread | None = None

    def send(self, batch: list[PendingStep]) -> None:
        if not batch:
            return
        for pending in batch:
            pending.sent = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="amp-tui-step-records", daemon=True)
            self._thread.start()
        self._batches.put(batch)

    def make_now(self, pending: PendingStep) -> None:
        """On the calling thread: a step not sent yet (a record wanted at once)."""
        self._make(pending)

    def wait(self, pending: PendingStep) -> None:
        with self._made:
            self._made.wait_for(lambda: pending.ready)

    def close(self) -> None:
        """After the last batch was waited for: the thread ends."""
        if self._thread is not None:
            self._batches.put(None)
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        while (batch := self._batches.get()) is not None:
            for i, pending in enumerate(batch):
                if i:
                    time.sleep(0)   # lets the training thread have the GIL between two records
                self._make(pending)
            with self._made:
                self._made.notify_all()

    def _make(self, pending: PendingStep) -> None:
        try:
            pending.record = self.make(pending.result)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread, where it is written
            pending.error = exc
        pending.ready = True
