"""A session's records one at a time, in file order, through the replay's index.

The exporters read a recording through `SessionIndex`, so they skip what it skips (a torn last
line, damaged lines, unknown records) and read a run still being written up to its last complete
line. The index keeps offsets, not records: the step records are read back here in file order
with one buffered sequential pass, and parsed one by one, so a session of any length is never
held in memory.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from amp_tui.recording.index import SessionIndex
from amp_tui.recording.reader import parse_record

READ_BUFFER = 1 << 20


def step_lines(index: SessionIndex, frames: Iterable[int] | None = None) -> Iterator[tuple[int, bytes, dict]]:
    """(frame, its line, the step record parsed from it) for each frame (all of them by default),
    in file order; a line that no longer parses (the file changed under us) is left out."""
    wanted = range(index.frames) if frames is None else frames
    with open(index.path, "rb", buffering=READ_BUFFER) as fh:
        position = 0
        for frame in wanted:
            offset, length = index.offsets[frame], index.lengths[frame]
            if offset != position:
                fh.seek(offset)
            raw = fh.read(length)
            position = offset + len(raw)
            if len(raw) != length:
                return
            # As the index read it: undecodable bytes replaced, not the line refused.
            record = parse_record(raw.decode("utf-8", "replace"))
            if record is not None and record["type"] == "step":
                yield frame, raw, record


def step_records(index: SessionIndex, frames: Iterable[int] | None = None) -> Iterator[tuple[int, dict]]:
    """(frame, step record), as `step_lines` reads them."""
    for frame, _raw, record in step_lines(index, frames):
        yield frame, record


def entries(index: SessionIndex) -> Iterator[tuple[dict, bytes | None]]:
    """The header, then every step and event record in the order they were written, then the end
    record when there is one: what an observer of the live run saw. Each comes with its line
    when it is a step record (None otherwise), for the writers that copy its figures as written."""
    yield {"type": "header", **index.header}, None
    events = index.event_count
    k = 0
    for frame, raw, record in step_lines(index):
        while k < events and index.event_frames[k] <= frame:
            yield index.event(k), None
            k += 1
        yield record, raw
    while k < events:
        yield index.event(k), None
        k += 1
    if index.end is not None:
        yield index.end, None


def records(index: SessionIndex) -> Iterator[dict]:
    """The records of `entries`, without their lines."""
    for record, _raw in entries(index):
        yield record
