"""Which checkpoint a resume goes on from (`amp-tui train --resume RUN_DIR`).

The choice is made before the run exists, on the script's fresh model, optimizer and scheduler:
every candidate is read and checked against them, and the run then resumes from the file chosen
(`RunCheckpoints.resume` in job/checkpoints/run_checkpoints.py, which works on a live run, a `Run` or a `Monitor`).
"""

from __future__ import annotations

from pathlib import Path

from amp_tui.training.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    checkpoint_files,
    read_checkpoint,
)
from amp_tui.training.script import ScriptError, TrainSetup


def newest_valid_checkpoint(candidates: list[CheckpointInfo], setup: TrainSetup,
                            run_dir: Path) -> tuple[Path, list[tuple[Path, str]]]:
    """The newest of `candidates` (run_dir's checkpoints, newest first) that passes every check
    against this script's model, and the newer ones skipped with the reason (a partly written or
    corrupted file, one whose header can't even be read, a weights-only file that has no
    optimizer state to go on from)."""
    skipped: list[tuple[Path, str]] = []
    chosen = None
    for info in candidates:
        if info.kind != "full":
            skipped.append((info.path, "weights only: no optimizer or scaler state to resume from"))
            continue
        try:
            read_checkpoint(info.path, model=setup.model, optimizer=setup.optimizer, scheduler=setup.scheduler)
            chosen = info
            break
        except CheckpointError as exc:
            skipped.append((info.path, str(exc)))
    listed = {info.path for info in candidates}
    for path in checkpoint_files(run_dir / "checkpoints"):
        if path in listed:
            continue
        try:
            newer = chosen is None or path.stat().st_mtime >= chosen.mtime
            if newer:
                read_checkpoint(path, model=setup.model, optimizer=setup.optimizer,
                                scheduler=setup.scheduler)
        except (CheckpointError, OSError) as exc:
            skipped.append((path, str(exc)))
    if chosen is None:
        detail = f" (newest refused: {skipped[0][1]})" if skipped else ""
        raise ScriptError(f"--resume {run_dir}: no valid checkpoint in {run_dir / 'checkpoints'}{detail}")
    return chosen.path, skipped
