"""A session as TensorBoard event files: written live from a run's records, or from a recording.

`TensorBoardObserver(logdir)` takes the records a recorder hands its observers (header, step,
event, end: the dicts amp_tui.recording.format writes) one at a time, so it can follow any run
(`run.observers.append(TensorBoardObserver("tb/run1"))`); `amp-tui export --tensorboard` feeds
the same writer a recording (amp_tui.recording.export). Both write the same thing:

- scalars: `train/loss`, `train/grad_norm`, `train/lr`, `amp/loss_scale_log2`, `amp/skipped`
  (1 on a skipped update), `amp/skipped_total`, `amp/updates_applied`, `amp/min_headroom_bits`
  (the least over the layers);
- per layer, grouped by layer: `layer.NAME/max_abs_act`, `max_abs_grad`, `max_abs_weight` and
  `headroom_bits` (against the dtype in force at that step; see amp_tui.recording.figures);
- every event as text at its step, under `events/KIND` (interventions, non-finite steps with
  the module they started in, alerts, checkpoints...), and the run's command under `run/header`.

A value the step did not measure is left out; a non-finite one is written as it is (NaN, inf).
The events are TensorBoard's own protocol buffers (tensorboard.compat.proto) in its record
framing; the checksums come from google-crc32c, since the tensorboard package's writer computes
them in pure Python (about 0.9 ms for one 50-layer step, 90 s for a 100,000-step session).
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np

from amp_tui.core.jsonsafe import read_float
from amp_tui.core.text import one_line
from amp_tui.recording.extras import require
from amp_tui.recording.figures import FIGURES, layer_figures

EXTRA = "tensorboard"
FLUSH_INTERVAL_S = 1.0         # step records reach the file at least this often; events at once
WRITE_BUFFER = 1 << 20         # bytes buffered before a write (a 50-layer step is about 9 KB)
TEXT_CHARS = 4000              # characters of one event's text at most
LAYER_TAGS = ("max_abs_act", "max_abs_grad", "max_abs_weight", "headroom_bits")
# The event fields shown under its message, when the event has them.
EVENT_DETAILS = ("where", "layer", "origin", "origin_input_nonfinite", "backward_origin", "action",
                 "value", "source", "reason", "cause", "fix", "path", "checkpoint_step")
_MARKDOWN = str.maketrans({c: "\\" + c for c in "\\`*_[]<>|~#"})
_file_numbers = itertools.count()


def _protos():
    """TensorBoard's protocol buffers and a fast CRC-32C, or MissingExtra naming the extra."""
    what = "TensorBoard export"
    event_pb2 = require("tensorboard.compat.proto.event_pb2", EXTRA, what)
    summary_pb2 = require("tensorboard.compat.proto.summary_pb2", EXTRA, what)
    text = require("tensorboard.plugins.text.summary_v2", EXTRA, what)
    crc = require("google_crc32c", EXTRA, what)
    return event_pb2, summary_pb2, text.text_pb, crc.value


def check_available() -> None:
    """Raise MissingExtra unless the TensorBoard writer can be built (its packages are installed)."""
    _protos()


def layer_tag(name: str, figure: str) -> str:
    return f"layer.{name or '(root)'}/{figure}"


class EventFile:
    """One TensorBoard event file in `logdir`: records framed as TensorFlow's record writer frames
    them (length, masked CRC-32C of the length, data, masked CRC-32C of the data)."""

    def __init__(self, logdir: Path, event_pb2, crc32c):
        self._crc32c = crc32c
        logdir.mkdir(parents=True, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_file_numbers)}.amp-tui")
        self.path = logdir / name
        self._fh = open(self.path, "wb", buffering=WRITE_BUFFER)
        self.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def _masked_crc(self, data: bytes) -> int:
        crc = self._crc32c(data)
        return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF

    def write(self, event) -> None:
        data = event.SerializeToString()
        head = struct.pack("<Q", len(data))
        self._fh.write(b"".join((head, struct.pack("<I", self._masked_crc(head)), data,
                                 struct.pack("<I", self._masked_crc(data)))))

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


