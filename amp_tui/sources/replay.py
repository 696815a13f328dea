"""Replay a recorded session in the dashboard: a compact index of the file and a `Source` over it.

`SessionIndex` reads `session.jsonl` once and keeps what the charts and the navigation need as
compact arrays (byte offset, step, loss, scale, time and a few flag bytes per step record: about 45
bytes a step, not a dict), plus the header, the end record and the event records. The full record
of a step (its per-layer figures) is read from the file at its offset when the replay shows it.
A step line is indexed from its leading scalar fields, which `session.step_record` writes first
in a fixed order, without parsing the per-layer arrays; any line that doesn't match that shape goes
through the strict, full JSON parse (so does a line that may hold a bare NaN/Infinity token, which
that parse refuses). Like `read_session`, it is tolerant: damaged lines, lines over
`MAX_LINE_BYTES` (read past, never held) and record types it doesn't know are counted and
skipped; a line that doesn't end with a newline yet is left for the next `refresh()` (the writer
may be in the middle of it), which is how `follow` works. Strings longer than TEXT_LIMIT in what
it keeps or reads back are cut in the middle, so a hostile file can't make a replay hold or draw
megabytes of text.

`ReplaySource` implements `amp_tui.sources.protocol.Source` (`mode = "replay"`): the dashboard renders its
`Snapshot`s with the same code as a live run. Playback is driven by `tick()` (called by
`snapshot()` once started, and by the UI's timer if it likes): it advances by elapsed time x speed,
so it does not depend on being called at a regular rate. A record that can't be read where the
replay stands pauses playback and says so in `Snapshot.notice`; nothing here raises during playback.

Positions are step numbers (0-based, as recorded). The snapshot at a position shows what a live
dashboard showed right after that step: the step's record, and every event written before the next
step record (so an intervention applied before step p+1, which carries step p+1, shows at p, as it
did live; at the last step, everything recorded after it too: the final error, pause or stop).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import re
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from amp_tui.core import jsonsafe
from amp_tui.recording.session import (KNOWN_TYPES, MAX_LINE_BYTES, SessionFormatError, check_header,
                             parse_record, resolve_session_path, too_long_message)
from amp_tui.sources.protocol import EVENT_LIMIT, HISTORY_POINTS, MARKER_LIMIT, History, LayerView, Snapshot

if TYPE_CHECKING:
    from amp_tui.core.commands import Command

CHUNK_BYTES = 1 << 20          # the file is read in chunks of this size
# Characters kept of any string in the header or a record (a layer name, a message, a path): the
# writer's longest, a traceback, is 20,000; a longer one (a hostile or damaged file) is cut, so a
# replay never holds or draws megabytes of it.
TEXT_LIMIT = 20_000
EVENT_CACHE = 4096             # parsed nonfinite events kept at most (others are always kept)
RATE_WINDOW = 64               # step records used for the steps-per-second figure

# Flag bits, one byte per step record.
F_SKIPPED = 1
F_LOSS_NONE = 2                # "loss" null or missing
F_SCALE_NONE = 4               # "scale" null (no GradScaler active)
F_NONFINITE_LOSS = 8
F_NONFINITE_GRADIENTS = 16
F_NONFINITE_OTHER = 32


def _step_head(p: bytes) -> re.Pattern:
    """The leading scalar fields of a step line as `step_record` writes them (compact separators).

    Character classes rather than the exact JSON number grammar keep this fast (a few
    microseconds a line); each captured value is then parsed (a bad one sends the line to the full
    parse), and the line is parsed strictly anyway when the replay shows it. `p` is b"+" for
    possessive repeats (Python >= 3.11: no backtracking state to keep, faster) or b"" (3.10).
    Both match the same lines: no repeated class can match the character that follows it."""
    val = rb'(-?[0-9][0-9.eE+-]*' + p + rb'|"[A-Za-z-]+' + p + rb'"|null)'
    return re.compile(
        rb'\{"type":"step","step":([0-9]{1,18}' + p + rb'),"loss":' + val + rb',"scale":' + val
        + rb',"skipped":(true|false),"skipped_total":[0-9]+' + p + rb',"updates":[0-9]+' + p
        + rb',"dtype":"([A-Za-z0-9_]{1,64}' + p + rb')","micro_batches":[0-9]+' + p + rb',"time":' + val
        + rb',"duration":[^,{}]+' + p + rb'((?:,"[a-z_]+' + p + rb'":[^,{}]+' + p + rb')*' + p
        + rb')(,"layers":\{|\})')


try:
    _STEP_HEAD = _step_head(b"+")
except re.error:
    _STEP_HEAD = _step_head(b"")
_SPECIAL = {b'"NaN"': math.nan, b'"Infinity"': math.inf, b'"-Infinity"': -math.inf, b"null": None}
_BAD = object()
_MAX_STEP = 1 << 62            # larger step numbers are damage (and don't fit the arrays)
_NONFINITE_FLAGS = {"loss": F_NONFINITE_LOSS, "gradients": F_NONFINITE_GRADIENTS}

# Events that change what state the recorded run was in.
_STATE_KINDS = ("intervention", "checkpoint_restored", "paused", "error")
_MARKER_KINDS = ("intervention", "checkpoint_restored")


def clipped(value):
    """`value` (a parsed record) with every string, key or value, over TEXT_LIMIT characters cut
    in the middle: its start and its end (a layer's own name, a traceback's last frame) stay."""
    if isinstance(value, str):
        if len(value) <= TEXT_LIMIT:
            return value
        half = TEXT_LIMIT // 2
        return f"{value[:half]}…[{len(value) - 2 * half:,} characters cut]…{value[-half:]}"
    if isinstance(value, dict):
        return {clipped(k): clipped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clipped(v) for v in value]
    return value


def _bare_constant(buf: bytes, start: int, end: int) -> bool:
    """True when buf[start:end] may hold a bare NaN/Infinity token (not JSON: the strict parse
    refuses the line); the quoted strings step_record writes don't count. A step line holds no
    other capital N or I, so most lines cost two byte scans."""
    if buf.find(b"N", start, end) < 0 and buf.find(b"I", start, end) < 0:
        return False
    if buf.find(b"NaN", start, end) >= 0 \
            and buf.count(b"NaN", start, end) != buf.count(b'"NaN"', start, end):
        return True
    if buf.find(b"Infinity", start, end) >= 0:
        quoted = buf.count(b'"Infinity"', start, end) + buf.count(b'"-Infinity"', start, end)
        return buf.count(b"Infinity", start, end) != quoted
    return False


def _number(value) -> float | None:
    """A record value as a float; None for null, missing or not a number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in jsonsafe.NONFINITE_STRINGS:
        return jsonsafe.NONFINITE_STRINGS[value]
    return None


