"""Where a run's files go when nobody says: runs/<time>-<script>/, never one that exists."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path


def default_run_dir(script: Path, root: Path = Path("runs")) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = root / f"{stamp}-{script.stem}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path
