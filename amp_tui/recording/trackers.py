"""W&B and MLflow, opened by name for a live run (`--wandb`, `--mlflow`, `wandb=`, `mlflow=`) or an
export: the one place that turns what the user asked for into a tracker's run.

`wandb`: a project name, or True (WANDB_PROJECT, else "amp-tui"). `mlflow`: a tracking URI, or
True (MLFLOW_TRACKING_URI, else MLflow's default). Either logs into the framework's own run where
one is active (see wandb_log, mlflow_log).
"""

from __future__ import annotations

from pathlib import Path

from amp_tui.recording.extras import MissingExtra
from amp_tui.recording.tracking import TrackingObserver, TrackingWriter

EXPORT_BATCH_STEPS = 200       # an export's steps a batch (MLflow: 1,000 metrics a call)


class TrackerError(Exception):
    """A tracker's run could not be opened; the message names the tracker and why."""


def _project(wandb) -> str | None:
    return wandb if isinstance(wandb, str) and wandb else None


def _uri(mlflow) -> str | None:
    return str(mlflow) if isinstance(mlflow, (str, Path)) and str(mlflow) else None


def check_trackers(*, wandb=None, mlflow=None) -> str | None:
    """Why the trackers asked for can't be used (a package missing), before anything starts."""
    from amp_tui.recording import mlflow_log, wandb_log
    for asked, module in ((wandb, wandb_log), (mlflow, mlflow_log)):
        if asked is not None and asked is not False:
            try:
                module.check_available()
            except MissingExtra as exc:
                return str(exc)
    return None


def open_writers(*, wandb=None, mlflow=None, run_name: str | None, session: Path | None,
                 live: bool = True, mlflow_run_id: str | None = None) -> list[TrackingWriter]:
    """A TrackingWriter for each tracker asked for. A live run logs into the framework's active
    run where there is one (an export always opens its own). Raises MissingExtra, or
    TrackerError for a run the tracker can't open."""
    writers: list[TrackingWriter] = []
    try:
        _open(writers, wandb, mlflow, run_name, session, live, mlflow_run_id)
    except MissingExtra:
        _discard(writers)
        raise
    except Exception as exc:  # noqa: BLE001 - the tracker library's own errors, whatever they are
        _discard(writers)
        name = "MLflow" if writers or wandb is None or wandb is False else "W&B"
        raise TrackerError(f"{name}: {tracker_error(exc)}") from exc
    return writers


def _discard(writers: list[TrackingWriter]) -> None:
    for writer in writers:
        try:
            writer.discard()
        except Exception:  # noqa: BLE001 - already failing: the first error is the one to tell
            pass


def _open(writers, wandb, mlflow, run_name, session, live, mlflow_run_id) -> None:
    batch = {} if live else {"batch_steps": EXPORT_BATCH_STEPS, "flush_interval": float("inf")}
    if wandb is not None and wandb is not False:
        from amp_tui.recording.wandb_log import wandb_backend
        writers.append(TrackingWriter(wandb_backend(_project(wandb), run_name=run_name, reuse_active=live),
                                      session=session, **batch))
    if mlflow is not None and mlflow is not False:
        from amp_tui.recording.mlflow_log import mlflow_backend
        backend = mlflow_backend(_uri(mlflow), run_name=run_name, run_id=mlflow_run_id, reuse_active=live)
        writers.append(TrackingWriter(backend, session=session, **batch))


def open_observers(*, wandb=None, mlflow=None, run_dir: Path, mlflow_run_id: str | None = None
                   ) -> list[TrackingObserver]:
    """The live observers of a run recording into `run_dir` (its session file is their artifact).
    Raises MissingExtra or TrackerError."""
    writers = open_writers(wandb=wandb, mlflow=mlflow, run_name=Path(run_dir).name,
                           session=Path(run_dir) / "session.jsonl", mlflow_run_id=mlflow_run_id)
    return [TrackingObserver(writer) for writer in writers]


def tracker_error(exc: BaseException) -> str:
    """A tracker's failure to open, in one line."""
    from amp_tui.core.text import one_line
    return one_line(str(exc) if isinstance(exc, MissingExtra) else f"{type(exc).__name__}: {exc}", 400)
