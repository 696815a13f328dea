"""A session as TensorBoard event files: written live from a run's records, or from a recording.

`TensorBoardObserver(logdir)` takes the records a recorder hands its observers (header, step,
event, end: the dicts amp_tui.recording.format writes) one at a time, so it can follow any run
(`run.observers.append(TensorBoardObserver("tb/run1"))`); `amp-tui export --tensorboard` feeds
the same writer a recording (amp_tui.recording.export). Both write the same thing:

- scalars: `train/loss`, `train/grad_norm`, `train/lr`, `amp/loss_scale_log2`, `amp/skipped`
  (1 on a skipped update), `amp/skipped_total`, `amp/updates_applied`, `amp/min_headroom_bits`
  (the least over the layers); with several ranks, `ranks/R/loss` and `ranks/R/step_time` for
  each rank R;
- per layer, grouped by layer: `layer.NAME/max_abs_act`, `max_abs_grad`, `max_abs_weight` and
  `headroom_bits` (against the dtype in force at that step; see amp_tui.recording.figures);
- every event as text at its step, under `events/KIND` (interventions, non-finite steps with
  the module they started in, alerts, checkpoints, notes with their text...), and the run's
  command under `run/header`.

A value the step did not measure is left out; a non-finite one is written as it is (NaN, inf).
The events are TensorBoard's own protocol buffers (tensorboard.compat.proto) in its record
framing; the checksums come from google-crc32c, since the tensorboard package's writer computes
them in pure Python (about 0.9 ms for one 50-layer step, 90 s for a 100,000-step session). An
export, which no run waits for, takes the pure-Python ones when google-crc32c is missing
(`allow_slow_checksums`); a live writer refuses to start without it.
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
from amp_tui.core.records import note_text
from amp_tui.core.text import one_line
from amp_tui.recording.extras import MissingExtra, require
from amp_tui.recording.figures import FIGURES, InForceTracker, layer_figures

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


SLOW_CHECKSUMS = ("google_crc32c is not installed: the TensorBoard checksums are computed in pure "
                  "Python, which is slower (about 1 ms a step of a 50-layer model); pip install "
                  "'amp-tui[tensorboard]' for the fast ones")


def _protos(allow_slow_checksums: bool = False):
    """TensorBoard's protocol buffers and a CRC-32C function, and whether that is the slow
    pure-Python one (only where `allow_slow_checksums`); MissingExtra names the extra."""
    what = "TensorBoard export"
    event_pb2 = require("tensorboard.compat.proto.event_pb2", EXTRA, what)
    summary_pb2 = require("tensorboard.compat.proto.summary_pb2", EXTRA, what)
    text = require("tensorboard.plugins.text.summary_v2", EXTRA, what)
    try:
        crc = require("google_crc32c", EXTRA, what).value
        slow = False
    except MissingExtra:
        if not allow_slow_checksums:
            raise
        crc = require("tensorboard.compat.tensorflow_stub.pywrap_tensorflow", EXTRA, what).crc32c
        slow = True
    return event_pb2, summary_pb2, text.text_pb, crc, slow


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
        self.write_bytes(event.SerializeToString())

    def write_bytes(self, data: bytes) -> None:
        """One serialized Event."""
        head = struct.pack("<Q", len(data))
        self._fh.write(b"".join((head, struct.pack("<I", self._masked_crc(head)), data,
                                 struct.pack("<I", self._masked_crc(data)))))

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


class FixedSummary:
    """The serialized `Summary` of a fixed list of tags, each with a simple (float) value, filled
    in by position: a step of a 50-layer model costs one array copy instead of 200 protocol
    buffer attribute sets (most of the writer's time otherwise).

    The bytes are those protobuf writes: a repeated field is its elements one after the other,
    each `0x0a`, its length, then the Value, whose float comes last (field 2, fixed32). They are
    compared with the library's own serialization when built, and the first event made from
    them is parsed back (`check`): ValueError if either differs."""

    def __init__(self, tags: list[str], summary_pb2):
        value = summary_pb2.Summary.Value
        chunks, positions, offset = [], [], 0
        for tag in tags:
            body = value(tag=tag, simple_value=0.0).SerializeToString()
            if body[-5] != 0x15:
                raise ValueError(f"unexpected encoding of a simple value: {body!r}")
            chunk = b"\x0a" + _varint(len(body)) + body
            positions.append(offset + len(chunk) - 4)
            chunks.append(chunk)
            offset += len(chunk)
        self._bytes = b"".join(chunks)
        reference = summary_pb2.Summary(value=[value(tag=t, simple_value=0.0) for t in tags])
        if reference.SerializeToString() != self._bytes:
            raise ValueError("the Summary is not encoded as expected")
        self._index = (np.asarray(positions, dtype=np.int64)[:, None] + np.arange(4)).ravel()
        self._field = b"\x2a" + _varint(len(self._bytes))    # Event.summary: field 5, length-delimited
        self.tags = list(tags)
        self.checked = False

    def check(self, data: bytes, values: np.ndarray, event_pb2) -> None:
        """The first event made from these bytes reads back as its values, and protobuf writes it
        the same way; else ValueError (a protobuf that encodes otherwise)."""
        event = event_pb2.Event.FromString(data)
        read = np.array([v.simple_value for v in event.summary.value], dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            want = values.astype(np.float32)
        if [v.tag for v in event.summary.value] != self.tags or event.SerializeToString() != data \
                or not np.array_equal(read, want, equal_nan=True):
            raise ValueError("an event made from a FixedSummary does not read back as written")
        self.checked = True

    def event_tail(self, values: np.ndarray) -> bytes:
        """The Event's `summary` field holding `values` (one per tag), as bytes that follow the
        Event's own fields (wall_time, step: fields 1 and 2)."""
        buf = np.frombuffer(self._bytes, dtype=np.uint8).copy()
        with np.errstate(over="ignore", invalid="ignore"):
            buf[self._index] = values.astype("<f4").view(np.uint8)
        return self._field + buf.tobytes()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class TensorBoardWriter:
    """Records to event files (a write error raises OSError; `TensorBoardObserver` is the live,
    forgiving one). A new file starts at the first record after an end record.
    `allow_slow_checksums`: without google-crc32c, compute the checksums in pure Python
    (`slow_checksums` then says so) instead of raising MissingExtra."""

    def __init__(self, logdir: str | Path, *, allow_slow_checksums: bool = False):
        self.logdir = Path(logdir)
        (self._event_pb2, self._summary_pb2, self._text_pb, self._crc32c,
         self.slow_checksums) = _protos(allow_slow_checksums)
        self._file: EventFile | None = None
        self._names: list[str] = []
        self._in_force = InForceTracker()   # the fp32 layers' headroom is to fp32's max
        self._tags: list[str] = []
        self._templates: dict[tuple, FixedSummary] = {}   # by the step's tags (see _encode)
        self._fixed = True               # FixedSummary passed its checks (else protobuf builds each event)
        self._table: np.ndarray | None = None
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
        self._in_force.observe(record)
        if kind == "end":
            self.close()
            self.records += 1
            return
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
        in_force = self._in_force.in_force
        lines = [f"script: {header.get('script')}", f"dtype: {header.get('dtype')}",
                 f"init_scale: {header.get('init_scale')}", f"layers: {len(self._names)}",
                 f"fp32 modules: {', '.join(in_force.fp32_modules) or 'none'}",
                 f"scale floor: {in_force.scale_floor:g}"
                 + (" (amp-tui's default)" if in_force.min_scale is None else " (--min-scale)")]
        if isinstance(command, list):
            lines.insert(0, "command: " + " ".join(str(a) for a in command))
        self._text("run/header", "  \n".join(_markdown(line) for line in lines), 0, header.get("started"))

    def _set_names(self, names: list[str]) -> None:
        self._names = names
        self._tags = [layer_tag(n, t) for n in names for t in LAYER_TAGS]
        self._templates.clear()

    def _step(self, r: dict) -> None:
        step = r.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return
        wall = _wall(r.get("time"))
        tags, values = [], []
        for tag, key in (("train/loss", "loss"), ("train/grad_norm", "grad_norm"), ("train/lr", "lr")):
            value = read_float(r.get(key))
            if value is not None:
                tags.append(tag)
                values.append(value)
        scale = read_float(r.get("scale"))
        if scale is not None:
            tags.append("amp/loss_scale_log2")
            values.append(math.log2(scale) if scale > 0 else -math.inf)
        tags.append("amp/skipped")
        values.append(1.0 if r.get("skipped") is True else 0.0)
        for tag, key in (("amp/skipped_total", "skipped_total"), ("amp/updates_applied", "updates")):
            value = read_float(r.get(key))
            if value is not None:
                tags.append(tag)
                values.append(value)
        for name, key in (("loss", "rank_loss"), ("step_time", "rank_step_time")):
            per_rank = r.get(key)   # several ranks: each one's figure of this step
            for rank, v in enumerate(per_rank if isinstance(per_rank, list) else ()):
                value = read_float(v)
                if value is not None:
                    tags.append(f"ranks/{rank}/{name}")
                    values.append(value)
        figures = None
        layers = r.get("layers")
        if isinstance(layers, dict):
            if not self._names:      # no header seen: name the layers by position
                acts = layers.get("act")
                self._set_names([f"{i}" for i in range(len(acts))] if isinstance(acts, list) else [])
            figures = layer_figures(r, len(self._names), self._in_force.fp32)
            if figures is not None:
                worst = _least(figures.headroom)
                if worst is not None:
                    tags.append("amp/min_headroom_bits")
                    values.append(worst)
        # The usual step (every figure measured) is one event of one Summary made once for its
        # tags; a step with unmeasured figures gets its layers' event apart.
        whole = figures is not None and all(figures.get(name).missing is None for name in FIGURES)
        numbers = np.array(values)
        if whole:
            tags += self._tags
            numbers = np.concatenate((numbers, self._layer_values(figures)))
        self._file.write_bytes(self._encode(tags, numbers, step, wall))
        if figures is not None and not whole:
            self._layers(figures, step, wall)

    def _encode(self, tags: list[str], numbers: np.ndarray, step: int, wall: float) -> bytes:
        """An Event of simple values: filled in the bytes of a FixedSummary made once for these
        tags, or built with protobuf when a FixedSummary fails its check."""
        head = self._event_pb2.Event(wall_time=wall, step=step)
        key = tuple(tags)
        template = self._templates.get(key) if self._fixed else None
        if template is None and self._fixed:
            try:
                template = self._templates[key] = FixedSummary(tags, self._summary_pb2)
            except ValueError:
                self._fixed = False
        if template is not None:
            data = head.SerializeToString() + template.event_tail(numbers)
            if template.checked:
                return data
            try:
                template.check(data, numbers, self._event_pb2)
                return data
            except ValueError:
                self._fixed = False
        add = head.summary.value.add
        for tag, value in zip(tags, numbers.tolist()):
            add(tag=tag, simple_value=value)
        return head.SerializeToString()

    def _layer_values(self, figures) -> np.ndarray:
        """The layers' values in the order of their tags (a row per layer, LAYER_TAGS order)."""
        if self._table is None or len(self._table) != len(self._names):
            self._table = np.empty((len(self._names), len(LAYER_TAGS)))
        table = self._table
        for j, name in enumerate(FIGURES):
            table[:, j] = figures.get(name).values
        table[:, 3] = figures.headroom
        return table.ravel()

    def _layers(self, figures, step: int, wall: float) -> None:
        """The layers' event of a step with unmeasured figures: only what was measured."""
        columns = [figures.get(name) for name in FIGURES]
        event = self._event_pb2.Event(wall_time=wall, step=step)
        add = event.summary.value.add
        tags = iter(self._tags)
        for i, h in enumerate(figures.headroom.tolist()):
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
        message = note_text(e) if kind == "note" else str(e.get("message", ""))
        lines = [_markdown(one_line(message, TEXT_CHARS))]
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
