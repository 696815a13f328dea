"""The median of a window of recent values, made again only as often as it can move: the probe
schedule's measure of what a probed and an unprobed step cost (a median, not a mean: one slow
step of a busy machine moves it little)."""

from __future__ import annotations

import statistics
from collections import deque


class RecentMedian:
    """The median of the last `size` values (None before the first), made again at every value
    until the window is full, then every `refresh` values: a window's median moves slowly, and
    every step pays for making it."""

    def __init__(self, size: int, refresh: int = 1):
        self.values: deque[float] = deque(maxlen=size)
        self.refresh = refresh
        self.value: float | None = None
        self._added = 0

    def add(self, value: float) -> bool:
        """Whether the median was made again."""
        self.values.append(value)
        self._added += 1
        if len(self.values) < (self.values.maxlen or 0) or self._added % self.refresh == 0:
            self.value = statistics.median(self.values)
            return True
        return False

    def add_to_last(self, extra: float) -> None:
        """The last value was `extra` more than told."""
        self.values[-1] += extra
        self.value = statistics.median(self.values)
