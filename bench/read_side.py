"""The read-side commands as a user runs them, each a new process:

- start-up: `amp-tui report`, `amp-tui replay --headless` and `amp-tui ls` on a short recording
  (400 steps x 50 layers), where the process is nearly all start-up; target <= 0.6 s each;
- at scale: `amp-tui report` (and `--json`) on the replay benchmark's recording (100,000 steps x
  50 layers in the full run) and `amp-tui ls` on a folder of such runs; targets <= 1.5 s and
  <= 100 MB peak RSS each.

Wall time from spawn to exit and the child's own peak RSS (`os.wait4`), median of `repeats`; the
page cache is warm (a second look at a run finds it so). The recordings are written by the real
`SessionWriter` (`bench/replay_scale.py`) and cached in the temporary folder.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench import common
from bench import replay_scale as rs
from bench.whole_process import ROOT, checkout_env, run_process

STARTUP_MAX_S = 0.6
AT_SCALE_MAX_S = 1.5
AT_SCALE_MAX_MB = 100.0
SHORT_STEPS = 400


def recording(steps: int, layers: int, log=print) -> Path:
    path = rs.default_path(steps, layers)
    if not path.exists():
        log(f"  writing the {steps:,}-step recording once to {path} (reused by later runs) ...")
        path.parent.mkdir(parents=True, exist_ok=True)
        rs.generate(path, steps, layers)
    return path


def folder_of_runs(session: Path, runs: int, where: Path) -> Path:
    """`runs` run directories holding `session` (hard links where the file system allows)."""
    for k in range(runs):
        d = where / f"run-{k:02d}"
        d.mkdir(parents=True, exist_ok=True)
        try:
            os.link(session, d / "session.jsonl")
        except OSError:
            shutil.copyfile(session, d / "session.jsonl")
    return where


def timed(args: list[str], repeats: int, env: dict) -> dict:
    each = [run_process([sys.executable, "-m", "amp_tui", *args], env) for _ in range(repeats)]
    return {"wall_s": common.rnd(common.median([r["wall_s"] for r in each])),
            "wall_max_s": common.rnd(max(r["wall_s"] for r in each)),
            "cpu_s": common.rnd(common.median([r["cpu_s"] for r in each])),
            "max_rss_mb": common.rnd(max(r["max_rss_mb"] for r in each), 1),
            "runs": len(each)}


def measure(steps: int = 100_000, *, layers: int = 50, runs: int = 8, repeats: int = 5,
            checkout: Path = ROOT, log=print) -> dict:
    env = checkout_env(checkout)
    short = recording(SHORT_STEPS, layers, log)
    big = recording(steps, layers, log)
    for path in (short, big):   # warm the page cache
        with open(path, "rb") as fh:
            while fh.read(8 << 20):
                pass
    tmp = Path(tempfile.mkdtemp(prefix="amp-tui-bench-read-"))
    try:
        short_runs = folder_of_runs(short, 3, tmp / "short")
        big_runs = folder_of_runs(big, runs, tmp / "big")
        log(f"  start-up: report, replay --headless, ls on {SHORT_STEPS} steps ...")
        startup = {
            "report": timed(["report", str(short.parent)], repeats, env),
            "replay --headless": timed(["replay", "--headless", str(short.parent)], repeats, env),
            "ls": timed(["ls", str(short_runs)], repeats, env),
        }
        log(f"  at scale: report and ls on {steps:,} steps ...")
        at_scale = {
            "report": timed(["report", str(big.parent)], repeats, env),
            "report --json": timed(["report", "--json", str(big.parent)], repeats, env),
            f"ls ({runs} runs)": timed(["ls", str(big_runs)], repeats, env),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"short_steps": SHORT_STEPS, "steps": steps, "layers": layers, "runs": runs, "repeats": repeats,
            "file_mb": round(big.stat().st_size / 1e6, 1), "startup": startup, "at_scale": at_scale,
            "startup_max_s": STARTUP_MAX_S, "at_scale_max_s": AT_SCALE_MAX_S, "at_scale_max_mb": AT_SCALE_MAX_MB}