class TensorBoardWriter:
    """Records to event files (a write error raises OSError; `TensorBoardObserver` is the live,
    forgiving one). A new file starts at the first record after an end record."""

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        self._event_pb2, self._summary_pb2, self._text_pb, self._crc32c = _protos()
        self._file: EventFile | None = None
        self._names: list[str] = []
        self._tags: list[str] = []
        self._template = None            # a layers event reused while every figure is measured
        self._template_values: list = []
        self._flushed = time.monotonic()
        self.records = 0                 # records written
        self.files: list[Path] = []      # event files written, oldest first
        self._open()

    @property
    def path(self) -> Path | None:
        """The event file written now."""
        return self._file.path if self._file is not None else None

    def _open(self) -> None:
        if self._file is None:
            self._file = EventFile(self.logdir, self._event_pb2, self._crc32c)
            self.files.append(self._file.path)
            self._flushed = time.monotonic()

    def write(self, record: dict, line: bytes | None = None) -> None:
        """Write one record (`line`, the step's line in a recording, is not needed here)."""
        kind = record.get("type")
        self._open()
        if kind == "step":
            self._step(record)
            if time.monotonic() - self._flushed >= FLUSH_INTERVAL_S:
                self.flush()
        elif kind == "event":
            self._event(record)
            self.flush()
        elif kind == "header":
            self._header(record)
            self.flush()
        elif kind == "end":
            self.close()
        self.records += 1

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            finally:
                self._file.close()
                self._file = None

    # An export's ending (amp_tui.recording.export): what was written stays, TensorBoard reads
    # an event file up to its last whole record.
    finish = discard = close

    # ---- records ------------------------------------------------------------------------------
    def _header(self, header: dict) -> None:
        layers = header.get("layers")
        self._set_names([str(n) for n in layers] if isinstance(layers, list) else [])
        command = header.get("command")
        lines = [f"script: {header.get('script')}", f"dtype: {header.get('dtype')}",
                 f"init_scale: {header.get('init_scale')}", f"layers: {len(self._names)}"]
        if isinstance(command, list):
            lines.insert(0, "command: " + " ".join(str(a) for a in command))
        self._text("run/header", "  \n".join(_markdown(line) for line in lines), 0, header.get("started"))

    def _set_names(self, names: list[str]) -> None:
        self._names = names
        self._tags = [layer_tag(n, t) for n in names for t in LAYER_TAGS]
        self._template = None

    def _step(self, r: dict) -> None:
        step = r.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return
        wall = _wall(r.get("time"))
        summary = self._summary_pb2.Summary()
        add = summary.value.add
        loss = read_float(r.get("loss"))
        if loss is not None:
            add(tag="train/loss", simple_value=loss)
        for tag, key in (("train/grad_norm", "grad_norm"), ("train/lr", "lr")):
            value = read_float(r.get(key))
            if value is not None:
                add(tag=tag, simple_value=value)
        scale = read_float(r.get("scale"))
        if scale is not None:
            add(tag="amp/loss_scale_log2", simple_value=math.log2(scale) if scale > 0 else -math.inf)
        add(tag="amp/skipped", simple_value=1.0 if r.get("skipped") is True else 0.0)
        for tag, key in (("amp/skipped_total", "skipped_total"), ("amp/updates_applied", "updates")):
            value = read_float(r.get(key))
            if value is not None:
                add(tag=tag, simple_value=value)
        layers = r.get("layers")
        if isinstance(layers, dict):
            if not self._names:      # no header seen: name the layers by position
                acts = layers.get("act")
                self._set_names([f"{i}" for i in range(len(acts))] if isinstance(acts, list) else [])
            figures = layer_figures(r, len(self._names))
            if figures is not None:
                worst = _least(figures.headroom)
                if worst is not None:
                    add(tag="amp/min_headroom_bits", simple_value=worst)
                self._layers(figures, step, wall)
        self._file.write(self._event_pb2.Event(wall_time=wall, step=step, summary=summary))

    def _layers(self, figures, step: int, wall: float) -> None:
        columns = [figures.get(name) for name in FIGURES]
        headroom = figures.headroom
        if all(c.missing is None for c in columns):
            # Every figure measured: one value per tag, set in the event kept from the last step.
            if self._template is None:
                self._template = self._event_pb2.Event()
                add = self._template.summary.value.add
                for tag in self._tags:
                    add(tag=tag, simple_value=0.0)
                self._template_values = list(self._template.summary.value)
                self._table = np.empty((len(self._names), len(LAYER_TAGS)))
            event = self._template
            event.step, event.wall_time = step, wall
            # One row per layer, its tags' values in LAYER_TAGS order: the order of _tags.
            table = self._table
            for j, c in enumerate(columns):
                table[:, j] = c.values
            table[:, 3] = headroom
            for value, x in zip(self._template_values, table.ravel().tolist()):
                value.simple_value = x
            self._file.write(event)
            return
        event = self._event_pb2.Event(wall_time=wall, step=step)
        add = event.summary.value.add
        tags = iter(self._tags)
        for i, h in enumerate(headroom.tolist()):
            for column in columns:
                tag = next(tags)
                if column.measured(i):
                    add(tag=tag, simple_value=float(column.values[i]))
            tag = next(tags)
            if not math.isnan(h):
                add(tag=tag, simple_value=h)
        self._file.write(event)

    def _event(self, e: dict) -> None:
        step = e.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return
        kind = one_line(str(e.get("kind")), 64)
        lines = [_markdown(one_line(str(e.get("message", "")), TEXT_CHARS))]
        for key in EVENT_DETAILS:
            if e.get(key) is not None:
                lines.append(f"{key}: {_markdown(one_line(str(e[key]), 500))}")
        self._text(f"events/{kind}", "  \n".join(lines), step, e.get("time"))

    def _text(self, tag: str, text: str, step: int, wall) -> None:
        event = self._event_pb2.Event(wall_time=_wall(wall), step=step, summary=self._text_pb(tag, text))
        self._file.write(event)


