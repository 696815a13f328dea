"""bench/forecast_family.py on a smaller set: with the defaults, a value growing a few percent a
step, at a module's output or inside its forward, under `amp-tui train`, a monitored loop and the
Lightning callback, is forecast by module (and op) at least 50 steps before it overflows, within
30% of the steps left; in bf16 and on healthy runs nothing is alerted.

Judged on the forecasts' own claims against the overflow of the growing value itself (the model
records it), not on whether a given CPU's fp16 arithmetic makes a skip at one step or the next;
the probes fall by a made-up clock, not by the machine's load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import forecast_family as bench  # noqa: E402
from bench.forecast_scenarios import Scenario  # noqa: E402

from support import install_made_up_clock  # noqa: E402

# Which steps are probed follows a made-up clock: a step of 10 ms, a probe 2 ms more (the ratio of
# these small models' probes on this kind of CPU), whatever the machine's load.
STEP, PROBE_COST = 0.010, 0.002


@pytest.fixture(autouse=True)
def made_up_clock(monkeypatch):
    return install_made_up_clock(monkeypatch, STEP, PROBE_COST)

GROWING = [
    Scenario(seed=11, model="transformer", where="inside", position="middle", after="softmax", rate=0.03,
             start_bits=2.0, driver="monitor"),
    Scenario(seed=12, model="mlp", where="inside", position="last", after="layernorm", rate=0.04,
             start_bits=3.0, driver="train"),
    Scenario(seed=13, model="mlp", where="output", position="early", after="tanh", rate=0.035,
             start_bits=2.5, driver="monitor"),
    Scenario(seed=14, model="transformer", where="output", position="last", after="layernorm", rate=0.03,
             start_bits=2.0, driver="train"),
]


@pytest.mark.parametrize("scenario", GROWING, ids=lambda s: f"{s.model}-{s.where}-{s.after}-{s.driver}")
def test_a_growing_value_is_forecast_well_ahead(tmp_path, scenario):
    row = bench.run_scenario(scenario, tmp_path)
    assert row["overflow"] is not None, row                       # the value did overflow ...
    assert row["alert_step"] is not None and row["lead"] >= bench.LEAD, row   # ... and was seen coming
    assert row["eta_error"] <= 0.3, row
    assert row["other_alerts"] == 0, row
    if scenario.where == "inside" and scenario.model == "transformer":
        assert row["op"] in ("aten.mul", "aten.bmm"), row         # the op inside the block's forward


def test_under_the_lightning_callback(tmp_path):
    pytest.importorskip("lightning")
    scenario = Scenario(seed=15, model="mlp", where="inside", position="middle", after="softmax", rate=0.03,
                        start_bits=2.0, driver="lightning")
    row = bench.run_scenario(scenario, tmp_path)
    assert row["overflow"] is not None and row["lead"] >= bench.LEAD and row["eta_error"] <= 0.3, row
    assert row["op"] == "aten.mul"


def test_nothing_is_alerted_in_bf16_nor_on_healthy_runs(tmp_path):
    bf16 = bench.run_scenario(Scenario(seed=16, model="transformer", where="inside", after="softmax", rate=0.04,
                                       dtype="bfloat16", driver="monitor"), tmp_path, steps=300)
    assert bf16["overflow"] is None and bf16["alerts"] == 0, bf16
    healthy = [bench.run_scenario(Scenario(seed=17 + i, model=model, rate=0.0, dtype=dtype, driver="monitor"),
                                  tmp_path, steps=400)
               for i, (model, dtype) in enumerate((("mlp", "float16"), ("transformer", "float16"),
                                                   ("transformer", "bfloat16")))]
    assert all(r["alerts"] == 0 and r["overflow"] is None for r in healthy), healthy
    figures = bench.summary([bf16], healthy)
    assert figures["false_alarms_per_1000"] == 0 and figures["healthy_steps"] == 1200
