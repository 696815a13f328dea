"""The dashboard paces what only ticks with the steps, and never delays what the user must see.

Beside a training run every repaint takes time from the training thread, so the status bar's step
figures are redrawn at most a few times a second however fast steps land; a state change (pause,
stop, error) or a queued command is drawn at the next tick. A replay is not paced.
"""

import asyncio
import copy
import time

from test_dashboard import SIZE, run_async

from amp_tui.ui.app import create_app
from amp_tui.ui.dashboard import TRAINING_PACE
from amp_tui.ui.fixed_source import FixedSource, synthetic_records


def status(app) -> str:
    return str(app.dashboard.status_bar.render())


def next_step(records: list[dict], step: int) -> dict:
    last = next(r for r in reversed(records) if r["type"] == "step")
    record = copy.deepcopy(last)
    record.update(step=step, time=last["time"] + 0.125 * (step - last["step"]))
    return record


def count_status_draws(app) -> list[float]:
    """Stamp every time the status bar takes new text."""
    draws: list[float] = []
    bar = app.dashboard.status_bar
    original = bar.show

    def show(*args, **kwargs):
        before = bar._text
        original(*args, **kwargs)
        if bar._text is not before:
            draws.append(time.monotonic())
    bar.show = show
    return draws


async def feed_steps(source, records, first: int, seconds: float, rate: float) -> int:
    """Feed step records at `rate` a second for `seconds`; the last step fed."""
    step, end = first, time.monotonic() + seconds
    while time.monotonic() < end:
        source.buffer.feed(next_step(records, step))
        step += 1
        await asyncio.sleep(1 / rate)
    return step - 1


@run_async
async def test_live_status_bar_is_paced_and_ends_on_the_newest_step():
    records = synthetic_records(50)
    source = FixedSource(records)
    app = create_app(source, refresh_rate=20)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        draws = count_status_draws(app)
        last = await feed_steps(source, records, 50, seconds=2.0, rate=50)
        await pilot.pause(TRAINING_PACE.status_s + 0.2)
        # 100 steps arrived; a fresh one showed at the pace, not 20 times a second
        assert 2.0 / TRAINING_PACE.status_s - 1 <= len(draws) <= 2.0 / TRAINING_PACE.status_s + 3, draws
        assert all(b - a >= TRAINING_PACE.status_s * 0.9 for a, b in zip(draws, draws[1:]))
        # nothing is lost: once the steps stop, the newest one is on screen
        assert f"step {last + 1}/" in status(app), status(app)  # shown as steps done


@run_async
async def test_a_state_change_is_drawn_at_once_however_recent_the_last_draw():
    records = synthetic_records(50)
    source = FixedSource(records)
    app = create_app(source, refresh_rate=20)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        source.buffer.feed(next_step(records, 50))
        await pilot.pause(0.1)   # a step was just drawn: the pace would hold the next one back
        source.buffer.set_state("paused")
        started = time.monotonic()
        while "PAUSED" not in status(app):
            assert time.monotonic() - started < TRAINING_PACE.status_s, "the pause waited for the pace"
            await pilot.pause(0.01)


@run_async
async def test_a_queued_command_is_acknowledged_in_the_status_bar_at_once():
    records = synthetic_records(50)
    source = FixedSource(records)     # `answer` None: the command stays queued
    app = create_app(source, refresh_rate=20)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        source.buffer.feed(next_step(records, 50))
        await pilot.pause(0.05)
        started = time.monotonic()
        await pilot.press("s")
        while "queued:" not in status(app):
            assert time.monotonic() - started < TRAINING_PACE.status_s, status(app)
            await pilot.pause(0.01)
        assert source.sent, "the engine got the command"


@run_async
async def test_a_replay_is_not_paced():
    records = synthetic_records(50)
    source = FixedSource(records, mode="replay")
    app = create_app(source, refresh_rate=20)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        draws = count_status_draws(app)
        await feed_steps(source, records, 50, seconds=1.0, rate=40)
        await pilot.pause(0.1)
        # every refresh tick that saw a new step drew it: well over the live pace's 4 a second
        assert len(draws) > 1.0 / TRAINING_PACE.status_s + 4, draws


@run_async
async def test_the_first_steps_reach_the_charts_at_once_however_costly_their_last_draw():
    """Beside training the charts redraw every few seconds; "waiting for the first step" must not
    stay up meanwhile."""
    records = synthetic_records(50)
    source = FixedSource(records[:1])          # the header only
    app = create_app(source, refresh_rate=20)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        charts = (app.dashboard.loss_chart, app.dashboard.scale_chart)
        for chart in charts:
            chart.cost_s = 1.0                 # as if the empty chart had been slow to draw
        source.buffer.feed(records[1])
        started = time.monotonic()
        while not all(chart._history is not None and chart._history.steps for chart in charts):
            assert time.monotonic() - started < TRAINING_PACE.status_s, "the charts waited for the pace"
            await pilot.pause(0.02)
