"""A run's recording: the session writer behind one fan-out to the observers, with one error policy.

Every record goes to the file first, then to each observer (the dashboard's buffer, the headless
printer, a TensorBoard writer...). An observer that raises is reported on stderr and training goes
on. A write the disk refuses is kept (the writer holds the bytes) and reported to the run through
`on_refused(message, first)`, which decides whether to pause or stop (`first`: the disk took the
write before this one); records made before the file is opened (by the pre-flight) are kept and
written after the header.

A run of several ranks records a probed step once its figures have come from every rank, which
is a step later: meanwhile `hold()` keeps every later record back, and `release(step)` writes the
step's record, then those, in the order they were made.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Callable

from amp_tui.recording.writer import SessionWriter

Observer = Callable[[dict], None]


class Observers(list):
    """The callbacks that see every record, in the order they were added."""

    def notify(self, record: dict) -> None:
        for observer in list(self):
            try:
                observer(record)
            except Exception:  # noqa: BLE001 - a broken observer must not stop training
                traceback.print_exc(file=sys.stderr)


class Recorder:
    def __init__(self, path: Path, *, on_refused: Callable[[str, bool], None]):
        self.path = Path(path)
        self.observers = Observers()
        self._on_refused = on_refused
        self._writer: SessionWriter | None = None
        self._early: list[dict] = []   # records made before the file exists
        self._refusing = False         # the last write failed
        # Records made while a step's record waits to be made (hold/release): (record, flush, kept).
        self._held: list[tuple[dict, bool, bool]] | None = None

    @property
    def opened(self) -> bool:
        return self._writer is not None

    @property
    def closed(self) -> bool:
        return self._writer is None or self._writer.closed

    def open(self, header: dict, *, append: bool, flush_interval: float) -> None:
        """Create the file with `header` (or append to it, resuming), then write what came early.
        Step records are flushed every `flush_interval` seconds; events at once."""
        self._writer = SessionWriter(self.path, header, append=append, flush_interval=flush_interval)
        self.observers.notify({"type": "header", **header})
        early, self._early = self._early, []
        for record in early:
            self.emit(record)

    @property
    def holding(self) -> bool:
        return self._held is not None

    def hold(self) -> None:
        """Keep every record from now on back, in order, until `release`: they come after a step
        whose record is not made yet (its figures are still on their way from the other ranks)."""
        if self._held is None:
            self._held = []

    def release(self, step: dict | None, *, flush: bool = False) -> None:
        """Write `step` (the record held for; None: it could not be made), then every record
        kept back behind it, in order."""
        held, self._held = self._held or [], None
        if step is not None:
            self.emit(step, flush=flush)
        for record, flush_it, kept in held:
            if kept:
                self.keep(record)
            else:
                self.emit(record, flush=flush_it)

    def emit(self, record: dict, *, flush: bool = False) -> None:
        """To the file (flushed now with `flush`), then to every observer."""
        if self._held is not None:
            self._held.append((record, flush, False))
            return
        if self._writer is None:
            self._early.append(record)
            return
        if not self._writer.closed:
            try:
                self._writer.write(record)
                if flush:
                    self._writer.flush()
                self._refusing = False
            except OSError as exc:
                first, self._refusing = not self._refusing, True
                self._on_refused(f"could not append to {self.path}: {exc.strerror or exc}", first)
        self.observers.notify(record)

    def keep(self, record: dict) -> None:
        """Hold `record` for the file even while the disk refuses it (the file will say why it
        stopped taking records, once it can), and show it to the observers now (after what is
        held, while a step's record waits)."""
        if self._held is not None:
            self._held.append((record, False, True))
            return
        if self._writer is not None and not self._writer.closed:
            try:
                self._writer.write(record)
            except OSError:
                pass   # pending in the writer
        self.observers.notify(record)

    def pending_records(self) -> dict[str, int]:
        """Records the disk has refused so far and that are still kept, by type."""
        return self._writer.pending_records() if not self.closed else {}

    def finish(self, end: dict) -> None:
        """Write the end record and everything kept, and close the file. Raises OSError with
        nothing given up when the disk still refuses them (try again, or `give_up`)."""
        self.release(None)   # what a step still held for had behind it, if the run could not wait
        self._writer.finish(end)
        self.observers.notify({"type": "end", **end})

    def give_up(self, end: dict) -> dict[str, int]:
        """Close without what the disk refused; returns the records lost, by type."""
        self.release(None)
        lost = self._writer.abandon()
        self.observers.notify({"type": "end", **end, "unwritten": dict(lost)})
        return lost


class RankEcho(Recorder):
    """The recording of a rank other than 0, which records nothing (rank 0 writes the session):
    each event is printed as one line instead, for the rank's own output (RUN_DIR/rank<N>.log)."""

    def __init__(self, path: Path, *, prefix: str, echo: Callable[[str], None] | None = None):
        super().__init__(path, on_refused=lambda message, first: None)
        self._prefix = prefix
        self._echo = echo
        self._open = False
        self._finished = False

    @property
    def opened(self) -> bool:
        return self._open

    @property
    def closed(self) -> bool:
        return self._finished

    def open(self, header: dict, *, append: bool, flush_interval: float) -> None:
        self._open = True

    def emit(self, record: dict, *, flush: bool = False) -> None:
        if self._echo is not None and record.get("type") == "event":
            self._echo(f"{self._prefix}: step {record.get('step')}: {record.get('kind')}: "
                       f"{record.get('message', '')}")

    def keep(self, record: dict) -> None:
        self.emit(record)

    def pending_records(self) -> dict[str, int]:
        return {}

    def finish(self, end: dict) -> None:
        self._finished = True

    def give_up(self, end: dict) -> dict[str, int]:
        self._finished = True
        return {}
