"""Reading a session whole: every valid record, and a count of what had to be skipped.

The replay index (amp_tui.recording.index) reads the same lines with the same rules, keeping only
what it needs; `amp-tui ls` reads a file's tail (`tail_records`) and its last record of a kind
(`last_record`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from amp_tui.core import jsonsafe
from amp_tui.recording.format import (
    FORMAT,
    KNOWN_TYPES,
    MAX_LINE_BYTES,
    VERSION,
    NoSessionError,
    SessionFormatError,
    SessionStarting,
)

_SKIP_BYTES = 1 << 20   # an over-long line is read past in pieces of this size


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
        raise NoSessionError(f"no session found at {target}")
    return path


def header_record(first: bytes, ended: bool, path: Path) -> dict:
    """The session header from the file's first line; `ended`: the line's newline was read.
    An empty file, or one line without its newline, is what a run that has just started has
    written of its header so far, and is said to be so (SessionStarting) rather than called no
    session."""
    if not first and not ended:    # the writer has created the file, its header comes next
        raise SessionStarting(f"{path} is empty: a run that has just started has not written "
                              "its header yet")
    parsed = parse_record(first.decode("utf-8", "replace"))
    if parsed is None and not ended:
        raise SessionStarting(f"{path} has no complete header yet: a run that has just started "
                              "is writing it (or the file was cut short)")
    return check_header(parsed, path)


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


MAX_STEP = 1 << 62   # larger step numbers are damage (and don't fit the replay index's arrays)


def step_number(value: Any) -> int | None:
    """A recorded step number (or count) as an int; None when it is anything else: a bool, a
    float, a negative number or one past MAX_STEP."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_STEP:
        return None
    return value


def parse_record(line: str) -> dict | None:
    """One line -> a record dict, or None when the line is damaged. Its strings are text any
    output takes (see jsonsafe.loads_text)."""
    try:
        record = jsonsafe.loads_text(line)
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
        header = header_record(first, os.fstat(fh.fileno()).st_size > len(first), path)
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


def tail_records(path: Path, size: int) -> list[dict]:
    """The valid records in the last `size` bytes of a session (the first line there is cut
    unless the tail is the whole file): what a listing needs without reading the file."""
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        total = fh.tell()
        fh.seek(max(0, total - size))
        data = fh.read()
    lines = data.split(b"\n")
    if total > size:
        lines = lines[1:]
    out = []
    for raw in lines:
        record = parse_record(raw.decode("utf-8", "replace")) if raw.strip() else None
        if record is not None:
            out.append(record)
    return out


def last_record(path: Path, kind: str, block: int = 1 << 20,
                valid: Callable[[dict], bool] | None = None) -> dict | None:
    """The last valid record of type `kind` in a session (and that `valid` accepts, when given),
    wherever it lies: looked for from the end backwards, a block at a time (a long run's last
    event can lie far behind its tail). Only the lines that hold `"kind"` are parsed."""
    needle = jsonsafe.dumps(kind).encode()
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        carry = b""   # the line the block after this one starts with: it begins in this block
        while end > 0:
            start = max(0, end - block)
            fh.seek(start)
            data = fh.read(end - start) + carry
            cut = data.find(b"\n") + 1 if start > 0 else 0
            if start > 0 and cut == 0:
                carry, end = data, start   # no line ends here: one long line, read on with the block before
                continue
            carry, data = data[:cut], data[cut:]
            at = len(data)
            while (at := data.rfind(needle, 0, at)) >= 0:
                line_start = data.rfind(b"\n", 0, at) + 1
                line_end = data.find(b"\n", at)
                record = parse_record(data[line_start:len(data) if line_end < 0 else line_end]
                                      .decode("utf-8", "replace"))
                if record is not None and record.get("type") == kind and (valid is None or valid(record)):
                    return record
                at = line_start
            end = start
    return None
