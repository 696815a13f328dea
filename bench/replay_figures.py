"""Replay figures for the runner: `bench/replay_scale.py`'s `measure()` (the replay benchmark,
owned there), plus the one-time cost of writing the recording, reported apart.

The recording is cached in a temporary folder named after its size (`replay_scale.default_path`)
and shared with `python bench/replay_scale.py`; the first run on a machine writes it (about a
minute for 20k steps on a loaded 2-core machine, several for 100k), later runs reuse it.
"""

from __future__ import annotations

import time

from bench import common
from bench import replay_scale as rs


def measure(steps: int, *, layers: int = 50, seeks: int = 50, log=print) -> dict:
    path = rs.default_path(steps, layers)
    written_s = None
    if not path.exists():
        log(f"  writing the {steps:,}-step recording once to {path} (reused by later runs) ...")
        path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        rs.generate(path, steps, layers)
        written_s = time.perf_counter() - t
    figures = dict(rs.measure(steps, layers=layers, seeks=seeks, path=path))
    ends = figures.get("first_frame_at_end_s") or []
    figures.update({
        "steps": steps, "layers": layers, "recording_written_s": common.rnd(written_s, 1),
        "first_frame_target_s": rs.FIRST_FRAME_TARGET_S, "seek_target_s": rs.SEEK_TARGET_S,
        # the worst first frame, opening at the start (replay) or at the end (replay --follow)
        "first_frame_worst_any_s": max([figures["first_frame_worst_s"], *ends]),
    })
    return figures