class TensorBoardObserver:
    """A run's observer that writes its records to TensorBoard event files in `logdir` as they
    come (see the module docstring). It flushes at least once a second, at every event and at
    the end record (which also closes the file). A write the disk refuses is reported once on
    stderr and ends the TensorBoard logging; the run and its session go on."""

    def __init__(self, logdir: str | Path):
        self.writer = TensorBoardWriter(logdir)
        self.error: str | None = None

    @property
    def logdir(self) -> Path:
        return self.writer.logdir

    def __call__(self, record: dict) -> None:
        if self.error is not None:
            return
        try:
            self.writer.write(record)
        except OSError as exc:
            self.error = f"{self.writer.path or self.logdir}: {exc.strerror or exc}"
            print(f"amp-tui: TensorBoard logging stopped: cannot write {self.error} (the run and its "
                  "session go on)", file=sys.stderr)
            try:
                self.writer.close()
            except OSError:
                pass

    def close(self) -> None:
        """Flush and close the event file (a run's end record does it too)."""
        if self.error is None:
            self.writer.close()

    def __enter__(self) -> "TensorBoardObserver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wall(value) -> float:
    t = read_float(value)
    return t if t is not None and math.isfinite(t) else time.time()


def _least(bits: np.ndarray) -> float | None:
    """The least headroom of the layers measured (NaN: not measured); None when none was."""
    nan = np.isnan(bits)
    if not nan.any():
        return float(bits.min())
    return None if nan.all() else float(bits[~nan].min())


def _markdown(text: str) -> str:
    """`text` shown as it is by TensorBoard's Markdown text view."""
    return text.translate(_MARKDOWN)
