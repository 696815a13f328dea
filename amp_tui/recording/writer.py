"""Writing a session: records appended as bytes, kept until the file takes them."""

from __future__ import annotations

import os
import time
from pathlib import Path

from amp_tui.core import jsonsafe
from amp_tui.recording.format import FORMAT, VERSION, EncodedStep


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
        line = record.line if type(record) is EncodedStep else jsonsafe.dumps(record)
        self._pending += (line + "\n").encode("utf-8")
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


