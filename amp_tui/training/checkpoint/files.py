"""Checkpoint files in a folder: their names, a header-only listing, and removing the temporary
files that interrupted saves leave behind."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from amp_tui.training.checkpoint import codec, io, manifest
from amp_tui.training.checkpoint.errors import CheckpointError, Problem, reason

SUFFIX = ".safetensors"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int | None  # None for a weights-only file
    dtype: str | None  # "float16" | "bfloat16" | "float32", None for a weights-only file
    kind: str  # "full" or "weights"
    mtime: float


def checkpoint_path(folder: Path, step: int) -> Path:
    """folder/"step-0000123.safetensors", or "-2", "-3"... if that name is taken."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    folder = Path(folder)
    base = f"step-{step:07d}"
    path, n = folder / f"{base}{SUFFIX}", 2
    while path.exists():
        path, n = folder / f"{base}-{n}{SUFFIX}", n + 1
    return path


def _is_temporary(name: str) -> bool:
    return name.startswith(".") or ".tmp" in name


def checkpoint_files(folder: Path) -> list[Path]:
    """Every checkpoint file in `folder`, and every sharded checkpoint's folder, readable or not
    (temporary files and folders of saves left out)."""
    try:
        return sorted(Path(e.path) for e in os.scandir(folder)
                      if (e.name.endswith(SUFFIX) or manifest.is_sharded_dir(Path(e.path)))
                      and not _is_temporary(e.name))
    except OSError:
        return []


def _peek(path: Path) -> CheckpointInfo | None:
    """Header-only look at a file (a sharded checkpoint's folder: its manifest); None if it is
    not a restorable checkpoint."""
    if manifest.is_sharded_dir(path):
        peeked = manifest.peek(path)
        if peeked is None:
            return None
        step, dtype, mtime = peeked
        return CheckpointInfo(path=path, step=step, dtype=dtype, kind="full", mtime=mtime)
    read = io.read_header(path)
    if read is None:
        return None
    head, mtime = read
    try:
        if codec.kind(head.metadata, head.names) == "weights":
            return CheckpointInfo(path=path, step=None, dtype=None, kind="weights", mtime=mtime)
        step, dtype = codec.check_metadata(head.metadata)
    except Problem:
        return None
    return CheckpointInfo(path=path, step=step, dtype=dtype, kind="full", mtime=mtime)


def list_checkpoints(folder: Path) -> list[CheckpointInfo]:
    """Checkpoints in `folder`, newest first (highest step, then latest mtime; weights-only
    files, which have no step, after the full ones; sharded checkpoints' folders among them).
    Reads headers only; skips temporary, partial and unreadable files."""
    folder = Path(folder)
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise CheckpointError(f"cannot list checkpoints in {folder}: {reason(e)}") from None
    infos = []
    for entry in entries:
        if _is_temporary(entry.name) or not (entry.name.endswith(SUFFIX)
                                             or manifest.is_sharded_dir(Path(entry.path))):
            continue
        info = _peek(Path(entry.path))
        if info is not None:
            infos.append(info)
    infos.sort(key=lambda i: (i.step is not None, i.step or 0, i.mtime), reverse=True)
    return infos


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own saves are tracked by io.being_written
    if os.name != "posix":
        return False  # os.kill would terminate it on Windows; open files can't be removed there
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def cleanup_temporary_files(folder: Path) -> int:
    """Remove temporary files left by interrupted saves; return how many were removed.

    Files of saves still running (in this process, or in another live process) are kept.
    """
    folder = Path(folder)
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    except OSError as e:
        raise CheckpointError(f"cannot clean up {folder}: {reason(e)}") from None
    removed = 0
    for entry in entries:
        d = manifest.TEMPORARY_DIR.match(entry.name)
        if d and entry.is_dir(follow_symlinks=False) and not _pid_alive(int(d.group(1))):
            # A sharded save that was cut off (its ranks write into rank 0's folder).
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
            continue
        m = io.TEMPORARY_NAME.match(entry.name)
        if not m or not entry.is_file(follow_symlinks=False):
            continue
        if io.being_written(entry.name) or _pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed += 1
    return removed