def _new_code(names: list[str], codes: dict, name: str) -> int:
    """A one-byte code for `name`; past 254 distinct names (a hostile file), all share "?"."""
    if len(names) < 254:
        codes[name] = len(names)
        names.append(name)
        return codes[name]
    if "?" not in codes:
        codes["?"] = len(names)
        names.append("?")
    codes[name] = codes["?"]
    return codes["?"]


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


class SessionIndex:
    """A compact, growable index of one session file (see the module docstring).

    Per step record, in file order ("frames"): `offsets`, `lengths` (the line's bytes), `steps`,
    `loss`, `scale` (NaN where the flag says null), `times`, `flags` (F_* bits), `probed` (1 where
    the record has per-layer figures), `dtype_codes` (indices into `dtypes`). Events: `event(k)`,
    `event_steps`, `event_kind(k)`; `end` is the end record or None.
    """

    def __init__(self, target: str | Path, *, follow: bool = False):
        self.path = resolve_session_path(target)
        self.run_dir = self.path.parent
        self.follow = follow
        self.offsets = array("q")
        self.lengths = array("I")
        self.steps = array("q")
        self.loss = array("d")
        self.scale = array("d")
        self.times = array("d")
        self.flags = bytearray()
        self.probed = bytearray()
        self.dtype_codes = bytearray()
        self.dtypes: list[str] = []
        self._dtype_code: dict = {}
        self.skipped_frames = array("q")
        self.event_offsets = array("q")
        self.event_lengths = array("I")
        self.event_frames = array("q")         # step records indexed before each event
        self.event_steps = array("q")
        self.event_kinds = bytearray()
        self.kinds: list[str] = []
        self._kind_code: dict[str, int] = {}
        self._kept: dict[int, dict] = {}       # event index -> record (all but nonfinite ones)
        self._cache: dict[int, dict] = {}      # nonfinite events parsed on demand
        self.state_events = array("q")         # indices of events that change the run's state
        self.marker_events = array("q")        # indices of interventions and restores
        self.loss_none = 0                     # step records without a loss
        self.error_events = array("q")         # indices of error events with during == "step"
        self.end: dict | None = None
        self.damaged_lines = 0                 # damaged and over-long lines
        self.long_lines = 0                    # of which over MAX_LINE_BYTES (skipped unread)
        self._in_long_line = False             # the last refresh stopped inside an over-long line
        self.unknown_records = 0
        self.torn_tail = False                 # the last line is incomplete (not following)
        self.pending_bytes = 0                 # bytes after the last newline, not indexed yet
        self.shrunk = False                    # the file got shorter than what was indexed
        self.records = 0                       # valid records indexed (steps, events, end)
        self._steps_sorted = True
        self._events_sorted = True
        self._offset = 0
        self._fd: int | None = None
        self.header = self._read_header()
        layers = self.header.get("layers")
        self.layer_names = [str(n) for n in layers] if isinstance(layers, list) else []
        self.refresh()

    # ---- reading the file ---------------------------------------------------------------
    def _read_header(self) -> dict:
        with open(self.path, "rb") as fh:
            first = fh.readline(MAX_LINE_BYTES + 1)
        if not first.strip():
            raise SessionFormatError(f"{self.path} is empty: no session header yet")
        if len(first) > MAX_LINE_BYTES and not first.endswith(b"\n"):
            raise SessionFormatError(too_long_message(self.path))
        header = check_header(parse_record(first.decode("utf-8", "replace")), self.path)
        self._offset = len(first)
        return clipped(header)

    def refresh(self) -> int:
        """Index what was appended since the last call; return how many new records."""
        before = self.records
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return 0
        if size < self._offset:
            self.shrunk = True
            return 0
        if size == self._offset + self.pending_bytes and (self.follow or not self.pending_bytes):
            return 0
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            carry = b""
            base = self._offset
            while True:
                chunk = fh.read(CHUNK_BYTES)
                if not chunk:
                    break
                if carry and len(carry) + len(chunk) > MAX_LINE_BYTES:
                    nl = chunk.find(b"\n")
                    if nl < 0 or len(carry) + nl > MAX_LINE_BYTES:
                        # Too long to be a record: counted now, read past, none of it kept.
                        self.damaged_lines += 1
                        self.long_lines += 1
                        base += len(carry)
                        carry = b""
                        self._in_long_line = True
                if self._in_long_line:
                    nl = chunk.find(b"\n")
                    skipped = len(chunk) if nl < 0 else nl + 1
                    base += skipped
                    self._in_long_line = nl < 0
                    chunk = chunk[skipped:]
                    if not chunk:
                        continue
                buf = carry + chunk if carry else chunk
                used = self._scan(buf, base)
                carry = buf[used:]
                base += used
        self._offset = base
        self.pending_bytes = len(carry)
        self.torn_tail = False
        if carry.strip() and not self.follow:
            # Not following: the writer is gone, so a last line without its newline is final.
            # A complete record is indexed (read_session does the same); anything else is torn.
            damaged = self.damaged_lines
            self._slow(carry, base, len(carry))
            if self.damaged_lines > damaged:
                self.damaged_lines = damaged
                self.torn_tail = True
            else:
                self._offset += len(carry)
                self.pending_bytes = 0
        return self.records - before

    def _scan(self, buf: bytes, base: int) -> int:
        """Index every complete line of `buf` (which starts at file offset `base`); return the
        number of bytes consumed (up to and including the last newline).

        The hot loop: a step line costs one regex match on its first ~300 bytes and a dozen
        appends. Anything unusual (another record type, a line ending in \\r\\n, a value that
        doesn't parse, a torn line) goes to `_slow`."""
        find = buf.find
        endswith = buf.endswith
        match = _STEP_HEAD.match
        special = _SPECIAL
        pos = 0
        offsets, lengths, steps, loss, scale, times = (self.offsets, self.lengths, self.steps,
                                                       self.loss, self.scale, self.times)
        flags, probed, dcodes, dtype_code = self.flags, self.probed, self.dtype_codes, self._dtype_code
        nan = math.nan
        last_step = steps[-1] if steps else -1
        fast = 0
        try:
            while True:
                nl = find(b"\n", pos)
                if nl < 0:
                    return pos
                m = match(buf, pos, nl) if nl - pos <= MAX_LINE_BYTES else None
                if m is not None:
                    st, lt, sc, sk, dt, tt, rest, tail = m.groups()
                    if ((m.end() == nl) if tail == b"}" else endswith(b"}}", pos, nl)) \
                            and not _bare_constant(buf, pos, nl):
                        f = 0
                        try:
                            lv = float(lt)
                        except ValueError:
                            lv = special.get(lt, _BAD)
                            if lv is None:
                                f = F_LOSS_NONE
                                lv = nan
                        try:
                            sv = float(sc)
                        except ValueError:
                            sv = special.get(sc, _BAD)
                            if sv is None:
                                f |= F_SCALE_NONE
                                sv = nan
                        try:
                            tv = float(tt)
                        except ValueError:
                            tv = nan if tt in special else _BAD
                        if lv is _BAD or sv is _BAD or tv is _BAD:
                            m = None
                        else:
                            if sk == b"true":
                                f |= F_SKIPPED
                                self.skipped_frames.append(len(steps))
                            if rest and b'"nonfinite":"' in rest:
                                f |= (F_NONFINITE_LOSS if b'"nonfinite":"loss"' in rest else
                                      F_NONFINITE_GRADIENTS if b'"nonfinite":"gradients"' in rest
                                      else F_NONFINITE_OTHER)
                            if f & F_LOSS_NONE:
                                self.loss_none += 1
                            code = dtype_code.get(dt)
                            if code is None:
                                code = self._new_dtype(dt.decode("ascii"), dt)
                            step = int(st)
                            if step < last_step:
                                self._steps_sorted = False
                            last_step = step
                            offsets.append(base + pos)
                            lengths.append(nl - pos)
                            steps.append(step)
                            loss.append(lv)
                            scale.append(sv)
                            times.append(tv)
                            flags.append(f)
                            probed.append(tail != b"}")
                            dcodes.append(code)
                            fast += 1
                    else:
                        m = None
                if m is None:
                    end = nl - 1 if nl > pos and buf[nl - 1] == 13 else nl
                    self._slow(buf[pos:end], base + pos, end - pos)
                pos = nl + 1
        finally:
            self.records += fast

    def _new_dtype(self, name: str, key: bytes | None = None) -> int:
        code = self._dtype_code.get(name)
        if code is None:
            code = _new_code(self.dtypes, self._dtype_code, name)
        if key is not None:
            self._dtype_code[key] = code   # the fast path looks dtypes up by their bytes
        return code

    def _slow(self, raw: bytes, offset: int, length: int) -> None:
        """The full, strict parse of one line that the fast path didn't take."""
        if not raw.strip():
            return
        if length > MAX_LINE_BYTES:
            self.damaged_lines += 1
            self.long_lines += 1
            return
        record = parse_record(raw.decode("utf-8", "replace"))
        if record is None:
            self.damaged_lines += 1
            return
        record = clipped(record)
        kind = record["type"]
        if kind not in KNOWN_TYPES or kind == "header":
            self.unknown_records += 1
        elif kind == "step":
            if not self._add_step_record(record, offset, length):
                self.damaged_lines += 1
                return
        elif kind == "event":
            self._add_event(record, offset, length)
        else:
            self.end = record
        self.records += 1

    def _add_step_record(self, r: dict, offset: int, length: int) -> bool:
        step = r.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < _MAX_STEP:
            return False
        f = 0
        lv = _number(r.get("loss"))
        sv = _number(r.get("scale"))
        if lv is None:
            f |= F_LOSS_NONE
            lv = math.nan
            self.loss_none += 1
        if sv is None:
            f |= F_SCALE_NONE
            sv = math.nan
        frame = len(self.steps)
        if r.get("skipped") is True:
            f |= F_SKIPPED
            self.skipped_frames.append(frame)
        nonfinite = r.get("nonfinite")
        if nonfinite:
            f |= _NONFINITE_FLAGS.get(nonfinite, F_NONFINITE_OTHER)
        dtype = r.get("dtype")
        dtype = dtype if isinstance(dtype, str) else str(self.header.get("dtype") or "?")
        tv = _number(r.get("time"))
        if self.steps and step < self.steps[-1]:
            self._steps_sorted = False
        self.offsets.append(offset)
        self.lengths.append(length)
        self.steps.append(step)
        self.loss.append(lv)
        self.scale.append(sv)
        self.times.append(math.nan if tv is None else tv)
        self.flags.append(f)
        self.probed.append(isinstance(r.get("layers"), dict))
        self.dtype_codes.append(self._new_dtype(dtype))
        return True

    def _add_event(self, e: dict, offset: int, length: int) -> None:
        k = len(self.event_steps)
        step = e.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not -_MAX_STEP < step < _MAX_STEP:
            step = self.steps[-1] + 1 if self.steps else 0
            e["step"] = step
        kind = str(e.get("kind"))
        code = self._kind_code.get(kind)
        if code is None:
            code = _new_code(self.kinds, self._kind_code, kind)
        if self.event_steps and step < self.event_steps[-1]:
            self._events_sorted = False
        self.event_offsets.append(offset)
        self.event_lengths.append(length)
        self.event_frames.append(len(self.steps))
        self.event_steps.append(step)
        self.event_kinds.append(code)
        if kind != "nonfinite":  # the only kind that comes by the thousand (one per skipped step)
            self._kept[k] = e
        if kind in _STATE_KINDS:
            self.state_events.append(k)
        if kind in _MARKER_KINDS:
            self.marker_events.append(k)
        if kind == "error" and e.get("during") == "step":
            self.error_events.append(k)

    # ---- lookups ------------------------------------------------------------------------
    @property
    def frames(self) -> int:
        """Step records indexed."""
        return len(self.steps)

    @property
    def event_count(self) -> int:
        return len(self.event_steps)

    def event_kind(self, k: int) -> str:
        return self.kinds[self.event_kinds[k]]

    def kind_code(self, kind: str) -> int | None:
        """The code of an event kind in `event_kinds`, None if no such event was indexed."""
        return self._kind_code.get(kind)

    def dtype_at(self, frame: int) -> str:
        return self.dtypes[self.dtype_codes[frame]]

    def loss_at(self, frame: int) -> float | None:
        return None if self.flags[frame] & F_LOSS_NONE else self.loss[frame]

    def scale_at(self, frame: int) -> float | None:
        return None if self.flags[frame] & F_SCALE_NONE else self.scale[frame]

    def skipped_at(self, frame: int) -> bool:
        return bool(self.flags[frame] & F_SKIPPED)

    def frame_of(self, step: int) -> int:
        """The newest frame whose step is <= `step` (0 when `step` is before the first; -1 when
        there is no frame)."""
        n = len(self.steps)
        if n == 0:
            return -1
        if self._steps_sorted:
            return max(bisect.bisect_right(self.steps, step) - 1, 0)
        best = 0
        for i, s in enumerate(self.steps):
            if s <= step:
                best = i
        return best

    def events_before_frame(self, frame: int) -> int:
        """How many events were written before step record `frame` (all of them past the last)."""
        if frame >= len(self.steps):
            return len(self.event_steps)
        return bisect.bisect_right(self.event_frames, frame)

    def events_shown_at(self, frame: int) -> int:
        """How many events a live dashboard had shown right after step record `frame`."""
        return self.events_before_frame(frame + 1)

    def events_upto(self, step: int) -> int:
        """How many events (in file order) have a step <= `step`."""
        if self._events_sorted:
            return bisect.bisect_right(self.event_steps, step)
        return sum(1 for s in self.event_steps if s <= step)

    def event(self, k: int) -> dict:
        """Event `k` (file order) as a dict; nonfinite events are read back from the file (an
        unreadable one becomes a stand-in with the kind and step)."""
        e = self._kept.get(k)
        if e is not None:
            return e
        e = self._cache.get(k)
        if e is None:
            e = self._read(self.event_offsets[k], self.event_lengths[k])
            if e is None or e.get("type") != "event":
                e = {"type": "event", "step": self.event_steps[k], "kind": self.event_kind(k),
                     "message": "(this event could not be read back from the file)"}
            e["step"] = self.event_steps[k]
            if len(self._cache) >= EVENT_CACHE:
                self._cache.clear()
            self._cache[k] = e
        return e

    def iter_events(self, kinds: tuple[str, ...] | None = None) -> Iterator[dict]:
        for k in range(len(self.event_steps)):
            if kinds is None or self.event_kind(k) in kinds:
                yield self.event(k)

    def read_step(self, frame: int) -> dict | None:
        """The full step record of `frame`, or None when it can't be read or parsed."""
        r = self._read(self.offsets[frame], self.lengths[frame])
        return r if r is not None and r.get("type") == "step" else None

    def _read(self, offset: int, length: int) -> dict | None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            if hasattr(os, "pread"):
                raw = os.pread(self._fd, length, offset)
            else:
                raw = self._seek_read(offset, length)
        except OSError:
            return None
        if len(raw) != length:
            return None
        return clipped(parse_record(raw.decode("utf-8", "replace")))

    def _seek_read(self, offset: int, length: int) -> bytes:
        os.lseek(self._fd, offset, os.SEEK_SET)
        return os.read(self._fd, length)

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            finally:
                self._fd = None

    def __enter__(self) -> "SessionIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def skipped_summary(self) -> str | None:
        """E.g. "3 damaged lines and 1 unknown record skipped"; None when nothing was skipped."""
        parts = []
        if self.damaged_lines > self.long_lines:
            parts.append(_plural(self.damaged_lines - self.long_lines, "damaged line"))
        if self.long_lines:
            parts.append(_plural(self.long_lines, "line") + f" over {MAX_LINE_BYTES >> 20} MiB")
        if self.unknown_records:
            parts.append(_plural(self.unknown_records, "unknown record"))
        if self.torn_tail:
            parts.append("an incomplete last line")
        if not parts:
            return None
        return " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts) + " skipped"

    def memory_bytes(self) -> int:
        """Approximate bytes held by the per-step arrays (for the benchmark)."""
        arrays = (self.offsets, self.lengths, self.steps, self.loss, self.scale, self.times,
                  self.skipped_frames, self.event_offsets, self.event_lengths, self.event_steps,
                  self.event_frames, self.state_events, self.marker_events, self.error_events)
        return (sum(a.itemsize * len(a) for a in arrays) + len(self.flags) + len(self.probed)
                + len(self.dtype_codes) + len(self.event_kinds))


