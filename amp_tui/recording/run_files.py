"""A JSON file a run wrote beside its session on request (an X-ray, an fp8 what-if), read back
from the path its event names. The path comes from the session, which may be damaged or made by
hand: only a regular file inside the run directory is read (never a device or a pipe, which could
be read forever), and only up to a limit far above what a real one holds."""

from __future__ import annotations

from pathlib import Path

from amp_tui.core.jsonsafe import loads_text

# Far more than any model's X-ray or what-if (a few kB per module): a larger file is not one, and
# is not read into memory.
MAX_RUN_FILE_BYTES = 64 << 20


def read_run_json(run_dir: str | Path, relative: str, what: str) -> dict:
    """The JSON object at `relative` (to the run directory), `what` naming it in errors. Raises
    OSError for a file that can't be read, ValueError for one that is no such object."""
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute() \
            or ".." in Path(relative).parts:
        raise ValueError(f"{relative!r} is not a file name in the run directory")
    path = Path(run_dir) / relative
    if not path.is_file():
        raise OSError(f"{relative}: no such {what} file")
    with open(path, "rb") as fh:
        raw = fh.read(MAX_RUN_FILE_BYTES + 1)
    if len(raw) > MAX_RUN_FILE_BYTES:
        raise ValueError(f"{relative} is over {MAX_RUN_FILE_BYTES >> 20} MiB: not an {what}")
    try:
        data = loads_text(raw.decode("utf-8", "replace"))
    except RecursionError:   # arrays nested thousands deep
        raise ValueError(f"{relative} is not an {what} (nested too deep)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{relative} is not an {what} (not a JSON object)")
    return data
