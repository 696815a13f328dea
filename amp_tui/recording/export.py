"""`amp-tui export`: a recording to TensorBoard event files, CSV files, W&B and MLflow, in one pass.

The recording is read through the replay's index (amp_tui.recording.stream), so what the index
skips (a torn last line, damaged lines) is skipped here too and counted in the result, and a run
still being written is exported up to its last complete record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from amp_tui.recording.index import SessionIndex
from amp_tui.recording.stream import entries


@dataclass
class ExportResult:
    steps: int                           # step records in the recording
    events: int
    ended: bool                          # it has an end record (else: still running, or killed)
    skipped: str | None                  # what the reader skipped, in words (None: nothing)
    written: dict[str, Path | str] = field(default_factory=dict)   # what was written where


def export(target, *, tensorboard: str | Path | None = None, csv: str | Path | None = None,
           layers_csv: str | Path | None = None, forecasts_csv: str | Path | None = None,
           wandb: str | bool | None = None, mlflow: str | bool | None = None,
           notify: Callable[[str], None] = lambda _text: None) -> ExportResult:
    """Write the recording at `target` (a run directory or a session file) to the outputs given.
    Raises SessionFormatError for a file that is not a session, MissingExtra when TensorBoard
    is asked for without its package, ValueError for outputs that would overwrite the session or
    each other, OSError when an output can't be written (a CSV file is then not left half
    written). `wandb` (a project, or True) and `mlflow` (a tracking URI, or True) each get a run
    of their own (amp_tui.recording.trackers; TrackerError when one can't be opened). `notify`
    hears, before the records are written, what makes the export slower than it could be
    (TensorBoard's checksums without google-crc32c)."""
    from amp_tui.recording.csv_export import LayersCsv, StepsCsv
    from amp_tui.recording.forecast_csv import ForecastsCsv

    with SessionIndex(target) as index:
        _refuse_overwriting(index.path, csv, layers_csv, forecasts_csv)
        result = ExportResult(index.frames, index.event_count, index.end is not None,
                              index.skipped_summary())
        sinks = []
        try:
            if tensorboard is not None:
                from amp_tui.recording.tensorboard import SLOW_CHECKSUMS, TensorBoardWriter

                # Nobody waits on an export step by step: slow checksums beat no export.
                writer = TensorBoardWriter(tensorboard, allow_slow_checksums=True)
                if writer.slow_checksums:
                    notify(SLOW_CHECKSUMS)
                sinks.append(writer)
                result.written["tensorboard"] = writer.path
            if csv is not None:
                sinks.append(StepsCsv(csv))
                result.written["csv"] = Path(csv)
            if layers_csv is not None:
                sinks.append(LayersCsv(layers_csv))
                result.written["layers_csv"] = Path(layers_csv)
            if forecasts_csv is not None:
                sinks.append(ForecastsCsv(forecasts_csv))
                result.written["forecasts_csv"] = Path(forecasts_csv)
            if wandb is not None or mlflow is not None:
                from amp_tui.recording.trackers import open_writers

                for writer in open_writers(wandb=wandb, mlflow=mlflow, run_name=index.path.parent.name,
                                           session=index.path, live=False):
                    sinks.append(writer)
                    result.written[writer.backend.name] = _tracker_run(writer.backend)
            for record, line in entries(index):
                for sink in sinks:
                    sink.write(record, line)
        except BaseException:
            for sink in sinks:
                sink.discard()
            raise
        for sink in sinks:
            sink.finish()
    return result


def _tracker_run(backend) -> str:
    """Where a tracker's run is, in words."""
    if backend.name == "MLflow":
        return f"run {backend.run_id} at {backend.tracking_uri}"
    run = backend.run
    return f"run {run.id} in project {run.project}" + (f" ({run.dir})" if getattr(run, "offline", False) else "")


def _refuse_overwriting(session: Path, *outputs) -> None:
    """An output that is the session itself, or two outputs that are one file, would lose data."""
    seen: list[Path] = []
    for out in outputs:
        if out is None:
            continue
        out = Path(out)
        if out.exists() and out.samefile(session):
            raise ValueError(f"{out} is the session being exported: choose another output file")
        if any(out.resolve() == other.resolve() for other in seen):
            raise ValueError(f"{out} is given twice: --csv, --layers-csv and --forecasts-csv need a file each")
        seen.append(out)
