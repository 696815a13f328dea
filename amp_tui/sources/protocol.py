"""What the dashboard reads: one interface for a live run and for a recorded session.

A producer (the training thread, or a file reader) calls `RunBuffer.feed(record)` with each record;
the UI calls `snapshot()` on its own timer. Nothing here imports Textual.

Memory stays bounded however long the run: the chart history is decimated (every other point is
dropped when it fills up, and from then on only every 2nd, 4th, ... step is kept), the event list
and the marker lists are capped.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from amp_tui.core.jsonsafe import read_float, read_floats

if TYPE_CHECKING:
    from amp_tui.core.commands import Command

HISTORY_POINTS = 2048
EVENT_LIMIT = 1000
MARKER_LIMIT = 2048
TRAINING_SWITCH_INTERVAL_S = 0.0005  # GIL hand-over while a UI shares the process with training


@dataclass
class History:
    """Chart series, decimated to at most HISTORY_POINTS points."""

    steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    scale: list[float | None] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)      # markers: updates not applied
    intervention_steps: list[int] = field(default_factory=list)  # markers: interventions/restores
    stride: int = 1

    def copy(self) -> "History":
        return History(list(self.steps), list(self.loss), list(self.scale), list(self.skipped_steps),
                       list(self.intervention_steps), self.stride)


@dataclass
class LayerView:
    """The newest per-layer figures (from the last probed step)."""

    names: list[str]
    act: list[float | None]
    grad: list[float | None]
    weight: list[float | None]
    step: int | None
    dtype: str | None


@dataclass
class Snapshot:
    mode: str                       # "live" or "replay"
    header: dict
    state: str                      # starting/running/paused/stopped/finished/error
    last: dict | None               # newest step record
    total_steps: int | None
    steps_per_second: float
    history: History
    layers: LayerView
    events: list[dict]              # newest last, capped
    events_seen: int                # total events fed so far (to find new ones)
    error: dict | None              # the newest error event with a traceback
    version: int                    # bumps on every fed record
    position: int | None = None     # replay: the step shown
    notice: str | None = None       # replay: e.g. "3 damaged lines skipped"


class RunBuffer:
    """Thread-safe collector of records; producers feed, the UI takes snapshots."""

    def __init__(self, mode: str = "live", history_points: int = HISTORY_POINTS):
        self.mode = mode
        self._lock = threading.Lock()
        self._points = history_points
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._header: dict = {}
            self._state = "starting"
            self._last: dict | None = None
            self._history = History()
            self._layers = LayerView([], [], [], [], None, None)
            self._events: collections.deque[dict] = collections.deque(maxlen=EVENT_LIMIT)
            self._events_seen = 0
            self._error: dict | None = None
            self._version = 0
            self._rate_window: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)

    def set_state(self, state: str) -> None:
        with self._lock:
            self._state = state
            self._version += 1

    def feed(self, record: dict) -> None:
        kind = record.get("type")
        with self._lock:
            self._version += 1
            if kind == "header":
                self._header = dict(record)
                self._layers = LayerView(list(record.get("layers", [])), [], [], [], None, None)
            elif kind == "step":
                self._feed_step(record)
            elif kind == "event":
                self._feed_event(record)
            elif kind == "end":
                self._state = {"finished": "finished", "error": "error"}.get(record.get("status"), "stopped")

    def _feed_step(self, r: dict) -> None:
        self._last = r
        step = int(r.get("step", 0))
        h = self._history
        if r.get("skipped"):
            _capped_append(h.skipped_steps, step)
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
            self._layers = LayerView(
                self._layers.names,
                read_floats(layers.get("act"), n), read_floats(layers.get("grad"), n), read_floats(layers.get("weight"), n),
                step, r.get("dtype"))
        t = r.get("time")
        if isinstance(t, (int, float)):
            self._rate_window.append((step, float(t)))
        if self._state == "starting":
            self._state = "running"

    def _feed_event(self, e: dict) -> None:
        self._events.append(e)
        self._events_seen += 1
        kind = e.get("kind")
        if kind in ("intervention", "checkpoint_restored"):
            _capped_append(self._history.intervention_steps, int(e.get("step", 0)))
            after = e.get("after")
            if isinstance(after, dict) and after.get("state") in ("paused", "running", "stopped"):
                self._state = after["state"]
        elif kind == "paused":
            self._state = "paused"
        elif kind == "error" and e.get("during") == "step":
            self._error = e
            self._state = "error"

    def snapshot(self, **extra) -> Snapshot:
        with self._lock:
            return Snapshot(
                mode=self.mode, header=dict(self._header), state=self._state, last=self._last,
                total_steps=self._header.get("steps"), steps_per_second=self._rate(),
                history=self._history.copy(), layers=self._layers, events=list(self._events),
                events_seen=self._events_seen, error=self._error, version=self._version, **extra)

    def _rate(self) -> float:
        w = self._rate_window
        if len(w) < 2:
            return 0.0
        (s0, t0), (s1, t1) = w[0], w[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0


class Source(Protocol):
    """What the dashboard needs; LiveSource and the replay source implement it."""

    mode: str

    def snapshot(self) -> Snapshot: ...

    def send(self, command: Command) -> tuple[bool, str]:
        """Ask for an intervention: (accepted, message). A replay refuses with a reason."""

    def checkpoints(self) -> list: ...

    def start(self) -> None: ...

    def stop(self, timeout: float = 10.0, *, give_up_unwritten: bool = False) -> bool:
        """Stop at a step boundary and flush; False if it did not stop within `timeout`, or if
        the stop was held because the disk refuses records (`held_stop()` says what would be
        lost). `give_up_unwritten`: stop even so."""

    def held_stop(self) -> str | None:
        """Why the last stop was held (records a full disk refused), or None."""


class LiveSource:
    """A Run on its own training thread (a plain thread: a Textual worker can't be stopped)."""

    mode = "live"

    def __init__(self, run):
        self.run = run
        # Someone is watching: a full disk pauses the run, to be resumed once space is freed,
        # instead of stopping it as headless does.
        run.config.on_io_error = "pause"
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

    def wait(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.alive


def _capped_append(values: list[int], value: int) -> None:
    values.append(value)
    if len(values) > MARKER_LIMIT:
        del values[: len(values) - MARKER_LIMIT]
