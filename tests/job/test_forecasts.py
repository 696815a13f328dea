"""The forecasts of a run (job/records/forecasts.py): the loss scale's next growth and whether it
overflows, and each layer's steps left before the dtype's max. Acceptance on models that show
each pattern (tests/forecast_cases.py): the forecast comes before the fact, and the fact comes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:   # the acceptance cases live with the benchmark that reuses them
    sys.path.insert(0, str(ROOT))

from amp_tui.cli import main  # noqa: E402
from amp_tui.recording.forecast_outcomes import forecast_outcomes  # noqa: E402
from amp_tui.recording.report import read_digest, summarize  # noqa: E402
from amp_tui.training.step.guards import GuardConfig  # noqa: E402
from bench import forecast_cases as models  # noqa: E402
from bench.forecast_cases import GROWTH_INTERVAL  # noqa: E402

from support import strict_lines, train_run  # noqa: E402


def alerts(records, reason):
    return [r for r in records if r["type"] == "event" and r["kind"] == "alert" and r.get("reason") == reason]


def forecasts_of(records, reason):
    """The forecasts that need nothing done: `forecast` events, never alerts."""
    return [r for r in records if r["type"] == "event" and r["kind"] == "forecast" and r.get("reason") == reason]


def events(records, kind):
    return [r for r in records if r["type"] == "event" and r["kind"] == kind]


def first_overflow(records) -> int:
    return min(r["step"] for r in events(records, "nonfinite"))


def test_the_scale_forecast_names_the_growth_step_and_the_skip_comes_there(tmp_path):
    records = models.near_half(tmp_path / "near", steps=2 * GROWTH_INTERVAL + 5)
    skipped = [r["step"] for r in records if r["type"] == "step" and r["skipped"]]
    forecasts = forecasts_of(records, "forecast_scale")
    assert not alerts(records, "forecast_scale")   # a harmless skip is no alert
    assert all(f["severity"] == "info" and f["fix"].startswith("nothing") for f in forecasts)
    assert skipped == [GROWTH_INTERVAL, 2 * GROWTH_INTERVAL + 1], skipped
    # One forecast per growth, made before it, naming the step that skipped.
    assert [f["forecast"]["growth_step"] for f in forecasts] == skipped + [3 * GROWTH_INTERVAL + 2]
    assert all(f["step"] < f["forecast"]["growth_step"] for f in forecasts)
    assert forecasts[0]["step"] == 0   # the first probed step already knows
    assert forecasts[0]["message"].startswith(
        f"next scale growth at step {GROWTH_INTERVAL} will overflow (head: 0.7 bits): 1 skip, harmless")
    assert forecasts[0]["forecast"]["grown"] == 2 * forecasts[0]["forecast"]["scale"]
    # After each growth, the record says it came true (the third is still to come).
    checked = events(records, "forecast_checked")
    assert [(c["step"], c["growth_step"], c["came_true"]) for c in checked] == [(s, s, True) for s in skipped]


def test_a_scale_change_before_the_growth_retires_its_forecast(tmp_path):
    """The scale set by hand before the growth: the growth forecast won't come at its step, and
    the record says so at once; a skip before it (the scaler falling back) does the same."""
    records = models.scaled_run(tmp_path / "changed", init_scale=1024.0, steps=GROWTH_INTERVAL - 5,
                                commands={10: "scale=512"})
    (forecast,) = forecasts_of(records, "forecast_scale")[:1]
    (checked,) = events(records, "forecast_checked")[:1]
    assert checked["growth_step"] == forecast["forecast"]["growth_step"] == GROWTH_INTERVAL
    assert checked["step"] == 10 and checked["came_true"] is False
    # The read side says what the run judged, and nothing of its own.
    assert forecast_outcomes([forecast, checked], last_step=14)[0]["came_true"] is False
    assert forecast_outcomes([forecast], last_step=14)[0]["came_true"] is None   # not judged: open


def test_ample_headroom_gets_no_forecast_alert(tmp_path):
    records = models.ample(tmp_path / "ample", steps=3 * GROWTH_INTERVAL + 5)
    scales = {r["scale"] for r in records if r["type"] == "step"}
    assert len(scales) >= 3, "the scale grew: there were growths to forecast"
    assert not forecasts_of(records, "forecast_scale") and not alerts(records, "forecast_scale")
    assert not events(records, "forecast_checked")
    assert not alerts(records, "forecast_layer")


def test_the_layer_alert_comes_well_before_growing_attention_logits_overflow(tmp_path):
    records = models.growing_logits(tmp_path / "logits")
    names = records[0]["layers"]
    (alert,) = alerts(records, "forecast_layer")
    assert alert["forecast"]["layer"] == "scores" and alert["forecast"]["figure"] == "act"
    assert alert["forecast"]["eta"] < 100   # the horizon the loop asked for
    overflow = first_overflow(records)
    assert overflow - alert["step"] >= 20, (alert["step"], overflow)
    # The ETA column: the step records before the alert carry the scores' ETA, counting down.
    etas = [(r["step"], r["layers"]["eta"][names.index("scores")]) for r in records
            if r["type"] == "step" and "eta" in r.get("layers", {}) and r["step"] < overflow]
    assert etas and etas[-1][1] is not None and etas[-1][1] < alert["forecast"]["eta"]
    # The report says it came true, and when.
    (row,) = summarize(read_digest(tmp_path / "logits")).forecasts
    assert row["came_true"] is True and row["true_at"] == overflow and row["lead"] == overflow - alert["step"]


def test_the_layer_forecast_under_amp_tui_train(tmp_path):
    script = models.growing_script(tmp_path)
    run = train_run(script, tmp_path / "train", steps=195, probe_every=1, init_scale=256.0, device="cpu",
                    guard=GuardConfig(forecast_horizon=100), control=False)
    assert run.run() == 0
    records = strict_lines(tmp_path / "train" / "session.jsonl")
    (alert,) = alerts(records, "forecast_layer")
    assert alert["forecast"]["layer"] == "scores"
    assert first_overflow(records) - alert["step"] >= 20


def test_report_and_export_list_the_forecasts_and_whether_they_came_true(tmp_path, capsys):
    models.near_half(tmp_path / "near", steps=2 * GROWTH_INTERVAL + 5)   # the third growth is still to come
    assert main(["report", str(tmp_path / "near"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["forecasts"]
    assert [(r["at_step"], r["came_true"]) for r in rows] == [
        (GROWTH_INTERVAL, True), (2 * GROWTH_INTERVAL + 1, True), (3 * GROWTH_INTERVAL + 2, None)]
    assert main(["report", str(tmp_path / "near")]) == 0
    text = capsys.readouterr().out
    assert "3, 2 came true" in text and f"scale growth at step {GROWTH_INTERVAL} overflows: came true" in text
    out = tmp_path / "forecasts.csv"
    assert main(["export", str(tmp_path / "near"), "--forecasts-csv", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == "step,reason,layer,figure,eta,at_step,headroom,came_true,true_at,lead"
    g = GROWTH_INTERVAL
    assert lines[1] == f"0,forecast_scale,,grad,{g},{g},0.74,True,{g},{g}"
    assert lines[3].endswith(",,,") and len(lines) == 4


def _growth_checked(steps):
    """The run's verdict on a forecast of a growth at step 20 (scale 1024 -> 2048), given the
    steps from there on as (step, scale, skipped)."""
    from types import SimpleNamespace

    from amp_tui.job.records.forecasts import RunForecasts
    said = []
    run = SimpleNamespace(event=lambda kind, message, **fields: said.append((kind, message, fields)))
    forecasts = RunForecasts(run)
    forecasts._growths[20] = (5, 1024.0, 2048.0)
    for step, scale, skipped in steps:
        forecasts._check_growths(SimpleNamespace(step=step, scale=scale, skipped=skipped,
                                                 next_scale=scale / 2 if skipped else scale))
    return [(fields["came_true"], message) for kind, message, fields in said if kind == "forecast_checked"]


def test_a_skip_a_step_or_two_after_the_growth_is_the_growths():
    """The largest gradient varies from step to step: the one that overflows the doubled scale may
    come a step after the growth (seen on the healthy demo: the growth at 8,000, the skip at 8,001)."""
    [(came, message)] = _growth_checked([(20, 2048.0, False), (21, 2048.0, True)])
    assert came and "overflowed at step 21" in message
    # ... and the read side says the run's verdict, the step it came true at included
    alert = {"type": "event", "step": 5, "kind": "alert", "reason": "forecast_scale",
             "forecast": {"growth_step": 20, "grown": 2048.0}}
    skip = {"type": "event", "step": 21, "kind": "nonfinite", "where": "gradients"}
    verdict = {"type": "event", "step": 21, "kind": "forecast_checked", "forecast_step": 5,
               "growth_step": 20, "came_true": True}
    [row] = forecast_outcomes([alert, verdict, skip], last_step=22)
    assert row["came_true"] is True and row["true_at"] == 21 and row["lead"] == 16
    # ten clean steps at the grown scale: it did not
    [(came, message)] = _growth_checked([(s, 2048.0, False) for s in range(20, 31)])
    assert not came and "ran 10 steps without an overflow" in message


def test_the_live_run_and_the_report_judge_a_scale_forecast_alike(tmp_path, capsys):
    """The README's own command: `dtype=bf16` at step 20 changes the scale before the growth a
    forecast named, and the run says at once that it did not come true. The report, the
    forecasts CSV and the dashboard's status bar say the same, from the run's verdict."""
    from amp_tui.sources.replay import ReplaySource
    from amp_tui.ui.view import scale_forecast

    from support import DEMOS

    run_dir = tmp_path / "run"
    assert main(["train", str(DEMOS / "loss_scale_overflow.py"), "--headless", "--steps", "30",
                 "--at", "20:dtype=bf16", "--at", "25:save", "--run-dir", str(run_dir)]) == 0
    live = [line for line in capsys.readouterr().out.splitlines() if " forecast_checked " in line]
    verdicts = events(strict_lines(run_dir / "session.jsonl"), "forecast_checked")
    assert verdicts and len(live) == len(verdicts)
    assert all(not v["came_true"] and "did not come true" in line for v, line in zip(verdicts, live))
    assert main(["report", str(run_dir), "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["forecasts"] if r["reason"] == "forecast_scale"]
    assert [(r["step"], r["came_true"]) for r in rows] == [(v["forecast_step"], False) for v in verdicts]
    assert main(["report", str(run_dir)]) == 0
    assert "overflows: did not come true" in " ".join(capsys.readouterr().out.split())   # words, as wrapped
    out = tmp_path / "forecasts.csv"
    assert main(["export", str(run_dir), "--forecasts-csv", str(out)]) == 0
    assert [line.split(",")[7] for line in out.read_text().splitlines()[1:]] == ["False"] * len(rows)
    # The status bar stops announcing a forecast the run has judged.
    source = ReplaySource(run_dir)
    source.playback.seek(verdicts[0]["step"] - 2)   # the boundary of the verdict's step comes before its record
    assert scale_forecast(source.snapshot()) is not None
    source.playback.seek(verdicts[0]["step"])
    assert scale_forecast(source.snapshot()) is None
