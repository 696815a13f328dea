"""The run summary, from a recording: read in one streaming pass through the replay index
(`read_digest`), which holds a few dozen bytes a step and never the step records themselves, or
from a `Session` already in memory."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from amp_tui.core.fixes import MONITOR, TRAIN, fix_in_words
from amp_tui.core.jsonsafe import read_float
from amp_tui.core.numfmt import scale_text
from amp_tui.core.records import InForce, in_force_after, next_in_force, note_text, world_size_of
from amp_tui.recording.forecast_outcomes import (
    forecast_outcomes,
    is_forecast,
    is_verdict,
    outcome_text,
)
from amp_tui.recording.format import MAX_LINE_BYTES, SessionFormatError
from amp_tui.recording.fp8_file import read_fp8, trend_lines, verdict_lines
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.reader import (
    Session,
    header_record,
    parse_record,
    read_lines,
    resolve_session_path,
    too_long_message,
)
from amp_tui.recording.xray_file import CLOSEST_SHOWN, closest_lines, read_xray

FORECASTS_SHOWN = 10   # forecasts listed one a line (report --json has them all)
TEXT_LIMIT = 1000   # characters of a recorded string (a path, an error message) printed at most


@dataclass
class Summary:
    run_dir: str
    script: str
    device: str
    world_size: int            # ranks of the job (rank 0 recorded them: one run, one session)
    coordination: str | None   # how the ranks' words went round (the header's; None: not said)
    status: str                # finished / stopped / error / running-or-crashed
    steps: int                 # iterations recorded
    updates_applied: int       # updates the weights went through (a restore or resume brings a
    skipped: int               # checkpoint's counts back): the end record's counts
    rolled_back: int           # recorded iterations undone by a restore or a resume
    final_dtype: str | None
    final_scale: float | None
    # What the run trained with at its end besides the dtype (core/records.py's InForce): the
    # modules in fp32, the loss scale's floor, and the run's own floor (None: amp-tui's default)
    fp32_modules: list[str]
    scale_floor: float
    min_scale: float | None
    final_loss: float | None
    nonfinite_events: int
    interventions: int
    checkpoints: int
    calibration_skips: int = 0   # of the skips: GradScaler finding its scale at the start, no trouble
    errors: list[str] = field(default_factory=list)
    # The commands the run refused, {"step", "command", "reason", "source"}, in order: apart from
    # the errors (a refusal leaves the run as it was).
    refused: list[dict] = field(default_factory=list)
    notes: list[dict] = field(default_factory=list)   # {"step", "text"}: the run's notes, in order
    op_traces: list[dict] = field(default_factory=list)   # the ops that made a step non-finite
    # The last X-ray: {"step", "path", "closest"} (its file's closest ops), or "error" for why
    # its file can't be read; None: the run has none.
    xray: dict | None = None
    # The last fp8 what-if: {"step", "path", "filter", "lines"} (its verdict in lines), or "error".
    fp8: dict | None = None
    # The forecasts (forecast_scale, forecast_layer alerts) and whether they came true (forecast_outcomes.py)
    forecasts: list[dict] = field(default_factory=list)
    skipped_lines: int = 0
    unknown_records: int = 0
    long_lines: int = 0        # of skipped_lines: longer than the readers' limit, never read
    # What the run itself knew at its end, where its file could not say it (a full disk):
    run_status: str | None = None       # the state the run ended in
    steps_run: int | None = None        # the steps it trained
    unwritten: dict[str, int] = field(default_factory=dict)  # records given up, by type
    recording_error: str | None = None  # why: the OS's words and the path
    way: str = TRAIN   # how the run was driven (the header's): what its fixes are worded for

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


@dataclass
class RecordingDigest:
    """What a summary reads of a recording."""

    header: dict
    path: Path | None
    steps: int                   # step records
    skipped_steps: int           # of which say skipped
    last_step: dict | None       # the last step record, whole
    end: dict | None             # the last end record
    event_kinds: Counter         # events by kind
    errors: list[str]            # the messages of the error events, in file order
    in_force: InForce = field(default_factory=InForce)   # what the run trained with at its end
    refused: list[dict] = field(default_factory=list)   # `refusal_of` each refused event, in file order
    notes: list[dict] = field(default_factory=list)   # {"step", "text"} of the note events, in file order
    op_traces: list[dict] = field(default_factory=list)   # `op_trace_of` each non-finite event naming an op
    last_xray: dict | None = None   # the last xray event
    fp8_events: list[dict] = field(default_factory=list)   # the fp8 events, in file order
    forecasts: list[dict] = field(default_factory=list)   # forecast_outcomes of the events
    skipped_lines: int = 0
    unknown_records: int = 0
    long_lines: int = 0


def digest_of(session: Session) -> RecordingDigest:
    steps, events = session.steps, session.events
    return RecordingDigest(
        header=session.header, path=session.path, steps=len(steps),
        skipped_steps=sum(1 for s in steps if s.get("skipped")), last_step=steps[-1] if steps else None,
        end=session.end, event_kinds=Counter(e.get("kind") for e in events),
        in_force=in_force_after([session.header, *events, *steps[-1:], *([session.end] if session.end else [])]),
        errors=[str(e.get("message", "")) for e in events if e.get("kind") == "error"],
        refused=[refusal_of(e) for e in events if e.get("kind") == "refused"],
        notes=[_note(e) for e in events if e.get("kind") == "note"],
        op_traces=[op_trace_of(e) for e in events if e.get("kind") == "nonfinite" and e.get("op")],
        last_xray=next((e for e in reversed(events) if e.get("kind") == "xray"), None),
        fp8_events=[e for e in events if e.get("kind") == "fp8"],
        forecasts=forecast_outcomes(events, steps[-1].get("step") if steps else None),
        skipped_lines=session.skipped_lines, unknown_records=session.unknown_records,
        long_lines=session.long_lines)


def read_digest(target: str | Path) -> RecordingDigest:
    """The digest of a recording in one pass through its replay index, without holding the step
    records (a 100,000-step recording needs a few MB, not GB). The header, the last step, the end
    and the error events are read back whole and strictly, as `read_session` reads them, and a
    file that is no session is refused with its words. The counts are `read_session`'s on every
    recording a writer made, torn or cut short; a step line damaged after its leading fields (by
    hand) counts here as a step, where `read_session` would count it as damaged."""
    path = resolve_session_path(target)
    with open(path, "rb") as fh:
        first = next(read_lines(fh), b"")
        if first is None:
            raise SessionFormatError(too_long_message(path))
        header = header_record(first, os.fstat(fh.fileno()).st_size > len(first), path)
        with SessionIndex(path) as index:
            steps, skipped_lines = index.frames, index.damaged_lines + index.torn_tail
            last = None
            while steps and last is None:
                # The index takes a step line by its leading fields; one damaged after them is
                # found here, as read_session finds it, and the step before is the last.
                last = _record_at(fh, index.offsets[steps - 1], index.lengths[steps - 1], "step")
                if last is None:
                    steps -= 1
                    skipped_lines += 1
            skipped_steps = sum(1 for f in index.skipped_frames if f < steps)
            end = _record_at(fh, *index.end_at, "end") if index.end_at is not None else None
            kinds = Counter()
            for code, n in Counter(index.event_kinds).items():
                kinds[index.kinds[code]] += n
            error = index.kind_code("error")
            errors = [str((_record_at(fh, index.event_offsets[k], index.event_lengths[k], "event") or {})
                          .get("message", ""))
                      for k, code in enumerate(index.event_kinds) if code == error]
            refused = index.kind_code("refused")
            refusals = [refusal_of(_record_at(fh, index.event_offsets[k], index.event_lengths[k], "event") or {})
                        for k, code in enumerate(index.event_kinds) if code == refused]
            note = index.kind_code("note")
            notes = [_note(_record_at(fh, index.event_offsets[k], index.event_lengths[k], "event") or {})
                     for k, code in enumerate(index.event_kinds) if code == note]
            wanted = {index.kind_code(kind) for kind in ("nonfinite", "alert", "forecast", "forecast_checked", "fp8")}
            read = [_record_at(fh, index.event_offsets[k], index.event_lengths[k], "event") or {}
                    for k, code in enumerate(index.event_kinds) if code in wanted]
            op_traces = [op_trace_of(e) for e in read if e.get("kind") == "nonfinite" and e.get("op")]
            fp8_events = [e for e in read if e.get("kind") == "fp8"]
            # In file order, the what-ifs among them: an fp8 forecast comes true in a later one.
            said = [e for e in read if e.get("kind") in ("nonfinite", "fp8") or is_forecast(e) or is_verdict(e)]
            last_xray = _last_event(fh, index, "xray")
            unknown, long_lines = index.unknown_records, index.long_lines
            in_force = index.in_force(steps - 1)
            if end is not None:
                in_force = next_in_force(in_force, end)
    return RecordingDigest(
        header=header, path=path, steps=steps, skipped_steps=skipped_steps, last_step=last, end=end,
        event_kinds=kinds, errors=errors, in_force=in_force, refused=refusals, notes=notes, op_traces=op_traces,
        last_xray=last_xray, fp8_events=fp8_events,
        forecasts=forecast_outcomes(said, last.get("step") if last else None),
        skipped_lines=skipped_lines,
        unknown_records=unknown, long_lines=long_lines)


def op_trace_of(event: dict) -> dict:
    """What a report says of a non-finite event that names its op: the step, the op's sentence
    and the fix."""
    return {"step": event.get("step"), "op": event.get("op"), "op_module": event.get("op_module"),
            "op_phase": event.get("op_phase"), "message": str(event.get("op_message", "")),
            "fix": event.get("fix"), "fix_verified": event.get("fix_verified") is True}


def refusal_of(event: dict) -> dict:
    """What a report says of a refused command: its step, the command, why, and who sent it."""
    return {"step": event.get("step"), "command": event.get("command"), "reason": event.get("reason"),
            "source": event.get("source"), "message": str(event.get("message", ""))}


def _note(event: dict) -> dict:
    return {"step": event.get("step"), "text": note_text(event)}


def _record_at(fh, offset: int, length: int, kind: str) -> dict | None:
    """The record of `kind` at `offset`, parsed strictly and whole; None when it isn't one."""
    fh.seek(offset, os.SEEK_SET)
    raw = fh.read(length)
    record = parse_record(raw.decode("utf-8", "replace")) if len(raw) == length else None
    return record if record is not None and record.get("type") == kind else None


