"""Shared helpers of the benchmarks: statistics, machine and version facts, the printed table.

Pure Python (no numpy): the project's environment has none, and the figures are few.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Sequence


# ---- statistics -------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(Q1, Q3), inclusive method; (x, x) for a single value."""
    if not values:
        return math.nan, math.nan
    if len(values) == 1:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def iqr(values: Sequence[float]) -> float:
    q1, q3 = quartiles(values)
    return q3 - q1


def stratified_median(times: Sequence[float], probed: Sequence[bool], every: int) -> float:
    """Per-step cost of a contender whose steps come in two kinds.

    A contender that probes every `every` steps has two kinds of step: the probed one (1 in
    `every`) and the others. The plain median of all its steps would be an unprobed step and hide
    the probe's cost; the mean would let one slow step of the machine's noise decide. So: the
    median of each kind, weighted by how often that kind occurs. With every == 1 it is the median.
    """
    on = [t for t, p in zip(times, probed) if p]
    off = [t for t, p in zip(times, probed) if not p]
    if every == "auto":   # the adaptive schedule: each kind weighted by how often it came
        if not on or not off:
            return median(times)
        return (len(on) * median(on) + len(off) * median(off)) / len(times)
    if every <= 1:
        return median(times)
    if not on or not off:
        return median(times)
    return (median(on) + (every - 1) * median(off)) / every


def bootstrap_interval(estimate: Callable[[list[int]], float], n: int, *, resamples: int = 300,
                       seed: int = 0, level: float = 0.9) -> tuple[float, float]:
    """A percentile bootstrap interval of `estimate(indices)` over `n` paired rounds."""
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        v = estimate(idx)
        if not math.isnan(v):
            values.append(v)  # +inf is kept: a ratio over an overhead that came out <= 0
    if len(values) < 10:
        return math.nan, math.nan
    values.sort()
    lo = values[int((1 - level) / 2 * (len(values) - 1))]
    hi = values[int((1 + level) / 2 * (len(values) - 1))]
    return lo, hi


def rnd(x, digits: int = 3):
    """Round for JSON; NaN/inf become None (JSON has neither)."""
    if x is None:
        return None
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return round(x, digits) if isinstance(x, float) else x


# ---- machine and versions ---------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "f16c")
                    return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def memory_total_gb() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1e6, 1)
    except OSError:
        pass
    return None


def machine(device: str) -> dict:
    import torch

    info = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": memory_total_gb(),
        "os": f"{platform.system()} {platform.release()}",
        "load_average_at_start": load_average(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["gpu_backend"] = "ROCm/HIP" if torch.version.hip else "CUDA"
    return info


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for dist, key in (("torch", "torch"), ("amp-tui", "amp_tui"), ("textual", "textual"),
                      ("transformers", "transformers"), ("safetensors", "safetensors")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    import torch

    out["torch"] = torch.__version__
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    if torch.version.hip:
        out["hip"] = torch.version.hip
    return out


def checkout(root) -> dict | None:
    """The commit the figures were measured at, and how many files differ from it."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head or None, "modified_tracked_files": len(changed)} if head else None


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def write_results(root, kind: str, result: dict) -> Path:
    """`result` as JSON to bench/results/<date>-<time>-<kind>.json; its path."""
    out = Path(root) / "bench" / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}.json"
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return out


def stamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


class Clock:
    """perf_counter, with a device sync first on CUDA (the step's work must be done)."""

    def __init__(self, device: str):
        import torch

        self._sync = torch.cuda.synchronize if device.startswith("cuda") else None

    def __call__(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()


# ---- the printed table ------------------------------------------------------------------------
def table(rows: list[Sequence[str]], header: Sequence[str] | None = None, indent: str = "  ") -> str:
    all_rows = ([list(header)] if header else []) + [list(map(str, r)) for r in rows]
    if not all_rows:
        return ""
    widths = [max(len(r[i]) for r in all_rows if i < len(r)) for i in range(max(map(len, all_rows)))]
    lines = []
    for k, r in enumerate(all_rows):
        cells = []
        for i, cell in enumerate(r):
            # first column left-aligned, numbers right-aligned
            cells.append(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]))
        lines.append(indent + "  ".join(cells).rstrip())
        if header and k == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)
