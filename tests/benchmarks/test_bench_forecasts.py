"""bench/forecast_false_alarms.py, cheaper: the healthy demo and two small benchmark models, a
few hundred steps in fp16 and bf16, raise no layer forecast and no scale forecast that fails to
come true; the acceptance cases' lead times are what the tests of the forecasts assert."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import forecast_false_alarms as bench  # noqa: E402


def test_healthy_runs_raise_no_false_alarm(tmp_path):
    """The bench models' scaler starts at bench.HEALTHY_INIT_SCALE: at GradScaler's default the small
    GPT's backward overflowed once within 150 steps, at a step that depends on the CPU's fp16 kernels,
    so the healthy case was not one. Each run is checked to be healthy (no skip, no non-finite
    step), so that an alert can only be a false one."""
    runs = bench.false_alarms(150, bench.QUICK_SPECS[:2], tmp_path)
    assert {(r["run"], r["dtype"]) for r in runs} == {
        (name, dtype) for name in ("demos/healthy.py", *(s.name for s in bench.QUICK_SPECS[:2]))
        for dtype in bench.DTYPES}
    assert all(r["steps"] == 150 for r in runs)
    assert all(r["skipped"] == 0 and r["nonfinite_events"] == 0 for r in runs), runs
    assert sum(r["false_alarms"] for r in runs) == 0, runs
    assert sum(r["layer_alerts"] for r in runs) == 0, runs
    assert sum(r["wrong_forecasts"] for r in runs) == 0, runs   # not even a harmless skip said wrongly


def test_the_lead_times_are_measured(tmp_path):
    leads = bench.lead_times(tmp_path)
    assert leads["ample_alerts"] == 0
    assert all(s["skipped_at"] in (s["growth_step"], None) for s in leads["scale"])
    assert leads["layer"]["layer"] == "scores" and leads["layer"]["lead"] >= 20