def _last_event(fh, index, kind: str) -> dict | None:
    """The last event of `kind` the index knows of, read from the session (None: none)."""
    code = index.kind_code(kind)
    found = [k for k, c in enumerate(index.event_kinds) if c == code]
    return _record_at(fh, index.event_offsets[found[-1]], index.event_lengths[found[-1]], "event") if found else None


def summarize(recording: Session | RecordingDigest, outcome: RunOutcome | None = None) -> Summary:
    d = digest_of(recording) if isinstance(recording, Session) else recording
    last, end, header = d.last_step, d.end, d.header
    device = header.get("device") if isinstance(header.get("device"), dict) else {}
    run_dir = str(d.path.parent) if d.path is not None else ""
    updates, skipped = _counts(end, last, d)
    return Summary(
        run_dir=run_dir,
        script=str(header.get("script", "")),
        device=f"{device.get('backend', '?')} {device.get('name', '')}".strip(),
        world_size=world_size_of(header),
        coordination=header.get("coordination") if isinstance(header.get("coordination"), str) else None,
        status=_text((end or {}).get("status", "incomplete")),
        steps=d.steps,
        updates_applied=updates,
        skipped=skipped,
        rolled_back=max(0, d.steps - updates - skipped),
        final_dtype=_text((end or last or {}).get("dtype", header.get("dtype")), None),
        final_scale=_final_scale(end, last),
        fp32_modules=list(d.in_force.fp32_modules),
        scale_floor=d.in_force.scale_floor,
        min_scale=d.in_force.min_scale,
        final_loss=read_float(last.get("loss")) if last else None,
        nonfinite_events=d.event_kinds.get("nonfinite", 0),
        calibration_skips=d.event_kinds.get("calibration", 0),
        interventions=d.event_kinds.get("intervention", 0),
        checkpoints=d.event_kinds.get("checkpoint_saved", 0),
        errors=list(d.errors),
        refused=list(d.refused),
        notes=list(d.notes),
        op_traces=list(d.op_traces),
        xray=_xray_of(d.last_xray, d.path.parent if d.path is not None else None),
        fp8=_fp8_of(d.fp8_events, d.path.parent if d.path is not None else None),
        forecasts=list(d.forecasts),
        way=MONITOR if header.get("way") == MONITOR else TRAIN,
        skipped_lines=d.skipped_lines,
        unknown_records=d.unknown_records,
        long_lines=d.long_lines,
        **({"run_status": outcome.state, "steps_run": outcome.steps,
            "unwritten": dict(outcome.unwritten), "recording_error": outcome.recording_error}
           if outcome is not None and outcome.unwritten else {}),
    )


