"""The run summary, from a live run's records or from a recording."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from amp_tui.core.jsonsafe import read_float
from amp_tui.recording.format import MAX_LINE_BYTES
from amp_tui.recording.reader import Session

TEXT_LIMIT = 1000   # characters of a recorded string (a path, an error message) printed at most


@dataclass
class Summary:
    run_dir: str
    script: str
    device: str
    status: str                # finished / stopped / error / running-or-crashed
    steps: int                 # iterations recorded
    updates_applied: int       # updates the weights went through (a restore or resume brings a
    skipped: int               # checkpoint's counts back): the end record's counts
    rolled_back: int           # recorded iterations undone by a restore or a resume
    final_dtype: str | None
    final_scale: float | None
    final_loss: float | None
    nonfinite_events: int
    interventions: int
    checkpoints: int
    errors: list[str] = field(default_factory=list)
    skipped_lines: int = 0
    unknown_records: int = 0
    long_lines: int = 0        # of skipped_lines: longer than the readers' limit, never read
    # What the run itself knew at its end, where its file could not say it (a full disk):
    run_status: str | None = None       # the state the run ended in
    steps_run: int | None = None        # the steps it trained
    unwritten: dict[str, int] = field(default_factory=dict)  # records given up, by type
    recording_error: str | None = None  # why: the OS's words and the path

    def as_json(self) -> dict:
        data = asdict(self)
        from amp_tui.core.jsonsafe import encode_float
        data["final_scale"] = encode_float(self.final_scale)
        data["final_loss"] = encode_float(self.final_loss)
        return data


@dataclass
class RunOutcome:
    """The end of a run as the run knows it (the recording may say less: a full disk)."""

    state: str
    steps: int
    unwritten: dict[str, int]
    recording_error: str | None


def summarize(session: Session, outcome: RunOutcome | None = None) -> Summary:
    steps = session.steps
    events = session.events
    last = steps[-1] if steps else None
    end = session.end
    header = session.header
    device = header.get("device") or {}
    path = session.path
    run_dir = str(path.parent) if path is not None else ""
    updates, skipped = _counts(end, last, steps)
    return Summary(
        run_dir=run_dir,
        script=str(header.get("script", "")),
        device=f"{device.get('backend', '?')} {device.get('name', '')}".strip(),
        status=(end or {}).get("status", "incomplete"),
        steps=len(steps),
        updates_applied=updates,
        skipped=skipped,
        rolled_back=max(0, len(steps) - updates - skipped),
        final_dtype=(end or last or {}).get("dtype", header.get("dtype")),
        final_scale=_final_scale(end, last),
        final_loss=read_float(last.get("loss")) if last else None,
        nonfinite_events=sum(1 for e in events if e.get("kind") == "nonfinite"),
        interventions=sum(1 for e in events if e.get("kind") == "intervention"),
        checkpoints=sum(1 for e in events if e.get("kind") == "checkpoint_saved"),
        errors=[str(e.get("message", "")) for e in events if e.get("kind") == "error"],
        skipped_lines=session.skipped_lines,
        unknown_records=session.unknown_records,
        long_lines=session.long_lines,
        **({"run_status": outcome.state, "steps_run": outcome.steps,
            "unwritten": dict(outcome.unwritten), "recording_error": outcome.recording_error}
           if outcome is not None and outcome.unwritten else {}),
    )


def _counts(end: dict | None, last: dict | None, steps: list[dict]) -> tuple[int, int]:
    """(updates applied, skipped) as the run counted them: the end record's, else the last step's.

    Recounting the step records would count the iterations a restore or a resume rolled back
    as if the weights still held them."""
    for record in (end, last):
        if record is not None and isinstance(record.get("updates"), int) \
                and isinstance(record.get("skipped_total"), int):
            return record["updates"], record["skipped_total"]
    return (sum(1 for s in steps if not s.get("skipped")), sum(1 for s in steps if s.get("skipped")))


def _final_scale(end: dict | None, last: dict | None) -> float | None:
    if end is not None and "scale" in end:
        return read_float(end["scale"])
    return read_float(last.get("scale")) if last else None


def summary_lines(s: Summary) -> list[tuple[str, str]]:
    scale = "none (no scaler)" if s.final_scale is None else f"{s.final_scale:g}"
    rows = [
        ("run dir", s.run_dir),
        ("script", s.script),
        ("device", s.device),
        ("status", s.status),
        ("steps", str(s.steps)),
    ]
    if s.unwritten:
        # The file can't say how the run ended: say both, and what is missing from the file.
        rows[3:] = [
            ("status", f"{s.run_status} (the run, after {s.steps_run} steps)"),
            ("recording", f"{s.status}: {describe_records(s.unwritten)} could not be written "
                          f"({s.recording_error})"),
            ("steps", f"{s.steps} recorded of {s.steps_run}"),
        ]
    rows += [
        ("updates applied", f"{s.updates_applied} of {s.steps}" + (
            f" ({s.rolled_back} rolled back by a restore or resume)" if s.rolled_back else "")),
        ("skipped", str(s.skipped)),
        ("final dtype", s.final_dtype or "?"),
        ("final scale", scale),
        ("final loss", "?" if s.final_loss is None else f"{s.final_loss:.6g}"),
        ("non-finite events", str(s.nonfinite_events)),
        ("interventions", str(s.interventions)),
        ("checkpoints", str(s.checkpoints)),
    ]
    if s.errors:
        rows.append(("errors", str(len(s.errors))))
    if s.skipped_lines or s.unknown_records:
        long = f" ({s.long_lines} over {MAX_LINE_BYTES >> 20} MiB)" if s.long_lines else ""
        rows.append(("unreadable records",
                     f"{s.skipped_lines} damaged{long}, {s.unknown_records} unknown"))
    return rows


def describe_records(counts: dict[str, int]) -> str:
    """{"step": 13, "event": 2, "end": 1} -> "13 step records, 2 events and the end record"."""
    names = {"step": ("step record", "step records"), "event": ("event", "events"),
             "header": ("the header", "headers"), "end": ("the end record", "end records")}
    parts = []
    for kind, n in counts.items():
        if n <= 0:
            continue
        one, many = names.get(kind, ("record", "records"))
        parts.append(one if n == 1 and kind in ("end", "header") else f"{n} {one if n == 1 else many}")
    if not parts:
        return "no record"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
