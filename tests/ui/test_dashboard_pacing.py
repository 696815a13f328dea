"""The dashboard paces what only ticks with the steps, and never delays what the user must see.

The pacing reads a clock the tests move themselves (`pace_clock`), and each test calls the
dashboard's refresh itself: what is checked is the logic, whatever this machine's speed.

Beside a training run every repaint takes time from the training thread, so the status bar's step
figures are redrawn at most a few times a second however fast steps land; a state change (pause,
stop, error) or a queued command is drawn at the next tick. A replay is not paced.
"""

import re

from amp_tui.ui.app import create_app
from amp_tui.ui.screens.dashboard import TRAINING_PACE

from fixed_source import FixedSource, synthetic_records
from support import SIZE, next_step, run_async


def status(app) -> str:
    return str(app.dashboard.status_bar.render())




class PaceClock:
    """The clock the dashboard's pacing reads, moved by the test alone: what is paced depends on
    the intervals the test sets, never on how fast this machine draws."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# A step every 1/64 s: binary fractions keep the pace clock's sums exact.
STEP_S = 1 / 64


def count_status_draws(app, clock: PaceClock) -> list[float]:
    """The pace clock's time at every draw that gave the status bar new text."""
    draws: list[float] = []
    bar = app.dashboard.status_bar
    original = bar.show

    def show(*args, **kwargs):
        before = bar._text
        original(*args, **kwargs)
        if bar._text is not before:
            draws.append(clock())
    bar.show = show
    return draws


def feed_and_refresh(app, source, records, first: int, count: int, clock: PaceClock) -> int:
    """Feed `count` steps STEP_S apart, the dashboard refreshing after each; the last step fed."""
    for step in range(first, first + count):
        clock.advance(STEP_S)
        source.buffer.feed(next_step(records, step))
        app.refresh_view()
    return first + count - 1


def drawn_now(app, clock: PaceClock) -> None:
    """A refresh well past every pace: whatever is pending is drawn."""
    clock.advance(60.0)
    app.refresh_view()