def _text(value, default: str | None = "?") -> str | None:
    """A field a summary shows as text; `default` when a damaged file put anything else there."""
    return value if isinstance(value, str) else default


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _xray_of(event: dict | None, run_dir: Path | None) -> dict | None:
    """The last X-ray as a report says it: its event's step and file, the file's closest ops."""
    if event is None:
        return None
    said = {"step": event.get("step"), "path": str(event.get("path", ""))}
    try:
        if run_dir is None:
            raise OSError("the recording's folder is not known")
        said["closest"] = read_xray(run_dir, said["path"])["closest"]
    except (OSError, ValueError) as exc:
        said["error"] = str(exc)
    return said


def _fp8_of(events: list[dict], run_dir: Path | None) -> dict | None:
    """The fp8 what-ifs as a report says them: the last one's step, files and verdict in lines,
    and, where there were several, how each layer's verdict and crest went over them."""
    if not events:
        return None
    event = events[-1]
    said = {"step": event.get("step"), "path": str(event.get("path", "")), "filter": event.get("filter"),
            "count": len(events)}
    try:
        if run_dir is None:
            raise OSError("the recording's folder is not known")
        said["lines"] = verdict_lines(read_fp8(run_dir, said["path"]))
        said["trend"] = trend_lines(run_dir, events)
    except (OSError, ValueError) as exc:
        said["error"] = str(exc)
    return said


