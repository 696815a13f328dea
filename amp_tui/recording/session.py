"""The session file: an append-only JSON Lines record of one run.

Line 1 is the header; every other line is one record (`step`, `event`, or `end`). Non-finite numbers
are written as the strings "NaN", "Infinity", "-Infinity" (see jsonsafe), so every line parses with a
strict JSON parser. Readers skip a torn last line, damaged lines (bare NaN/Infinity tokens
included), unknown record types, and lines over MAX_LINE_BYTES, which they never hold in memory.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from amp_tui.core import jsonsafe

FORMAT = "amp-tui-session"
VERSION = 1
FIGURE_DIGITS = 5  # significant digits kept for per-layer magnitudes
KNOWN_TYPES = ("header", "step", "event", "end")
# No record amp-tui writes comes near this (a step record of a 100,000-layer model is about 4 MB);
# a longer line is damage, or a hostile file, and is skipped without being read into memory.
MAX_LINE_BYTES = 16 << 20
_SKIP_BYTES = 1 << 20   # an over-long line is read past in pieces of this size


class SessionFormatError(Exception):
    """The file is not a session we can read (not ours, or from a newer version)."""


class SessionWriter:
    """Appends records; flushes at least once a second and at once after every event.

    Records are kept as bytes until `os.write` has taken them: a write that fails (a full disk)
    loses nothing and tears no line, because the unwritten tail stays pending and the next flush
    (after space was freed) writes it from exactly where the failed one stopped. The end of the
    file is no exception: `finish()` leaves the file open and the records pending when its last
    flush fails, so it can be tried again; only `abandon()` gives them up, and says how many.
    """

    def __init__(self, path: Path, header: dict, *, flush_interval: float = 1.0, append: bool = False):
        self.path = Path(path)
        self.flush_interval = flush_interval
        if append:
            _end_torn_line(self.path)
        flags = os.O_WRONLY | os.O_APPEND | (0 if append else os.O_CREAT | os.O_EXCL)
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self._pending = bytearray()
        self._partial = 0        # bytes of the first pending record already in the file
        self._cut_type = ""      # that record's type (its start, with the type, is in the file)
        self._ended = False      # the end record is in `_pending` or in the file
        self._last_flush = time.monotonic()
        if not append:
            self._write({"type": "header", "format": FORMAT, "version": VERSION, **header}, flush=True)

    @property
    def closed(self) -> bool:
        return self._fd is None

    @property
    def pending_bytes(self) -> int:
        """Bytes written by the run but not yet taken by the file (after a failed flush)."""
        return len(self._pending)

    def pending_records(self) -> dict[str, int]:
        """The records not yet (wholly) in the file, counted by type: {"step": 13, "end": 1}."""
        counts: dict[str, int] = {}
        for i, line in enumerate(bytes(self._pending).splitlines()):
            kind = self._cut_type if i == 0 and self._partial else _record_type(line)
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def _write(self, record: dict, *, flush: bool) -> None:
        self._pending += (jsonsafe.dumps(record) + "\n").encode("utf-8")
        if flush or time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush()

    def write(self, record: dict) -> None:
        """Raises OSError when the file refuses the bytes; they stay pending for the next flush."""
        self._write(record, flush=record.get("type") != "step")

    def flush(self) -> None:
        if self._fd is None:
            return
        while self._pending:
            written = os.write(self._fd, self._pending)   # a full disk raises, keeping the rest
            newline = self._pending.rfind(b"\n", 0, written)
            head = newline + 1 if newline >= 0 else (0 if not self._partial else None)
            if head is not None and head < written:     # a record was cut short: note its type
                self._cut_type = _record_type(bytes(self._pending[head:head + 32]))
            self._partial = written - newline - 1 if newline >= 0 else self._partial + written
            del self._pending[:written]
        self._last_flush = time.monotonic()

    def finish(self, end: dict | None = None) -> None:
        """Write the end record (once, however often this is tried) and everything pending,
        fsync, close. Raises OSError with the file still open and nothing given up: call it again
        once space is freed, or `abandon()`."""
        if self._fd is None:
            return
        if end is not None and not self._ended:
            self._pending += (jsonsafe.dumps({"type": "end", **end}) + "\n").encode("utf-8")
            self._ended = True
        self.flush()
        os.fsync(self._fd)
        fd, self._fd = self._fd, None
        os.close(fd)

    def abandon(self) -> dict[str, int]:
        """Close without the records the file refused; returns them counted by type. A record
        that a failed write cut short is cut off the file again (shrinking a file needs no
        space), so what stays on disk ends with a whole line."""
        if self._fd is None:
            return {}
        lost = self.pending_records()
        fd, self._fd = self._fd, None
        try:
            if self._partial and self._pending:
                os.ftruncate(fd, os.fstat(fd).st_size - self._partial)
        except OSError:
            pass   # the reader skips a torn last line; the lost records are counted either way
        finally:
            self._pending.clear()
            os.close(fd)
        return lost

    def close(self, end: dict | None = None) -> None:
        """`finish(end)`; where the file refuses it, the pending records are given up (`abandon`)
        and the error raised. A run uses `finish` and decides itself."""
        try:
            self.finish(end)
        except OSError:
            self.abandon()
            raise


def _record_type(line: bytes) -> str:
    """The type of one encoded record, read from its first key (every writer puts it first)."""
    prefix = b'{"type":"'
    if line.startswith(prefix):
        end = line.find(b'"', len(prefix))
        if end > 0:
            return line[len(prefix):end].decode("utf-8", "replace")
    return "record"


def _end_torn_line(path: Path) -> None:
    """A run killed mid-write leaves a torn last line: end it so new records start clean."""
    with open(path, "rb+") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() == 0:
            return
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) != b"\n":
            fh.write(b"\n")


LAYER_DIGITS = 4  # significant digits kept for per-layer magnitudes (act, grad, weight)
SHARE_DIGITS = 3  # significant digits kept for per-layer shares (underflow)
_INF = float("inf")
_SPEC = {d: f".{d}g" for d in range(1, 18)}
_INT_FROM = {d: 10.0 ** d for d in range(1, 18)}


def compact_figure(x: float | None, digits: int = LAYER_DIGITS) -> float | int | str | None:
    """A per-layer figure as a value whose JSON token is short: `digits` significant digits, and
    a whole number as an int (`1235`, `0`, not `1235.0`; from 10**digits to 10**(digits+1) all
    of its digits, `65504`, since they cost no byte more), so `json.dumps` writes tokens like
    `4.505e-05`, `0.5`, `1235`. Non-finite values become "NaN"/"Infinity"/"-Infinity" (strict
    JSON), None stays None (null: not measured). The value is exactly what a reader parses back."""
    if x is None:
        return None
    x = float(x)
    if x != x:
        return "NaN"
    if x == _INF or x == -_INF:
        return "Infinity" if x > 0 else "-Infinity"
    spec = _SPEC.get(digits) or f".{digits}g"
    a = abs(x)
    if a >= 1e15:
        return float(format(x, spec))
    whole = _INT_FROM.get(digits) or 10.0 ** digits
    if whole <= a < 10 * whole:
        return round(x)  # e.g. 65504 with 4 digits: one more digit costs no byte over 65500
    v = float(format(x, spec))
    if v.is_integer() and not (v == 0 and math.copysign(1.0, x) < 0):
        return int(v)  # 1235, 7, 0 instead of 1235.0, 7.0, 0.0; -0.0 keeps its sign
    return v


def step_record(result) -> dict:
    """A StepResult as a `step` record (per-layer figures as compact arrays in layer order).

    The scalar fields come first, in this fixed order, each written once: `amp_tui.sources.replay`'s
    fast indexer reads them without parsing the whole line (it falls back to a full parse when
    a line doesn't match, so adding fields is safe; reordering only makes indexing slower).
    """
    enc = jsonsafe.encode_float
    fig = compact_figure
    record: dict[str, Any] = {
        "type": "step",
        "step": result.step,
        "loss": enc(result.loss),
        "scale": enc(result.scale),
        "skipped": result.skipped,
        "skipped_total": result.skipped_total,
        "updates": result.updates_applied,
        "dtype": result.dtype,
        "micro_batches": result.micro_batches,
        "time": round(result.wall_time, 3),
        "duration": round(result.duration, 6),
        # after "duration": the replay index's fast path reads the fields before it by position
        "next_scale": enc(result.next_scale),
    }
    if result.lr is not None:
        record["lr"] = enc(result.lr)
    if result.grad_norm is not None:
        record["grad_norm"] = enc(result.grad_norm, FIGURE_DIGITS)
    if result.nonfinite:
        record["nonfinite"] = result.nonfinite
    if result.figures is not None:
        f = result.figures
        record["layers"] = {
            "act": [fig(v) for v in f.act],
            "grad": [fig(v) for v in f.grad],
            "weight": [fig(v) for v in f.weight],
        }
        if f.underflow is not None:
            record["layers"]["underflow"] = [fig(v, SHARE_DIGITS) for v in f.underflow]
        if f.underflow_scaled is not None:
            record["layers"]["underflow_scaled"] = [fig(v, SHARE_DIGITS) for v in f.underflow_scaled]
    return record


def event_record(step: int, kind: str, message: str, **fields: Any) -> dict:
    return {"type": "event", "step": step, "kind": kind, "message": message,
            "time": round(time.time(), 3), **fields}


@dataclass
class Session:
    header: dict
    records: list[dict] = field(default_factory=list)
    skipped_lines: int = 0         # damaged, torn or over-long lines
    long_lines: int = 0            # of which longer than MAX_LINE_BYTES (skipped unread)
    unknown_records: int = 0       # well-formed records of a type this version doesn't know
    path: Path | None = None

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.records if r.get("type") == "step"]

    @property
    def events(self) -> list[dict]:
        return [r for r in self.records if r.get("type") == "event"]

    @property
    def end(self) -> dict | None:
        ends = [r for r in self.records if r.get("type") == "end"]
        return ends[-1] if ends else None


def resolve_session_path(target: str | Path) -> Path:
    """A run directory or a session file -> the session file."""
    path = Path(target)
    if path.is_dir():
        path = path / "session.jsonl"
    if not path.exists():
        raise SessionFormatError(f"no session found at {target}")
    return path


def check_header(header: Any, path: Path) -> dict:
    if not isinstance(header, dict) or header.get("type") != "header" or header.get("format") != FORMAT:
        raise SessionFormatError(f"{path} is not an amp-tui session (its first line is not a header)")
    version = header.get("version")
    if not isinstance(version, int) or version < 1:
        raise SessionFormatError(f"{path}: header has no valid format version")
    if version > VERSION:
        raise SessionFormatError(
            f"{path} was written by a newer amp-tui (session format {version}; this version reads "
            f"up to {VERSION}): upgrade amp-tui to read it")
    return header


def parse_record(line: str) -> dict | None:
    """One line -> a record dict, or None when the line is damaged."""
    try:
        record = jsonsafe.loads(line)
    except (ValueError, RecursionError):   # RecursionError: arrays nested thousands deep
        return None
    return record if isinstance(record, dict) and isinstance(record.get("type"), str) else None


def read_lines(fh: BinaryIO) -> Iterator[bytes | None]:
    """The lines of a binary file, without their newline; None stands for a line longer than
    MAX_LINE_BYTES, which is read past piece by piece: no more than the limit is ever held."""
    while True:
        piece = fh.readline(_SKIP_BYTES)
        if not piece:
            return
        pieces, size = [piece], len(piece)
        while not piece.endswith(b"\n") and size <= MAX_LINE_BYTES:
            piece = fh.readline(_SKIP_BYTES)
            if not piece:
                break             # the last line, without a newline
            pieces.append(piece)
            size += len(piece)
        if size - piece.endswith(b"\n") > MAX_LINE_BYTES:
            del pieces
            while piece and not piece.endswith(b"\n"):
                piece = fh.readline(_SKIP_BYTES)
            yield None
            continue
        line = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        yield line[:-1] if line.endswith(b"\n") else line


def too_long_message(path: Path) -> str:
    return (f"{path}: its first line is longer than {MAX_LINE_BYTES >> 20} MiB: not an amp-tui "
            "session header")


def read_session(target: str | Path) -> Session:
    """Load every valid record; count what had to be skipped instead of failing."""
    path = resolve_session_path(target)
    with open(path, "rb") as fh:
        lines = read_lines(fh)
        first = next(lines, b"")
        if first is None:
            raise SessionFormatError(too_long_message(path))
        header = check_header(parse_record(first.decode("utf-8", "replace")), path)
        session = Session(header=header, path=path)
        for raw in lines:
            if raw is None:
                session.skipped_lines += 1
                session.long_lines += 1
                continue
            if not raw.strip():
                continue
            record = parse_record(raw.decode("utf-8", "replace"))
            if record is None:
                session.skipped_lines += 1
            elif record["type"] not in KNOWN_TYPES or record["type"] == "header":
                session.unknown_records += 1
            else:
                session.records.append(record)
    return session
