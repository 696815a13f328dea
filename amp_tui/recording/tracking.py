"""A session as an experiment tracker sees it (W&B, MLflow): the records a run hands its observers,
or a recording's, turned into metric rows and event rows, and handed to the tracker in batches.

What is logged, the same for both trackers (amp_tui.recording.wandb_log, mlflow_log):

- every step: `amp/loss`, `amp/loss_scale`, `amp/skipped` (1 on a skipped update),
  `amp/skipped_total`, `amp/updates_applied`, and where the step has them `amp/grad_norm`,
  `amp/lr`, `amp/step_time`, `amp/ranks/R/loss` and `amp/ranks/R/step_time`;
- on probed steps, per layer, the *unscaled* figures: `amp/layers/NAME/max_abs_act`,
  `max_abs_grad`, `max_abs_weight` and `headroom_bits` (against the dtype in force at that step,
  amp_tui.recording.figures), and `amp/min_headroom_bits`, the least over the layers;
- the dtype in force (W&B: `amp/dtype` at each change; MLflow: the `amp/dtype` tag);
- every event (non-finite steps with their op and fix, alerts, forecasts, interventions and the
  autopilot's decisions, checkpoints, notes) as an `EventRow`, which each tracker shows its way;
- at the end, the session file itself as an artifact.

A live observer (`TrackingObserver`) takes each record on the training thread by putting it on a
queue; a thread of its own does the rest, so the training step pays for a queue put, and the
tracker's library its batches (one call a second at most, or at an event).
"""

from __future__ import annotations

import math
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from amp_tui.core.jsonsafe import read_float
from amp_tui.core.records import note_text
from amp_tui.core.text import one_line
from amp_tui.recording.figures import FIGURES, InForceTracker, layer_figures

PREFIX = "amp/"
FLUSH_INTERVAL_S = 1.0     # the steps reach the tracker at least this often; events at once
END_WAIT_S = 60.0          # at the run's end, how long the training thread waits for the last batch
LAYER_FIGURES = {"act": "max_abs_act", "grad": "max_abs_grad", "weight": "max_abs_weight"}
STEP_FIGURES = (("loss", "loss"), ("scale", "loss_scale"), ("skipped_total", "skipped_total"),
                ("updates", "updates_applied"), ("grad_norm", "grad_norm"), ("lr", "lr"),
                ("duration", "step_time"))
# The event kinds a tracker raises as an alert (W&B) and their level; the others are only rows.
ALERT_LEVELS = {"nonfinite": "ERROR", "error": "ERROR", "alert": "WARN", "stopping": "WARN",
                "forecast": "INFO"}
# The event fields that follow its message in the event's text, when the event has them.
EVENT_DETAILS = ("where", "layer", "op", "op_module", "origin", "action", "value", "before", "after",
                 "source", "client", "reason", "cause", "fix", "path", "checkpoint_step")
TEXT_CHARS = 4000
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. :/]")


def layer_key(name: str, figure: str) -> str:
    """A layer's metric name: the characters both trackers accept (MLflow takes no brackets)."""
    return f"{PREFIX}layers/{_UNSAFE.sub('_', name) or '_root_'}/{figure}"


@dataclass(frozen=True)
class EventRow:
    step: int
    kind: str
    message: str
    details: dict            # EVENT_DETAILS the event has, as one-line strings
    time: float

    @property
    def alert_level(self) -> str | None:
        """The level to alert at (None: a row, not an alert). An autopilot's own decision is an
        alert too: it changed the run without anyone asking."""
        if self.kind == "intervention" and self.details.get("source") in ("autopilot", "fallback"):
            return "WARN"
        return ALERT_LEVELS.get(self.kind)

    @property
    def title(self) -> str:
        return f"amp-tui: {self.kind}"

    def text(self) -> str:
        lines = [self.message] + [f"{key}: {value}" for key, value in self.details.items()]
        return "\n".join(lines)[:TEXT_CHARS]

    def as_dict(self) -> dict:
        return {"step": self.step, "kind": self.kind, "message": self.message, "time": self.time,
                **self.details}


