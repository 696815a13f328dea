"""`amp-tui ls`: the runs under some folders, with their state, read cheaply: the header, the
file's tail, and its last step and last event wherever they lie (a long run's last event can be
far behind the tail), looked for from the end backwards.

Whether a job still runs in a folder is the caller's question (`is_running`: the control socket
answers it), so the read side needs nothing of the job."""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from amp_tui.core.jsonsafe import read_float
from amp_tui.core.records import next_state, world_size_of
from amp_tui.recording.reader import last_record, parse_record, step_number, tail_records

TAIL_BYTES = 256 * 1024   # where the end record is looked for


@dataclass
class RunRow:
    run_dir: Path
    state: str          # running / finished / stopped / error / crashed / unreadable
    script: str
    steps: int | None   # iterations recorded (last step + 1)
    dtype: str | None
    scale: float | None
    skipped: int | None
    last_event: str
    modified: float
    world_size: int = 1  # ranks of the job (rank 0 recorded it: one run, one session)


def describe_run(run_dir: Path, is_running: Callable[[Path], bool]) -> RunRow:
    session = run_dir / "session.jsonl"
    modified = session.stat().st_mtime
    try:
        with open(session, "rb") as fh:
            header = parse_record(fh.readline(1 << 20).decode("utf-8", "replace")) or {}
        records = tail_records(session, TAIL_BYTES)
        last = last_record(session, "step", valid=lambda r: step_number(r.get("step")) is not None)
        event = last_record(session, "event")
    except OSError:
        return RunRow(run_dir, "unreadable", "?", None, None, None, None, "", modified)
    end = next((r for r in reversed(records) if r.get("type") == "end"), None)
    if is_running(run_dir):
        state = "running"
    elif end is not None:
        state = next_state("running", end)
    else:
        state = "crashed"
    last_event = "" if event is None else \
        f"step {event.get('step')}: {event.get('kind')}: {event.get('message', '')}"
    dtype = (last or end or header).get("dtype")
    scale = read_float((last or {}).get("scale"))
    skipped = (last or {}).get("skipped_total", 0)
    return RunRow(
        run_dir=run_dir, state=state, script=Path(str(header.get("script", "?"))).name,
        steps=(last["step"] + 1) if last else 0, dtype=dtype if isinstance(dtype, str) else None,
        scale=scale, skipped=skipped if step_number(skipped) is not None else None,
        last_event=last_event, modified=modified,
        world_size=world_size_of(header))


def list_runs(folder: Path, is_running: Callable[[Path], bool]) -> list[RunRow]:
    """Every run directory directly under `folder` (newest first)."""
    folder = Path(folder)
    if (folder / "session.jsonl").is_file():
        return [describe_run(folder, is_running)]
    rows = [describe_run(d, is_running) for d in folder.iterdir() if (d / "session.jsonl").is_file()] \
        if folder.is_dir() else []
    return sorted(rows, key=lambda r: r.modified, reverse=True)


def expand_folders(patterns: list[str]) -> tuple[list[Path], list[str]]:
    """The folders (or run directories) named, a quoted glob like 'exp/*' expanded as the shell
    would; and the names that matched nothing. A path that exists is taken as it is, even if its
    name holds glob characters."""
    found: list[Path] = []
    missing: list[str] = []
    for pattern in patterns:
        if Path(pattern).exists():
            found.append(Path(pattern))
            continue
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else []
        dirs = [Path(m) for m in matches if Path(m).is_dir()]
        if dirs:
            found.extend(dirs)
        else:
            missing.append(pattern)
    return found, missing


def list_runs_in(folders: list[Path], is_running: Callable[[Path], bool]) -> list[RunRow]:
    """The runs of every folder, each run once (a run named twice, or through two patterns),
    newest first."""
    rows: dict[Path, RunRow] = {}
    for folder in folders:
        for row in list_runs(folder, is_running):
            rows.setdefault(row.run_dir.resolve(), row)
    return sorted(rows.values(), key=lambda r: r.modified, reverse=True)
