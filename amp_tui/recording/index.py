"""A compact index of a session file, for replays, timelines and reports.

`SessionIndex` reads `session.jsonl` once and keeps what the charts and the navigation need as
compact arrays (byte offset, step, loss, scale, time and a few flag bytes per step record: about 45
bytes a step, not a dict), plus the header, the end record and the event records. The full record
of a step (its per-layer figures) is read from the file at its offset when the replay shows it.
A step line is indexed from its leading scalar fields (step_lines.py); any other line, or one
that may hold a bare NaN/Infinity token, goes through the strict, full JSON parse. Like
`read_session`, it is tolerant: damaged lines, lines over `MAX_LINE_BYTES` (read past, never held)
and record types it doesn't know are counted and skipped; a line that doesn't end with a newline
yet is left for the next `refresh()` (the writer may be in the middle of it), which is how
`follow` works. Strings longer than TEXT_LIMIT in what it keeps or reads back are cut in the
middle, so a hostile file can't make a replay hold or draw megabytes of text.
"""

from __future__ import annotations

import math
import os
from array import array
from pathlib import Path

from amp_tui.core.jsonsafe import read_float
from amp_tui.core.records import MARKER_EVENTS, STATE_EVENTS
from amp_tui.core.text import clip_strings, plural
from amp_tui.recording.format import KNOWN_TYPES, MAX_LINE_BYTES, SessionFormatError
from amp_tui.recording.index_lookups import EVENT_CACHE, SessionIndexLookups
from amp_tui.recording.reader import (
    MAX_STEP,
    header_record,
    parse_record,
    resolve_session_path,
    step_number,
    too_long_message,
)
from amp_tui.recording.step_lines import (
    BAD,
    F_CALIBRATION,
    F_LOSS_NONE,
    F_NONFINITE_OTHER,
    F_SCALE_NONE,
    F_SKIPPED,
    NONFINITE_FLAGS,
    STEP_LINE,
    bare_constant,
    rest_flags,
    step_numbers,
)

CHUNK_BYTES = 1 << 20          # the file is read in chunks of this size
# Characters kept of any string in the header or a record (a layer name, a message, a path): the
# writer's longest, a traceback, is 20,000; a longer one (a hostile or damaged file) is cut, so a
# replay never holds or draws megabytes of it.
TEXT_LIMIT = 20_000
RATE_WINDOW = 64               # step records used for the steps-per-second figure

__all__ = ["CHUNK_BYTES", "EVENT_CACHE", "RATE_WINDOW", "TEXT_LIMIT", "SessionIndex"]


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


class SessionIndex(SessionIndexLookups):
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
        self.end_at: tuple[int, int] | None = None   # (offset, length) of the end record's line
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
        if len(first) > MAX_LINE_BYTES and not first.endswith(b"\n"):
            raise SessionFormatError(too_long_message(self.path))
        header = header_record(first.rstrip(b"\n"), first.endswith(b"\n"), self.path)
        self._offset = len(first)
        return clip_strings(header, TEXT_LIMIT)

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
        """Index every complete line of `buf` (at file offset `base`); return the bytes consumed.
        The hot loop: a step line costs one regex match on its first ~300 bytes and a dozen
        appends. Anything unusual (another record type, a line ending in \\r\\n, a value that
        doesn't parse, a torn line) goes to `_slow`."""
        find = buf.find
        endswith = buf.endswith
        match = STEP_LINE.match
        pos = 0
        offsets, lengths, steps, loss, scale, times = (self.offsets, self.lengths, self.steps,
                                                       self.loss, self.scale, self.times)
        flags, probed, dcodes, dtype_code = self.flags, self.probed, self.dtype_codes, self._dtype_code
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
                            and not bare_constant(buf, pos, nl):
                        f, lv, sv, tv = step_numbers(lt, sc, tt)
                        if lv is BAD:
                            m = None
                        else:
                            if sk == b"true":
                                f |= F_SKIPPED
                                self.skipped_frames.append(len(steps))
                            if rest:
                                f |= rest_flags(rest)
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
        record = clip_strings(record, TEXT_LIMIT)
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
            self.end_at = (offset, length)
        self.records += 1

    def _add_step_record(self, r: dict, offset: int, length: int) -> bool:
        step = step_number(r.get("step"))
        if step is None:
            return False
        f = 0
        lv = read_float(r.get("loss"))
        sv = read_float(r.get("scale"))
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
        if nonfinite:   # a damaged record can hold any JSON value: only a name is looked up
            f |= NONFINITE_FLAGS.get(nonfinite, F_NONFINITE_OTHER) if isinstance(nonfinite, str) \
                else F_NONFINITE_OTHER
        if r.get("calibration") is True:
            f |= F_CALIBRATION
        dtype = r.get("dtype")
        dtype = dtype if isinstance(dtype, str) else str(self.header.get("dtype") or "?")
        tv = read_float(r.get("time"))
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
        if isinstance(step, bool) or not isinstance(step, int) or not -MAX_STEP < step < MAX_STEP:
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
        if kind in STATE_EVENTS:
            self.state_events.append(k)
        if kind in MARKER_EVENTS:
            self.marker_events.append(k)
        if kind == "error" and e.get("during") == "step":
            self.error_events.append(k)

    # ---- reading back (the lookups by frame, step and event: index_lookups.py) ----------
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
        return clip_strings(parse_record(raw.decode("utf-8", "replace")), TEXT_LIMIT)

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
            parts.append(plural(self.damaged_lines - self.long_lines, "damaged line"))
        if self.long_lines:
            parts.append(plural(self.long_lines, "line") + f" over {MAX_LINE_BYTES >> 20} MiB")
        if self.unknown_records:
            parts.append(plural(self.unknown_records, "unknown record"))
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