class TrackerBackend(Protocol):
    """One tracker's run (see wandb_log.WandbBackend, mlflow_log.MlflowBackend)."""

    name: str         # "W&B", "MLflow", in messages
    owned: bool       # amp-tui opened the run (so ends it); False: the framework's own run

    def log_header(self, params: dict[str, str]) -> None: ...
    def log_steps(self, rows: list[tuple[int, float, dict[str, float]]]) -> None: ...
    def log_dtype(self, dtype: str, step: int, time: float) -> None: ...
    def log_events(self, rows: list[EventRow]) -> None: ...
    def finish(self, events: list[EventRow], session: Path | None, status: str) -> None: ...


def header_params(header: dict) -> dict[str, str]:
    """The header's fields a tracker keeps as the run's parameters (strings, for both)."""
    keys = ("script", "way", "dtype", "init_scale", "steps", "accumulate", "max_grad_norm", "probe_every",
            "probe_budget", "on_nonfinite", "optimizer", "scheduler", "parameters", "world_size", "host",
            "amp_tui_version", "torch_version", "started")
    params = {key: one_line(str(header[key]), 500) for key in keys if header.get(key) is not None}
    layers = header.get("layers")
    if isinstance(layers, list):
        params["layers"] = str(len(layers))
    return params


class TrackingWriter:
    """Records to a tracker, in batches: steps every FLUSH_INTERVAL_S (or `batch_steps` steps, for
    an export that no run waits on), events at once. `write`, `finish` and `discard` are an
    export's sink (amp_tui.recording.export); the live observer wraps it in a thread."""

    def __init__(self, backend: TrackerBackend, *, session: Path | None = None,
                 flush_interval: float = FLUSH_INTERVAL_S, batch_steps: int = 1_000_000):
        self.backend = backend
        self.session = session
        self._flush_interval = flush_interval
        self._batch_steps = batch_steps
        self._in_force = InForceTracker()
        self._names: list[str] = []
        self._keys: list[tuple[str, str, str, str]] = []
        self._rows: list[tuple[int, float, dict[str, float]]] = []
        self._events: list[EventRow] = []       # all of them, for the run's table at the end
        self._new_events: list[EventRow] = []
        self._dtype: str | None = None
        self._flushed = time.monotonic()
        self._status = "KILLED"                 # until an end record says how it ended
        self.finished = False
        self.steps = 0

    def write(self, record: dict, line: bytes | None = None) -> None:
        kind = record.get("type")
        self._in_force.observe(record)
        if kind == "header":
            layers = record.get("layers")
            self._set_names([str(n) for n in layers] if isinstance(layers, list) else [])
            self.backend.log_header(header_params(record))
        elif kind == "step":
            self._step(record)
        elif kind == "event":
            row = event_row(record)
            if row is not None:
                self._events.append(row)
                self._new_events.append(row)
                self.flush()
        elif kind == "end":
            # A run stopped on request ended as it should; one that failed, or lost records, did not.
            self._status = ("FINISHED" if record.get("status") in ("finished", "stopped")
                            and not record.get("unwritten") else "FAILED")
            self.finish()
            return
        if self._rows and (len(self._rows) >= self._batch_steps
                           or time.monotonic() - self._flushed >= self._flush_interval):
            self.flush()

    def flush(self) -> None:
        rows, self._rows = self._rows, []
        events, self._new_events = self._new_events, []
        if rows:
            self.backend.log_steps(rows)
        if events:
            self.backend.log_events(events)
        self._flushed = time.monotonic()

    def finish(self) -> None:
        """The last batch, the events' table, the session as an artifact; the run ended if ours."""
        if self.finished:
            return
        self.finished = True
        self.flush()
        self.backend.finish(self._events, self.session, self._status)

    def discard(self) -> None:
        """An export that failed: what was logged stays, the run ends as failed."""
        self._status = "FAILED"
        self.finish()

    def _set_names(self, names: list[str]) -> None:
        self._names = names
        self._keys = [tuple(layer_key(n, f) for f in (*LAYER_FIGURES.values(), "headroom_bits")) for n in names]

    def _step(self, r: dict) -> None:
        step = r.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return
        wall = read_float(r.get("time"))
        wall = wall if wall is not None and math.isfinite(wall) else time.time()
        metrics: dict[str, float] = {}
        for field, name in STEP_FIGURES:
            value = read_float(r.get(field))
            if value is not None:
                metrics[PREFIX + name] = value
        metrics[PREFIX + "skipped"] = 1.0 if r.get("skipped") is True else 0.0
        for name, field in (("loss", "rank_loss"), ("step_time", "rank_step_time")):
            per_rank = r.get(field)
            for rank, v in enumerate(per_rank if isinstance(per_rank, list) else ()):
                value = read_float(v)
                if value is not None:
                    metrics[f"{PREFIX}ranks/{rank}/{name}"] = value
        self._layers(r, metrics)
        dtype = r.get("dtype")
        if isinstance(dtype, str) and dtype != self._dtype:
            self._dtype = dtype
            self.backend.log_dtype(dtype, step, wall)
        self._rows.append((step, wall, metrics))
        self.steps += 1

    def _layers(self, r: dict, metrics: dict[str, float]) -> None:
        layers = r.get("layers")
        if not isinstance(layers, dict):
            return
        if not self._names:      # no header seen: name the layers by position
            acts = layers.get("act")
            self._set_names([str(i) for i in range(len(acts))] if isinstance(acts, list) else [])
        figures = layer_figures(r, len(self._names), self._in_force.fp32)
        if figures is None:
            return
        columns = [figures.get(name) for name in FIGURES]
        values = [column.values.tolist() for column in columns]
        headroom = figures.headroom.tolist()
        for i, keys in enumerate(self._keys):
            for j, column in enumerate(columns):
                if column.measured(i):
                    metrics[keys[j]] = values[j][i]
            if not math.isnan(headroom[i]):
                metrics[keys[3]] = headroom[i]
        measured = [h for h in headroom if not math.isnan(h)]
        if measured:
            metrics[PREFIX + "min_headroom_bits"] = min(measured)


