"""bench/forecast_false_alarms.py, cheaper: the healthy demo and two small benchmark models, a
few hundred steps in fp16 and bf16, raise no layer forecast and no scale forecast that fails to
come true; the acceptance cases' lead times are what the tests of the forecasts assert."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import forecast_false_alarms as bench  # noqa: E402

# One test per run, so that side by side (-n) the runs share the workers.
HEALTHY_RUNS = [(name, spec, dtype) for dtype in bench.DTYPES
                for name, spec in [("demos/healthy.py", None), *((s.name, s) for s in bench.QUICK_SPECS[:2])]]


@pytest.mark.parametrize(("name", "spec", "dtype"), HEALTHY_RUNS, ids=[f"{n}-{d}" for n, _, d in HEALTHY_RUNS])
def test_healthy_runs_raise_no_false_alarm(tmp_path, name, spec, dtype):
    """The bench models' scaler starts at bench.HEALTHY_INIT_SCALE: at GradScaler's default the small
    GPT's backward overflowed once within 150 steps, at a step that depends on the CPU's fp16 kernels,
    so the healthy case was not one. Each run is checked to be healthy (no skip, no non-finite
    step), so that an alert can only be a false one."""
    run = bench.false_alarm_run(name, dtype, 150, tmp_path, spec)
    assert (run["run"], run["dtype"], run["steps"]) == (name, dtype, 150), run
    assert run["skipped"] == 0 and run["nonfinite_events"] == 0, run
    assert run["false_alarms"] == 0, run
    assert run["layer_alerts"] == 0, run
    assert run["wrong_forecasts"] == 0, run   # not even a harmless skip said wrongly


def test_the_lead_times_are_measured(tmp_path):
    leads = bench.lead_times(tmp_path)
    assert leads["ample_alerts"] == 0
    assert all(s["skipped_at"] in (s["growth_step"], None) for s in leads["scale"])
    assert leads["layer"]["layer"] == "scores" and leads["layer"]["lead"] >= 20
