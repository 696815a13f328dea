"""bench/kept_forwards.py (what a healthy monitored step pays for keeping its forwards for a
replay), checked on a tiny model and a few rounds: every figure comes out. No assertion on speed."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import kept_forwards  # noqa: E402
from bench.models import MlpSpec  # noqa: E402


def test_the_line_gives_every_figure():
    """The hooks' share is kept to three significant digits: rounded to three decimals, it read 0.0
    where a loaded machine made the step slow, and the test failed on the load, not on a figure."""
    r = kept_forwards.measure(MlpSpec(depth=2, width=16, batch=4), "float16", rounds=6, warmup=2)
    assert r["rounds"] == 6 and r["monitored_step_ms"] > 0 and r["hooks_us_per_forward"] > 0
    lo, hi = r["ratio_90ci"]
    assert lo <= r["steps_per_s_ratio"] <= hi
    assert r["hooks_share_pct"] > 0 and r["target_share_pct"] == 0.2
