"""The records a producer feeds, reduced to what the dashboard shows.

A producer (the training thread, or a file reader) calls `RunBuffer.feed(record)` with each record;
the UI calls `snapshot()` on its own timer. Memory stays bounded however long the run: the chart
history is decimated (every other point is dropped when it fills up, and from then on only every
2nd, 4th, ... step is kept), the event list and the marker lists are capped.
"""

from __future__ import annotations

import collections
import threading

from amp_tui.core.jsonsafe import read_float, read_float_rows, read_floats
from amp_tui.core.records import MARKER_EVENTS, InForce, Mode, RunState, next_in_force, next_state
from amp_tui.sources.protocol import (
    EVENT_LIMIT,
    HISTORY_POINTS,
    MARKER_LIMIT,
    History,
    LayerView,
    RankView,
    Snapshot,
)

MAX_RANKS = 4096   # per-rank figures kept of one record at most (a damaged one may hold more)


class RunBuffer:
    """Thread-safe collector of records; producers feed, the UI takes snapshots."""

    def __init__(self, mode: Mode = "live", history_points: int = HISTORY_POINTS):
        self.mode = mode
        self._lock = threading.Lock()
        self._points = history_points
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._header: dict = {}
            self._state: RunState = "starting"
            self._in_force = InForce()
            self._last: dict | None = None
            self._history = History()
            self._skipped: collections.deque[int] = collections.deque(maxlen=MARKER_LIMIT)
            self._interventions: collections.deque[int] = collections.deque(maxlen=MARKER_LIMIT)
            self._layers = LayerView([], [], [], [], None, None)
            self._ranks: RankView | None = None
            self._events: collections.deque[dict] = collections.deque(maxlen=EVENT_LIMIT)
            self._events_seen = 0
            self._error: dict | None = None
            self._version = 0
            self._rate_window: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)

    def set_state(self, state: RunState) -> None:
        with self._lock:
            self._state = state
            self._version += 1

    def feed(self, record: dict) -> None:
        kind = record.get("type")
        with self._lock:
            self._version += 1
            self._in_force = next_in_force(self._in_force, record)
            if kind == "header":
                self._header = dict(record)
                self._layers = LayerView(list(record.get("layers", [])), [], [], [], None, None)
            elif kind == "step":
                self._feed_step(record)
            elif kind == "event":
                self._feed_event(record)
            elif kind == "end":
                self._state = next_state(self._state, record)

    def _feed_step(self, r: dict) -> None:
        self._last = r
        step = int(r.get("step", 0))
        h = self._history
        if r.get("skipped"):
            self._skipped.append(step)
        if step % h.stride == 0:
            h.steps.append(step)
            h.loss.append(read_float(r.get("loss")))
            h.scale.append(read_float(r.get("scale")))
            if len(h.steps) > self._points:
                h.stride *= 2
                keep = [i for i, s in enumerate(h.steps) if s % h.stride == 0]
                h.steps = [h.steps[i] for i in keep]
                h.loss = [h.loss[i] for i in keep]
                h.scale = [h.scale[i] for i in keep]
        layers = r.get("layers")
        if isinstance(layers, dict):
            n = len(self._layers.names)
            weight, weight_step = read_floats(layers.get("weight"), n), None
            if "weight" not in layers and self._layers.step is not None:   # the last weights known
                known = self._layers
                weight, weight_step = known.weight, known.step if known.weight_step is None else known.weight_step
            self._layers = LayerView(
                self._layers.names,
                read_floats(layers.get("act"), n), read_floats(layers.get("grad"), n),
                weight, step, r.get("dtype"), weight_step, read_floats(layers.get("eta"), n),
                fp8_rows(layers, n))
        ranks = rank_view(r)
        if ranks is not None:
            self._ranks = ranks
        t = r.get("time")
        if isinstance(t, (int, float)):
            self._rate_window.append((step, float(t)))
        self._state = next_state(self._state, r)

    def _feed_event(self, e: dict) -> None:
        self._events.append(e)
        self._events_seen += 1
        kind = e.get("kind")
        if kind in MARKER_EVENTS:
            self._interventions.append(int(e.get("step", 0)))
        elif kind == "error" and e.get("during") == "step":
            self._error = e
        self._state = next_state(self._state, e)

    def snapshot(self, **extra) -> Snapshot:
        with self._lock:
            return Snapshot(
                mode=self.mode, header=dict(self._header), state=self._state, last=self._last,
                total_steps=self._header.get("steps"), steps_per_second=self._rate(),
                history=self._history_copy(), layers=self._layers, events=list(self._events),
                events_seen=self._events_seen, error=self._error, version=self._version,
                ranks=self._ranks, in_force=self._in_force, **extra)

    def _history_copy(self) -> History:
        h = self._history
        return History(list(h.steps), list(h.loss), list(h.scale), list(self._skipped),
                       list(self._interventions), h.stride)

    def _rate(self) -> float:
        w = self._rate_window
        if len(w) < 2:
            return 0.0
        (s0, t0), (s1, t1) = w[0], w[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0


def fp8_rows(layers: dict, n: int) -> list[list[float | None] | None]:
    """A step record's fp8 amax rows (`layers.fp8`), or none when the step ran nothing in fp8."""
    return read_float_rows(layers["fp8"], n, 3) if "fp8" in layers else []


def rank_view(record: dict) -> RankView | None:
    """The per-rank figures of a step record (None: it has none, a one-rank run's never do)."""
    loss = record.get("rank_loss")
    if not isinstance(loss, list):
        return None
    n = min(len(loss), MAX_RANKS)
    step = record.get("step")
    return RankView(step if isinstance(step, int) else None, read_floats(loss, n),
                    read_floats(record.get("rank_step_time"), n))