def _counts(end: dict | None, last: dict | None, d: RecordingDigest) -> tuple[int, int]:
    """(updates applied, skipped) as the run counted them: the end record's, else the last step's.

    Recounting the step records would count the iterations a restore or a resume rolled back
    as if the weights still held them."""
    for record in (end, last):
        if record is not None and _count(record.get("updates")) and _count(record.get("skipped_total")):
            return record["updates"], record["skipped_total"]
    return d.steps - d.skipped_steps, d.skipped_steps


def _final_scale(end: dict | None, last: dict | None) -> float | None:
    if end is not None and "scale" in end:
        return read_float(end["scale"])
    return read_float(last.get("scale")) if last else None


def _coordination_words(coordination: str) -> str:
    """The header's `coordination`, for a person: where the ranks' words went round."""
    if coordination == "gradients":
        return "in DDP's gradient all-reduce"
    return f"in collectives of their own: {coordination.removeprefix('collectives: ')}"


def summary_lines(s: Summary) -> list[tuple[str, str]]:
    scale = "none (no scaler)" if s.final_scale is None else f"{s.final_scale:g}"
    rows = [
        ("run dir", s.run_dir),
        ("script", s.script),
        ("device", s.device),
        ("status", s.status),
        ("steps", str(s.steps)),
    ]
    if s.world_size > 1:
        rows.insert(3, ("ranks", f"{s.world_size}, recorded by rank 0"))
        if s.coordination:
            rows.insert(4, ("ranks' words", _coordination_words(s.coordination)))
    if s.unwritten:
        # The file can't say how the run ended: say both, and what is missing from the file.
        rows[-2:] = [
            ("status", f"{s.run_status} (the run, after {s.steps_run} steps)"),
            ("recording", f"{s.status}: {describe_records(s.unwritten)} could not be written "
                          f"({s.recording_error})"),
            ("steps", f"{s.steps} recorded of {s.steps_run}"),
        ]
    rows += [
        ("updates applied", f"{s.updates_applied} of {s.steps}" + (
            f" ({s.rolled_back} rolled back by a restore or resume)" if s.rolled_back else "")),
        ("skipped", str(s.skipped) + (f" ({s.calibration_skips} GradScaler calibrating its scale at the start)"
                                      if s.calibration_skips else "")),
        ("final dtype", s.final_dtype or "?"),
        ("final scale", scale),
        ("fp32 modules", ", ".join(s.fp32_modules) if s.fp32_modules else "none"),
        ("scale floor", scale_text(s.scale_floor) + (" (amp-tui's default)" if s.min_scale is None
                                                     else " (--min-scale)")),
        ("final loss", "?" if s.final_loss is None else f"{s.final_loss:.6g}"),
        ("non-finite events", str(s.nonfinite_events)),
        ("interventions", str(s.interventions)),
        ("checkpoints", str(s.checkpoints)),
    ]
    if s.errors:
        rows.append(("errors", str(len(s.errors))))
    if s.refused:
        rows.append(("refused commands", str(len(s.refused))))
    if s.notes:
        rows.append(("notes", str(len(s.notes))))
    if s.op_traces:
        rows.append(("first bad op", _op_line(s.op_traces[0], s.way)
                     + (f" (and {len(s.op_traces) - 1} more steps)" if len(s.op_traces) > 1 else "")))
    if s.xray is not None:
        rows += _xray_rows(s.xray)
    if s.fp8 is not None:
        rows += _fp8_rows(s.fp8)
    if s.forecasts:
        came = sum(1 for f in s.forecasts if f["came_true"])
        rows.append(("forecasts", f"{len(s.forecasts)}, {came} came true"))
        rows += [("", outcome_text(f)) for f in s.forecasts[:FORECASTS_SHOWN]]
        if len(s.forecasts) > FORECASTS_SHOWN:
            rows.append(("", f"... and {len(s.forecasts) - FORECASTS_SHOWN} more (report --json lists them all)"))
    if s.skipped_lines or s.unknown_records:
        long = f" ({s.long_lines} over {MAX_LINE_BYTES >> 20} MiB)" if s.long_lines else ""
        rows.append(("unreadable records",
                     f"{s.skipped_lines} damaged{long}, {s.unknown_records} unknown"))
    return rows