@dataclasses.dataclass
class ReplaySnapshot(Snapshot):
    """A Snapshot with the playback state (everything else means what it means live).

    `state` is the playback state: "replay-playing", "replay-paused" or "replay-following" (at the
    end of a session that is still being written, waiting for more). `run_state` is what the
    recorded run was doing at `position` ("running", "paused", "finished", "stopped", "error",
    "starting"), as a live dashboard would have shown it then."""

    run_state: str = "starting"
    playing: bool = False
    speed: float = 0.0              # steps per second of playback
    following: bool = False         # follow mode (the file is re-read as it grows)
    frame: int = -1                 # index of the shown step record among `total_steps`


class ReplaySource:
    """A recorded session as a `Source` (see the module docstring)."""

    mode = "replay"
    SPEEDS = tuple(2.0 ** k for k in range(11))      # 1 ... 1024 steps per second
    DEFAULT_SPEED = 16.0

    def __init__(self, target: str | Path, *, follow: bool = False,
                 clock: Callable[[], float] = time.monotonic, speed: float = DEFAULT_SPEED,
                 autoplay: bool = True, refresh_interval: float = 0.25,
                 history_points: int = HISTORY_POINTS):
        self.index = SessionIndex(target, follow=follow)
        self.session_path = self.index.path
        self.run_dir = self.index.run_dir
        self.follow = follow
        self.autoplay = autoplay
        self.refresh_interval = refresh_interval
        self._clock = clock
        self._points = history_points
        self.speed = float(speed)
        self.playing = False
        self.started = False
        self._frame = (self.index.frames - 1) if follow else (0 if self.index.frames else -1)
        self._carry = 0.0
        self._last_tick: float | None = None
        self._last_refresh = clock()
        self._version = 1
        self._cached: ReplaySnapshot | None = None
        self._cached_version = 0
        self._bad: tuple[int, str] | None = None  # (frame, notice) of a record that couldn't be read
        self._records: dict[int, dict] = {}  # a few parsed step records by frame

    # ---- the Source protocol ----------------------------------------------------------------
    def start(self) -> None:
        if self.started:
            return
        self.started = True
        if self.follow:
            self.end()
        if self.follow or self.autoplay:
            self.play()

    def stop(self, timeout: float = 10.0, *, give_up_unwritten: bool = False) -> bool:
        self.pause()
        self.started = False
        self.index.close()
        return True

    def send(self, command: Command) -> tuple[bool, str]:
        return False, (f"replay: {command.text()} not sent: this is a recording (steer a live run, "
                       "or repeat these interventions with amp-tui train --at)")

    def held_stop(self) -> str | None:
        return None   # nothing here is recorded: a stop is never held

    def checkpoints(self) -> list:
        from amp_tui.training.checkpoint import CheckpointError, list_checkpoints
        try:
            return list_checkpoints(self.run_dir / "checkpoints")
        except (CheckpointError, OSError):
            return []

    def snapshot(self) -> ReplaySnapshot:
        if self.started:
            self.tick()
        if self._cached is not None and self._cached_version == self._version:
            return self._cached
        try:
            snap = self._build()
        except Exception as exc:  # noqa: BLE001 - a frame that can't be shown must not end the app
            snap = self._failed(exc)
        self._cached, self._cached_version = snap, self._version
        return snap

    def _failed(self, exc: Exception) -> ReplaySnapshot:
        """The previous picture (or an empty one) with a notice, playback paused."""
        self.playing = False
        self._changed()
        notice = (f"replay: step {self.position} can't be shown ({type(exc).__name__}: {exc}); "
                  "playback paused")
        idx = self.index
        base = self._cached or ReplaySnapshot(
            mode=self.mode, header=dict(idx.header), state=self.state, last=None,
            total_steps=idx.frames, steps_per_second=0.0, history=History(),
            layers=LayerView(list(idx.layer_names), [], [], [], None, None), events=[],
            events_seen=0, error=None, version=0)
        return dataclasses.replace(base, state=self.state, playing=False, notice=notice,
                                   version=self._version, position=self.position, frame=self._frame)

    # ---- where we are -----------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        return self.index.frames

    @property
    def frame(self) -> int:
        return self._frame

    @property
    def position(self) -> int | None:
        return self.index.steps[self._frame] if self._frame >= 0 else None

    @property
    def at_end(self) -> bool:
        return self._frame >= self.index.frames - 1

    @property
    def state(self) -> str:
        if not self.playing:
            return "replay-paused"
        if self.follow and self.at_end and self.index.end is None:
            return "replay-following"
        return "replay-playing"

    def playback_text(self) -> str:
        """For a status line: "playing 16 steps/s", "paused" or "following the file"."""
        if not self.playing:
            return "paused"
        if self.follow and self.at_end and self.index.end is None:
            return "following the file"
        return f"playing {self.speed:g} steps/s"

    # ---- playback controls ------------------------------------------------------------------
    def _changed(self) -> None:
        self._version += 1

    def _go(self, frame: int) -> bool:
        n = self.index.frames
        frame = min(max(frame, 0), n - 1) if n else -1
        if frame == self._frame:
            return False
        self._frame = frame
        self._changed()
        return True

    def play(self) -> None:
        if self.index.frames and self.at_end and not self.follow:
            self._go(0)             # play at the end starts over
        if not self.playing:
            self.playing = True
            self._changed()
        self._last_tick = self._clock()
        self._carry = 0.0

    def pause(self) -> None:
        if self.playing:
            self.playing = False
            self._changed()
        self._carry = 0.0

    def toggle(self) -> bool:
        """Play/pause; returns True when now playing."""
        if self.playing:
            self.pause()
        else:
            self.play()
        return self.playing

    def faster(self) -> float:
        return self._set_speed(min(self.speed * 2, self.SPEEDS[-1]))

    def slower(self) -> float:
        return self._set_speed(max(self.speed / 2, self.SPEEDS[0]))

    def _set_speed(self, speed: float) -> float:
        if speed != self.speed:
            self.speed = speed
            self._carry = 0.0
            self._changed()
        return self.speed

    def step_by(self, n: int) -> int | None:
        """Move `n` step records (negative: back) and pause; returns the new position."""
        self.pause()
        self._go(self._frame + n)
        return self.position

    def seek(self, step: int) -> int | None:
        """Show step `step` (or the newest recorded step before it); playback goes on if it was on."""
        self._go(self.index.frame_of(int(step)))
        self._last_tick = self._clock()
        return self.position

    def home(self) -> int | None:
        self._go(0)
        self._last_tick = self._clock()
        return self.position

    def end(self) -> int | None:
        self._go(self.index.frames - 1)
        self._last_tick = self._clock()
        return self.position

    def next_event(self) -> int | None:
        """Pause at the step of the next event after the position (a run of non-finite events
        counts once, at its first step); returns the new position, None when there is none."""
        return self._jump(+1)

    def previous_event(self) -> int | None:
        return self._jump(-1)

    def _jump(self, direction: int) -> int | None:
        idx = self.index
        here = self.position
        if here is None or not idx.event_count:
            return None
        nonfinite = idx.kind_code("nonfinite")
        if direction > 0:
            k = idx.events_upto(here)
            ks = range(k, idx.event_count)
        else:
            k = idx.events_upto(here - 1)
            ks = range(k - 1, -1, -1)
        for k in ks:
            step = idx.event_steps[k]
            if idx.event_kinds[k] == nonfinite and self._inside_storm(step):
                continue
            target = idx.frame_of(step)
            if target == self._frame:
                continue
            self.pause()
            self._go(target)
            return self.position
        return None

    def _inside_storm(self, step: int) -> bool:
        """True when the step before `step` was a skipped one (so `step` continues a storm)."""
        idx = self.index
        frame = idx.frame_of(step)
        return frame > 0 and idx.steps[frame] == step and bool(idx.flags[frame - 1] & F_SKIPPED) \
            and idx.steps[frame - 1] == step - 1

    def tick(self) -> bool:
        """Advance playback by the time elapsed since the last tick x speed; in follow mode also
        re-read the file (at most every `refresh_interval` s). Returns True if anything changed."""
        now = self._clock()
        version = self._version
        if self.follow and now - self._last_refresh >= self.refresh_interval:
            self._last_refresh = now
            was_at_end = self.at_end
            shrunk = self.index.shrunk
            if self.index.refresh() or self.index.shrunk != shrunk:
                self._changed()
                if self._frame < 0 and self.index.frames:
                    self._frame = 0
                if was_at_end and self.playing:
                    self._go(self.index.frames - 1)
        if self.playing:
            last, self._last_tick = self._last_tick, now
            if last is not None and now > last:
                advance = (now - last) * self.speed + self._carry
                whole = int(advance)
                self._carry = advance - whole
                if whole:
                    self._go(self._frame + whole)
            if self.at_end and not self.follow:
                self.pause()        # the end of the recording
        return self._version != version

    # ---- the snapshot -------------------------------------------------------------------------
    def _step_record(self, frame: int) -> dict | None:
        r = self._records.get(frame)
        if r is None:
            r = self.index.read_step(frame)
            if r is None:
                return None
            if len(self._records) >= 8:
                self._records.pop(next(iter(self._records)))
            self._records[frame] = r
        return r

    def _stand_in(self, frame: int) -> dict:
        """What the index knows of a step whose record can't be read."""
        idx = self.index
        enc = jsonsafe.encode_float
        flags = idx.flags[frame]
        return {"type": "step", "step": idx.steps[frame], "loss": enc(idx.loss_at(frame)),
                "scale": enc(idx.scale_at(frame)), "skipped": bool(flags & F_SKIPPED),
                "dtype": idx.dtype_at(frame),
                "time": None if math.isnan(idx.times[frame]) else idx.times[frame]}

    def _bad_frame(self, frame: int) -> None:
        if self._bad is not None and self._bad[0] == frame:
            return              # said already: playing on from here is the user's call
        step = self.index.steps[frame]
        self._bad = (frame, f"replay: the record of step {step} can't be read (damaged or changed "
                            "on disk); playback paused")
        self.playing = False
        self._changed()

    def _build(self) -> ReplaySnapshot:
        idx = self.index
        i = self._frame
        names = idx.layer_names
        if i >= 0:
            last = self._step_record(i)
            if last is None:
                self._bad_frame(i)
                last = self._stand_in(i)
            elif self._bad is not None and self._bad[0] != i:
                self._bad = None     # moved on to a readable step
            position = idx.steps[i]
            count = idx.events_shown_at(i)
            history = self._history(i, count)
            layers = self._layers(i, last, names)
        else:
            last, position, history = None, None, History()
            layers = LayerView(list(names), [], [], [], None, None)
            count = idx.event_count
        first = max(0, count - EVENT_LIMIT)
        events = [idx.event(k) for k in range(first, count)]
        error = None
        e = bisect.bisect_left(idx.error_events, count) - 1
        if e >= 0:
            error = idx.event(idx.error_events[e])
        return ReplaySnapshot(
            mode=self.mode, header=dict(idx.header), state=self.state, last=last,
            total_steps=idx.frames, steps_per_second=self._rate(i), history=history, layers=layers,
            events=events, events_seen=count, error=error, version=self._version,
            position=position, notice=self._notice(), run_state=self._run_state(i, count),
            playing=self.playing, speed=self.speed, following=self.follow, frame=i)

    def _notice(self) -> str | None:
        parts = []
        if self._bad:
            parts.append(self._bad[1])
        skipped = self.index.skipped_summary()
        if skipped:
            parts.append(f"replay: {skipped}")
        if self.index.shrunk:
            parts.append("replay: the session file got shorter while being read; showing what was "
                         "indexed before")
        return "; ".join(parts) or None

    def _history(self, i: int, count: int) -> History:
        idx = self.index
        stride = 1
        while i // stride + 1 > self._points:
            stride *= 2
        stop = i + 1
        steps = idx.steps[0:stop:stride].tolist()
        loss = idx.loss[0:stop:stride].tolist()
        scale = [None if v != v else v for v in idx.scale[0:stop:stride].tolist()]
        if idx.loss_none:
            loss = [None if f & F_LOSS_NONE else v for v, f in zip(loss, idx.flags[0:stop:stride])]
        k = bisect.bisect_right(idx.skipped_frames, i)
        skipped = [idx.steps[j] for j in idx.skipped_frames[max(0, k - MARKER_LIMIT):k]]
        m = bisect.bisect_left(idx.marker_events, count)
        markers = [idx.event_steps[k] for k in idx.marker_events[max(0, m - MARKER_LIMIT):m]]
        return History(steps, loss, scale, skipped, markers, stride)

    def _layers(self, i: int, last: dict | None, names: list[str]) -> LayerView:
        """The figures of the newest probed step <= frame `i` that can be read (a damaged one is
        passed over, a few at most)."""
        idx = self.index
        n = len(names)
        r = None
        j = i + 1
        for _ in range(8):
            j = idx.probed.rfind(1, 0, j)
            if j < 0:
                break
            r = last if j == i else self._step_record(j)
            if r is not None and isinstance(r.get("layers"), dict):
                break
            r = None
        if r is None:
            return LayerView(list(names), [None] * n, [None] * n, [None] * n, None, None)
        layers = r["layers"]
        return LayerView(list(names), _floats(layers.get("act"), n), _floats(layers.get("grad"), n),
                         _floats(layers.get("weight"), n), r.get("step"), r.get("dtype"))

    def _rate(self, i: int) -> float:
        if i < 1:
            return 0.0
        idx = self.index
        j = max(0, i - RATE_WINDOW + 1)
        dt = idx.times[i] - idx.times[j]
        if not dt > 0:
            return 0.0
        return (idx.steps[i] - idx.steps[j]) / dt

    def _run_state(self, i: int, count: int) -> str:
        idx = self.index
        state = "starting"
        for k in idx.state_events:
            if k >= count:
                break
            e = idx.event(k)
            kind = e.get("kind")
            if kind in _MARKER_KINDS:
                after = e.get("after")
                if isinstance(after, dict) and after.get("state") in ("paused", "running", "stopped"):
                    state = after["state"]
            elif kind == "paused":
                state = "paused"
            elif kind == "error" and e.get("during") == "step":
                state = "error"
        if i >= 0 and state == "starting":
            state = "running"
        if i >= 0 and i == idx.frames - 1 and idx.end is not None:
            state = {"finished": "finished", "error": "error"}.get(idx.end.get("status"), "stopped")
        return state


def _floats(values, n: int) -> list[float | None]:
    if not isinstance(values, list):
        return [None] * n
    out = [_number(v) for v in values[:n]]
    return out + [None] * (n - len(out))


def open_replay(target: str | Path, *, follow: bool = False, **kwargs) -> ReplaySource:
    """`ReplaySource(target, follow=follow)`; raises SessionFormatError (not a session, a newer
    format, no file) or OSError with a message for the user."""
    return ReplaySource(target, follow=follow, **kwargs)