def event_row(e: dict) -> EventRow | None:
    step = e.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    kind = one_line(str(e.get("kind")), 64)
    message = note_text(e) if kind == "note" else str(e.get("message", ""))
    details = {key: one_line(str(e[key]), 500) for key in EVENT_DETAILS if e.get(key) is not None}
    wall = read_float(e.get("time"))
    return EventRow(step, kind, one_line(message, TEXT_CHARS), details,
                    wall if wall is not None and math.isfinite(wall) else time.time())


class TrackingObserver:
    """A run's observer that hands its records to a tracker from a thread of its own (see the
    module docstring). A tracker that fails is reported once on stderr and the logging ends; the
    run and its session go on. At the end record the training thread waits (END_WAIT_S at most)
    for the last batch and the artifact."""

    def __init__(self, writer: TrackingWriter):
        self.writer = writer
        self.error: str | None = None
        self.busy_s = 0.0          # CPU time the observer's thread has spent on the records
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._work, name=f"amp-tui {writer.backend.name}", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self.writer.backend.name

    def __call__(self, record: dict) -> None:
        if self.error is not None or self._done.is_set():
            return
        self._queue.put(record)
        if record.get("type") == "end":
            self._done.wait(END_WAIT_S)

    def close(self, timeout: float = END_WAIT_S) -> None:
        """End the logging where no end record came (the run's session never opened)."""
        if not self._done.is_set():
            self._queue.put(None)
            self._done.wait(timeout)

    def _work(self) -> None:
        writer = self.writer
        try:
            while True:
                try:
                    record = self._queue.get(timeout=FLUSH_INTERVAL_S)
                except queue.Empty:
                    record = False
                started = time.thread_time()
                try:
                    if record is False:
                        writer.flush()
                    elif record is None:
                        writer.finish()
                    else:
                        writer.write(record)
                finally:
                    self.busy_s += time.thread_time() - started
                if writer.finished:
                    return
        except Exception as exc:  # noqa: BLE001 - the tracker's library, whatever it raises
            self.error = one_line(f"{type(exc).__name__}: {exc}", 300)
            print(f"amp-tui: {self.name} logging stopped: {self.error} (the run and its session go on)",
                  file=sys.stderr)
        finally:
            self._done.set()
