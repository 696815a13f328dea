"""The fp8 forecast (job/records/fp8_forecast.py): a layer whose crest climbs from one recurring
what-if to the next towards the verdict's limit is said before its verdict turns: a `forecast`
event in bf16, an `alert` in fp8; a flat crest, a layer already kept in bf16, or a trend beyond the
horizon say nothing, and each layer is said once."""

from __future__ import annotations

import pytest

from amp_tui.job.records.fp8_forecast import Fp8Forecast
from amp_tui.recording.reader import read_session
from amp_tui.recording.report import read_digest, summarize
from amp_tui.training.fp8.whatif import crest_limit

from support import DEMOS, train_run


def whatif(crests: dict[str, float], verdict=None) -> dict:
    rows = [{"module": m, "tensor": "input", "format": "e4m3", "scaling": "tensorwise", "crest_bits": c}
            for m, c in crests.items()]
    rows += [{"module": m, "tensor": "input", "format": "e4m3", "scaling": "rowwise", "crest_bits": 99.0}
             for m in crests]   # only the recipe's own cast counts
    return {"rows": rows, "verdict": verdict or {m: "fp8" for m in crests}}


def test_a_climbing_crest_is_said_once_with_its_eta():
    forecast = Fp8Forecast(horizon=500)
    said = [forecast.observe(step, whatif({"rising": 6.0 + step / 200, "flat": 5.0}))
            for step in (100, 200, 300)]
    assert said[:2] == [[], []]   # three what-ifs make a trend
    [found] = said[2]
    assert found["module"] == "rising" and found["tensor"] == "input" and found["slope"] == pytest.approx(0.005)
    limit = crest_limit("e4m3")
    assert found["eta"] == round((limit - 7.5) / 0.005) and found["at_step"] == 300 + found["eta"]
    assert forecast.observe(400, whatif({"rising": 8.0, "flat": 5.0})) == []   # once


def test_beyond_the_horizon_kept_in_bf16_or_past_the_limit_says_nothing():
    far = Fp8Forecast(horizon=100)
    assert [far.observe(s, whatif({"a": 6.0 + s / 200})) for s in (100, 200, 300)][-1] == []
    kept = Fp8Forecast(horizon=500)
    assert [kept.observe(s, whatif({"a": 6.0 + s / 200}, {"a": "bf16: crest"})) for s in (100, 200, 300)][-1] == []
    falling = Fp8Forecast(horizon=500)
    assert [falling.observe(s, whatif({"a": 8.0 - s / 200})) for s in (100, 200, 300)][-1] == []


def test_growing_outliers_are_forecast_before_the_verdict_turns(tmp_path):
    run_dir = tmp_path / "grow"
    # The planted channels grow 2% a step: the layer's input crest climbs about a bit every 35 steps.
    run = train_run(DEMOS / "fp8_outliers.py", run_dir, steps=160, device="cpu", dtype="bfloat16",
                    fp8_every=20, script_argv=["--factor", "30", "--grow", "1.02"])
    assert run.run() == 0
    session = read_session(run_dir)
    turned = next(e["step"] for e in session.events if e["kind"] == "fp8" and "blocks.2.fc2" in e["kept"])
    [said] = [e for e in session.events if e.get("reason") == "forecast_fp8"]
    assert said["kind"] == "forecast" and said["severity"] == "info"   # bf16: nothing needs doing yet
    assert said["forecast"]["layer"] == "blocks.2.fc2" and said["forecast"]["tensor"] == "input"
    assert said["step"] < turned
    # Where it said the crest passes the limit: within 50 steps of the what-if that saw it pass.
    assert abs(said["forecast"]["at_step"] - turned) <= 50, (said["forecast"], turned)
    # The report says it came true, at the what-if that kept the layer.
    [row] = summarize(read_digest(run_dir)).forecasts
    assert row["reason"] == "forecast_fp8" and row["came_true"] is True and row["true_at"] == turned