def _op_line(trace: dict, way: str) -> str:
    fix = trace["fix"]
    verified = "verified" if trace["fix_verified"] else "not verified"
    said = f"; fix: {fix_in_words(fix, way, live=False)} ({verified})" if fix else ""
    return f"step {trace['step']}: {trace['message']}{said}"


def _xray_rows(xray: dict) -> list[tuple[str, str]]:
    """The last X-ray's file, then its closest ops, least headroom first, one a row."""
    if "error" in xray:
        return [("last X-ray", f"step {xray['step']}: {xray['path']} can't be read ({xray['error']})")]
    lines = closest_lines(xray, CLOSEST_SHOWN)
    return [("last X-ray", f"step {xray['step']}: {xray['path']}")] + \
        [("closest to max" if i == 0 else "", line) for i, line in enumerate(lines)]


def _fp8_rows(fp8: dict) -> list[tuple[str, str]]:
    """The last fp8 what-if's file and filter, then its verdict, one line a row."""
    if "error" in fp8:
        return [("last fp8 what-if", f"step {fp8['step']}: {fp8['path']} can't be read ({fp8['error']})")]
    files = fp8["path"] + (f", filter {fp8['filter']}" if isinstance(fp8.get("filter"), str) else "")
    rows = [("last fp8 what-if", f"step {fp8['step']}: {files}")] + [("", line) for line in fp8["lines"]]
    if fp8.get("trend"):
        rows += [("fp8 over the run" if i == 0 else "", line) for i, line in enumerate(fp8["trend"])]
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
