"""One monitor per process: it owns the process's control socket and its signal handlers."""

from __future__ import annotations

import threading
from typing import Any


class ProcessSlot:
    """Held by one object at a time; `claim` names the holder that is still open."""

    def __init__(self) -> None:
        self._holder: Any = None
        self._lock = threading.Lock()

    def claim(self, holder: Any, *, still_open, refusal) -> None:
        """Take the slot, or raise `refusal(current)` while `still_open(current)`."""
        with self._lock:
            if self._holder is not None and still_open(self._holder):
                raise refusal(self._holder)
            self._holder = holder

    @property
    def holder(self) -> Any:
        return self._holder

    def release(self, holder: Any) -> None:
        with self._lock:
            if self._holder is holder:
                self._holder = None
