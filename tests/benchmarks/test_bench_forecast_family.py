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


def test_nothing_is_alerted_in_bf16(tmp_path):
    bf16 = bench.run_scenario(Scenario(seed=16, model="transformer", where="inside", after="softmax", rate=0.04,
                                       dtype="bfloat16", driver="monitor"), tmp_path, steps=300)
    assert bf16["overflow"] is None and bf16["alerts"] == 0, bf16
    assert bench.summary([bf16], [])["bf16_growing_alerts"] == 0


# One test per healthy run, so that side by side (-n) they share the workers.
HEALTHY = [(17, "mlp", "float16"), (18, "transformer", "float16"), (19, "transformer", "bfloat16")]


@pytest.mark.parametrize(("seed", "model", "dtype"), HEALTHY, ids=[f"{m}-{d}" for _, m, d in HEALTHY])
def test_nothing_is_alerted_on_healthy_runs(tmp_path, seed, model, dtype):
    healthy = bench.run_scenario(Scenario(seed=seed, model=model, rate=0.0, dtype=dtype, driver="monitor"),
                                 tmp_path, steps=400)
    assert healthy["alerts"] == 0 and healthy["overflow"] is None, healthy
    figures = bench.summary([], [healthy])
    assert figures["false_alarms_per_1000"] == 0 and figures["healthy_steps"] == 400