@run_async
async def test_live_status_bar_is_paced_and_ends_on_the_newest_step():
    records = synthetic_records(50)
    source = FixedSource(records)
    clock = PaceClock()
    app = create_app(source, refresh_rate=20, pace_clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        drawn_now(app, clock)
        draws = count_status_draws(app, clock)
        steps = round(2.0 / STEP_S)                      # two seconds of steps, 64 a second
        last = feed_and_refresh(app, source, records, 50, steps, clock)
        # 128 steps, a refresh after each: the status bar took a new step once per pace
        assert len(draws) == round(2.0 / TRAINING_PACE.status_s), draws
        assert all(b - a >= TRAINING_PACE.status_s for a, b in zip(draws, draws[1:]))
        # nothing is lost: once the steps stop, the newest one is on screen at the next pace
        clock.advance(TRAINING_PACE.status_s)
        app.refresh_view()
        assert f"step {last + 1}/" in status(app), status(app)  # shown as steps done


@run_async
async def test_a_state_change_is_drawn_at_once_however_recent_the_last_draw():
    records = synthetic_records(50)
    source = FixedSource(records)
    clock = PaceClock()
    app = create_app(source, refresh_rate=20, pace_clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        source.buffer.feed(next_step(records, 50))
        drawn_now(app, clock)
        assert "step 51/" in status(app)
        clock.advance(STEP_S)
        source.buffer.feed(next_step(records, 51))
        app.refresh_view()
        assert "step 51/" in status(app)               # a new step alone waits for the pace
        source.buffer.set_state("paused")
        app.refresh_view()                             # the pace clock has not moved
        assert "PAUSED" in status(app), status(app)


@run_async
async def test_a_queued_command_is_acknowledged_in_the_status_bar_at_once():
    records = synthetic_records(50)
    source = FixedSource(records)     # `answer` None: the command stays queued
    clock = PaceClock()
    app = create_app(source, refresh_rate=20, pace_clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        source.buffer.feed(next_step(records, 50))
        drawn_now(app, clock)
        clock.advance(STEP_S)                          # a step was just drawn
        await pilot.press("s")
        await pilot.pause()
        assert "queued:" in status(app), status(app)   # the pace clock has not moved
        assert source.sent, "the engine got the command"


@run_async
async def test_a_replay_is_not_paced():
    records = synthetic_records(50)
    source = FixedSource(records, mode="replay")
    clock = PaceClock()
    app = create_app(source, refresh_rate=20, pace_clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        drawn_now(app, clock)
        draws = count_status_draws(app, clock)
        feed_and_refresh(app, source, records, 50, 40, clock)
        assert len(draws) == 40, draws                 # every refresh that saw a new step drew it


def chart_step(app) -> int | None:
    history = app.dashboard.loss_chart._history
    return history.steps[-1] if history is not None and history.steps else None


def status_step(app) -> int:
    """The step the status bar shows (it counts steps done: step N+1 for the record of step N)."""
    return int(re.search(r"\bstep (\d+)", status(app)).group(1)) - 1


@run_async
async def test_the_first_steps_reach_the_charts_with_the_status_bar():
    """Beside training the charts redraw every few seconds; "waiting for the first step" must not
    stay up meanwhile."""
    records = synthetic_records(50)
    source = FixedSource(records[:1])          # the header only
    clock = PaceClock()
    app = create_app(source, refresh_rate=20, pace_clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        drawn_now(app, clock)
        source.buffer.feed(records[1])
        clock.advance(STEP_S)
        app.refresh_view()
        charts = (app.dashboard.loss_chart, app.dashboard.scale_chart)
        assert all(chart._history is not None and chart._history.steps == [0] for chart in charts)
        assert status_step(app) == 0


@run_async
async def test_the_charts_move_only_with_the_status_bar_and_never_trail_it_by_more_than_their_pace():
    records = synthetic_records(50)
    source = FixedSource(records)
    clock = PaceClock()
    app = create_app(source, refresh_rate=20, pace_clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        drawn_now(app, clock)
        shown_since: dict[int, float] = {}     # the charts' step -> when it first showed
        for step in range(50, 50 + round(12.0 / STEP_S)):    # 12 s of steps, 64 a second
            before = chart_step(app)
            clock.advance(STEP_S)
            source.buffer.feed(next_step(records, step))
            app.refresh_view()
            if chart_step(app) != before:
                assert chart_step(app) == status_step(app), "the charts drew a step the status bar doesn't show"
                shown_since[chart_step(app)] = clock()
            # the status bar trails the newest step by its pace at most, the charts by theirs
            assert step - chart_step(app) <= (TRAINING_PACE.charts_s + TRAINING_PACE.status_s) / STEP_S + 1
        assert len(shown_since) >= 2, "the charts moved while the run trained"


@run_async
async def test_a_paused_run_has_charts_at_the_status_bars_step():
    """The run pauses while the charts are paced: the pause is drawn at once, the charts with it,
    and while the run stays paused (a single step, records that arrive late) they keep up."""
    records = synthetic_records(50)
    source = FixedSource(records)
    clock = PaceClock()
    app = create_app(source, refresh_rate=20, pace_clock=clock)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        drawn_now(app, clock)
        last = feed_and_refresh(app, source, records, 50, 40, clock)    # under a second of steps
        assert chart_step(app) < last, "the steady state is paced: the charts trail"
        source.buffer.set_state("paused")
        app.refresh_view()                             # the pace clock has not moved
        assert "PAUSED" in status(app)
        assert chart_step(app) == status_step(app) == last
        for step in (last + 1, last + 2):              # steps recorded after the pause showed
            clock.advance(TRAINING_PACE.status_s)
            source.buffer.feed(next_step(records, step))
            app.refresh_view()
            assert chart_step(app) == status_step(app) == step
