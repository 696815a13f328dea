"""Where a rank's own output goes: rank 0's to the terminal, every other rank's to a file of its
own in the run directory, so that the ranks' lines don't interleave on one terminal."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator


def rank_log_path(run_dir: Path, rank: int) -> Path:
    """Where a rank other than 0 writes its own output (rank 0's is the terminal's)."""
    return Path(run_dir) / f"rank{rank}.log"


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors 1 and 2) appended to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
