"""The forecasts on the dashboard: the layer table's ETA column (blank where a layer shows no
trend) and the loss-scale forecast in the status bar while its growth step is ahead."""

from __future__ import annotations

from amp_tui.ui.app import create_app
from amp_tui.ui.widgets.layer_table import GAP, eta_text

from fixed_source import SYNTHETIC_START, FixedSource, creeping_eta, synthetic_records
from support import SIZE, run_async

STEPS = 300
FROZEN = SYNTHETIC_START + STEPS * 0.125
SAID = "next scale growth at step 2,300 will overflow (head: 0.6 bits): 1 skip, harmless"


def forecast_alert(step: int, growth_step: int) -> dict:
    return {"type": "event", "step": step, "kind": "alert", "reason": "forecast_scale", "time": FROZEN,
            "message": f"next scale growth at step {growth_step:,} will overflow (head: 0.6 bits): 1 skip, "
                       "harmless. Likely cause: ... Fix: ...", "cause": "...", "fix": "...",
            "forecast": {"growth_step": growth_step, "scale": 4096.0, "grown": 8192.0, "headroom": 0.6,
                         "growth_interval": 2000}}


def eta_cell(table, position: int) -> str:
    """What the ETA column shows in a row, as drawn."""
    start = sum(table._widths[:3]) + 3 * GAP
    return table.row_text(position).plain[start:start + table._widths[3]].strip()


@run_async
async def test_the_eta_column_and_the_scale_forecast_in_the_status_bar():
    records = synthetic_records(STEPS, forecast=True) + [forecast_alert(STEPS - 1, 2300)]
    app = create_app(FixedSource(records), clock=lambda: FROZEN)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        table = app.dashboard.layer_table
        assert "ETA" in table.render_line(0).text
        assert table.highlighted_layer() == "h.4.mlp.c_fc"   # the top row
        assert eta_cell(table, 0) == eta_text(creeping_eta(STEPS - 1))
        assert all(eta_cell(table, i) == "" for i in range(1, len(table._ordered)))
        table.sort_by("eta")
        assert table._ordered[0].name == "h.4.mlp.c_fc"
        assert all(row.eta is None for row in table._ordered[1:])
        assert SAID in str(app.dashboard.status_bar.render())


@run_async
async def test_no_forecast_leaves_the_column_blank_and_a_past_growth_leaves_the_status_bar():
    records = synthetic_records(STEPS) + [forecast_alert(100, 200)]   # step 200 is behind the run
    app = create_app(FixedSource(records), clock=lambda: FROZEN)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        table = app.dashboard.layer_table
        assert all(row.eta is None for row in table._ordered)
        assert "next scale growth" not in str(app.dashboard.status_bar.render())


def test_eta_text_is_short():
    assert [eta_text(v) for v in (None, 0, 340, 9999, 12_345, 3_400_000)] == ["", "0", "340", "9999", "12k", "3.4M"]
