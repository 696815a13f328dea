"""The batches of a run: on the device, in order, started over whenever they run out."""

from __future__ import annotations

from typing import Iterable

import torch

from amp_tui.training.devices import move_to_device
from amp_tui.training.script import ScriptError


class BatchFeed:
    """Yields batches on the device forever, re-iterating `batches` when it runs out."""

    def __init__(self, batches: Iterable, device: torch.device):
        self._batches = batches
        self._device = device
        self._iter = None
        self._peeked = None   # the next batch, already on the device (peek() read it)
        self.consumed = 0

    def _next_raw(self):
        if self._iter is None:
            self._iter = iter(self._batches)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self._batches)
            try:
                return next(self._iter)
            except StopIteration:
                if self.consumed == 0:
                    raise ScriptError("'batches' yielded no batch") from None
                if self._iter is self._batches:
                    raise ScriptError(f"'batches' ran out after {self.consumed} batches and can't start "
                                      "over (its iter() is itself, like a generator's): return a list "
                                      "or a DataLoader") from None
                raise ScriptError(f"'batches' ran out after {self.consumed} batches and yielded none "
                                  "when started over") from None

    def peek(self):
        """The next batch on the device; take() hands out this same object."""
        if self._peeked is None:
            self._peeked = move_to_device(self._next_raw(), self._device)
        return self._peeked

    def _next(self):
        batch, self._peeked = self._peeked, None
        if batch is None:
            batch = move_to_device(self._next_raw(), self._device)
        self.consumed += 1
        return batch

    def take(self, count: int) -> list:
        return [self._next() for _ in range(count)]

    def skip(self, count: int) -> None:
        for _ in range(count):
            if self._peeked is not None:
                self._peeked = None
            else:
                self._next_raw()
            self.consumed += 1
