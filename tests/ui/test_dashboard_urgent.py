"""After a change the user must see, the layer table and the charts show the same step as the
status bar at the next refresh; only the steady ticking of steps is paced.

The pace is made endless here, so nothing but the urgency of a change can draw the figures: the
tests gate on the records fed and on the dashboard's own refreshes, never on how fast they come.
"""

import pytest

from amp_tui.ui.app import create_app
from amp_tui.ui.screens import dashboard

from fixed_source import FixedSource, synthetic_records
from support import SIZE, next_step, run_async, until

ENDLESS = dashboard.Pacing(status_s=1e9, table_s=1e9, charts_s=1e9)
FIRST = 50          # steps 0..49 are on screen before the test feeds more
LAST = FIRST + 9    # the newest step fed before the change


class Drawn:
    """What the status bar, the layer table and the charts last drew, as of each refresh of the
    dashboard."""

    def __init__(self, app):
        self.status: int | None = None
        self.table: int | None = None
        self.charts: int | None = None
        self.refreshes: list[tuple] = []   # (snapshot, pending, status step, table step)
        self.chart_steps: list[int | None] = []   # the charts' step as of each refresh
        screen = app.dashboard
        bar_show, table_show, screen_show = screen.status_bar.show, screen.layer_table.show, screen.show
        chart_show = screen.loss_chart.show

        def chart(history):
            self.charts = history.steps[-1] if history.steps else None
            return chart_show(history)

        def bar(snap, *args, **kwargs):
            self.status = (snap.last or {}).get("step")
            return bar_show(snap, *args, **kwargs)

        def table(rows, step, *args, **kwargs):
            self.table = step
            return table_show(rows, step, *args, **kwargs)

        def show(snap, **kwargs):
            result = screen_show(snap, **kwargs)
            self.refreshes.append((snap, kwargs["pending"], self.status, self.table))
            self.chart_steps.append(self.charts)
            return result

        screen.status_bar.show, screen.layer_table.show, screen.show = bar, table, show
        screen.loss_chart.show = chart

    def charts_at_first_refresh_with(self, predicate):
        return next((c for (snap, pending, _, _), c in zip(self.refreshes, self.chart_steps)
                     if predicate(snap, pending)), None)

    def first_refresh_with(self, predicate):
        return next(((s, t) for snap, pending, s, t in self.refreshes if predicate(snap, pending)), None)


def intervention(step, action, after):
    return {"type": "event", "step": step, "kind": "intervention", "message": action, "time": 0.0,
            "action": action, "value": None, "source": "at", "before": {}, "after": after}


def nonfinite_step(records, step, layer):
    record = next_step(records, step)
    record.update(loss="NaN", skipped=True, nonfinite="loss")
    event = {"type": "event", "step": step, "kind": "nonfinite", "message": "non-finite loss",
             "time": 0.0, "where": "loss", "layer": layer, "loss": "NaN", "scale": 65536.0,
             "dtype": "float16"}
    return [record, event]


# name -> (change, the step both must show, how a refresh's input shows the change)
CHANGES = {
    "pause": (lambda src, recs: src.buffer.set_state("paused"), LAST,
              lambda snap, pending: snap.state == "paused"),
    "stop": (lambda src, recs: src.buffer.feed(intervention(LAST + 1, "stop", {"state": "stopped"})),
             LAST, lambda snap, pending: snap.state == "stopped"),
    "intervention": (lambda src, recs: src.buffer.feed(intervention(LAST + 1, "save", {"checkpoint": "c"})),
                     LAST, lambda snap, pending: snap.events[-1]["kind"] == "intervention"),
    "new non-finite layer": (lambda src, recs: [src.buffer.feed(r) for r in nonfinite_step(recs, LAST + 1, "wpe")],
                             LAST + 1, lambda snap, pending: snap.events[-1].get("layer") == "wpe"),
}


@pytest.mark.parametrize("name", list(CHANGES))
@run_async
async def test_a_change_brings_the_table_to_the_status_bars_step_at_the_next_refresh(name, monkeypatch):
    monkeypatch.setattr(dashboard, "TRAINING_PACE", ENDLESS)
    change, expected, shows_change = CHANGES[name]
    records = synthetic_records(FIRST)
    source = FixedSource(records)
    app = create_app(source, refresh_rate=20)
    async with app.run_test(size=SIZE) as pilot:
        drawn = Drawn(app)
        await until(pilot, lambda: bool(drawn.refreshes), "the first refresh")
        for step in range(FIRST, LAST + 1):
            source.buffer.feed(next_step(records, step))
        await until(pilot, lambda: drawn.first_refresh_with(
            lambda snap, pending: snap.last["step"] == LAST) is not None, "a refresh of the new steps")
        assert drawn.table != LAST, "the steady state is paced: the table has not caught up yet"
        assert drawn.charts != LAST, "the steady state is paced: the charts have not caught up yet"
        change(source, records)
        await until(pilot, lambda: drawn.first_refresh_with(shows_change) is not None, "a refresh")
        assert drawn.first_refresh_with(shows_change) == (expected, expected)
        assert drawn.charts_at_first_refresh_with(shows_change) == expected


@run_async
async def test_a_key_the_user_pressed_brings_the_table_along_too(monkeypatch):
    monkeypatch.setattr(dashboard, "TRAINING_PACE", ENDLESS)
    records = synthetic_records(FIRST)
    source = FixedSource(records)      # `answer` None: the command stays queued
    app = create_app(source, refresh_rate=20)
    async with app.run_test(size=SIZE) as pilot:
        drawn = Drawn(app)
        await until(pilot, lambda: bool(drawn.refreshes), "the first refresh")
        for step in range(FIRST, LAST + 1):
            source.buffer.feed(next_step(records, step))
        await until(pilot, lambda: drawn.first_refresh_with(
            lambda snap, pending: snap.last["step"] == LAST) is not None, "a refresh of the new steps")
        assert drawn.table != LAST
        await pilot.press("c")            # save a checkpoint: queued
        await until(pilot, lambda: drawn.first_refresh_with(lambda snap, pending: pending) is not None,
                    "a refresh with the queued command")
        assert drawn.first_refresh_with(lambda snap, pending: pending) == (LAST, LAST)


@run_async
async def test_a_key_that_moves_a_paused_replay_brings_the_table_to_the_same_step(
        mlp_script, tmp_path, monkeypatch):
    from amp_tui.cli import main
    from amp_tui.sources.replay import ReplaySource

    run_dir = tmp_path / "run"
    # Every step probed: the table has a row of figures for each step the replay moves to.
    assert main(["train", str(mlp_script), "--headless", "--steps", "12", "--probe-every", "1",
                 "--run-dir", str(run_dir)]) == 0
    monkeypatch.setattr(dashboard, "REPLAY_PACE", dashboard.Pacing(
        status_s=0.0, table_s=1e9, charts_s=1e9))
    source = ReplaySource(run_dir, autoplay=False)
    app = create_app(source, refresh_rate=20)
    async with app.run_test(size=SIZE) as pilot:
        drawn = Drawn(app)
        await until(pilot, lambda: bool(drawn.refreshes), "the first refresh")
        for expected in (1, 2, 3):
            await pilot.press("right")
            def at_expected(snap, pending, expected=expected):
                return snap.position == expected
            await until(pilot, lambda: drawn.first_refresh_with(at_expected) is not None, f"a refresh at {expected}")
            assert drawn.first_refresh_with(at_expected) == (expected, expected)
