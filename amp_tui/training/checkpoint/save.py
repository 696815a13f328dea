"""Saving a full checkpoint: the arguments checked, the run state encoded, the file written
atomically."""

from __future__ import annotations

from pathlib import Path

from amp_tui.core.precision import canonical
from amp_tui.training.checkpoint import codec, io
from amp_tui.training.checkpoint.checks import scaler_problem
from amp_tui.training.checkpoint.errors import CheckpointError, Unencodable, reason
from amp_tui.training.checkpoint.files import CheckpointInfo


def save_checkpoint(path: Path, *, model, optimizer, scheduler=None, scaler_state: dict | None,
                    step: int, dtype: str, extra: dict | None = None) -> CheckpointInfo:
    """Write a full checkpoint atomically: either the complete file appears at `path` or
    nothing changes (earlier checkpoints are never touched)."""
    path = Path(path)

    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"could not write checkpoint {path}: {problem}")

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise fail(f"step must be a non-negative integer, got {step!r}")
    try:
        dtype_name = canonical(dtype)
    except ValueError as e:
        raise fail(str(e)) from None
    if scaler_state is not None:
        problem = scaler_problem(scaler_state)
        if problem:
            # Such a file would be refused on restore, so don't write it.
            raise fail(problem)
    if extra is not None and not isinstance(extra, dict):
        raise fail(f"extra must be a dict, got {type(extra).__name__}")

    try:
        tensors, metadata = codec.encode(model=model, optimizer=optimizer, scheduler=scheduler,
                                         scaler_state=scaler_state, step=step, dtype=dtype_name,
                                         extra=extra)
    except Unencodable as e:
        raise fail(f"{e} (not JSON-serialisable)") from None

    try:
        io.write_atomically(path, tensors, metadata)
    except Exception as e:
        raise fail(reason(e)) from e
    try:
        mtime = path.stat().st_mtime
    except OSError as e:
        raise fail(f"it vanished right after saving ({reason(e)})") from None
    return CheckpointInfo(path=path, step=step, dtype=dtype_name, kind="full", mtime=mtime)
