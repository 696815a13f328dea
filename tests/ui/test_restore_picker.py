"""`r` pauses the run while the checkpoint picker is open.

A run that trained on while the user picked would roll back every update made meanwhile: the
restore would land hundreds of steps after the moment the user chose it. The picker pauses a
running run (live or attached), and closing it lets the run go on only if the picker paused it.
"""

import pytest
from textual.widgets import OptionList

from amp_tui.core.commands import Outcome
from amp_tui.training.checkpoint import CheckpointInfo
from amp_tui.ui.app import create_app
from amp_tui.ui.dialogs.restore_dialog import RestoreDialog

from fixed_source import FixedSource, synthetic_records
from support import SIZE, build_live, run_async, toasts, until

CHECKPOINT = CheckpointInfo("runs/r/checkpoints/step-0000100.safetensors", 100, "float16", "full", 0.0)


def steering_source(mode: str, state: str = "running") -> FixedSource:
    source = FixedSource(synthetic_records(120), mode=mode, checkpoints=[CHECKPOINT])
    source.buffer.set_state(state)
    return source


def sent(source) -> list[tuple]:
    return [(c.action, c.value) for c in source.sent]


@pytest.mark.parametrize("mode", ["live", "attached"])
@run_async
async def test_the_picker_pauses_a_running_run_and_esc_lets_it_go_on(mode):
    source = steering_source(mode)
    app = create_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, RestoreDialog), "the picker")
        assert sent(source) == [("pause", None)]
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.dashboard, "the picker to close")
        assert sent(source) == [("pause", None), ("resume", None)]


@pytest.mark.parametrize("mode", ["live", "attached"])
@run_async
async def test_a_picked_checkpoint_is_restored_before_the_run_goes_on(mode):
    source = steering_source(mode)
    app = create_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("r")
        await until(pilot, lambda: app.screen.query(OptionList), "the picker")
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is app.dashboard, "the picker to close")
        assert sent(source) == [("pause", None), ("restore", str(CHECKPOINT.path)), ("resume", None)]


@pytest.mark.parametrize("how", ["paused", "pause queued"])
@run_async
async def test_a_run_paused_before_the_picker_opened_stays_paused(how):
    source = steering_source("live", "paused" if how == "paused" else "running")
    app = create_app(source)       # FixedSource's `answer` None: a command sent stays queued
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        if how == "pause queued":
            await pilot.press("space")
        before = sent(source)
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, RestoreDialog), "the picker")
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.dashboard, "the picker to close")
        assert sent(source) == before


@run_async
async def test_a_live_run_takes_no_step_while_the_picker_is_open(mlp_script, tmp_path):
    run, source = build_live(mlp_script, tmp_path / "run")
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: source.snapshot().state == "running" and run.step > 2,
                        "the run to be running")
            await pilot.press("r")
            await until(pilot, lambda: source.snapshot().state == "paused", "the run to pause")
            paused_at = run.step
            await pilot.pause(0.3)
            assert run.step == paused_at, "the run trained on behind the picker"
            assert isinstance(app.screen, RestoreDialog)
            await pilot.press("escape")
            await until(pilot, lambda: run.step > paused_at, "the run to go on")
    finally:
        source.stop(5.0)


@run_async
async def test_the_toast_left_is_the_restores_not_the_pickers_own_pause_and_resume():
    source = steering_source("live")
    source.answer = Outcome(True, "done")
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        await pilot.press("r")
        await until(pilot, lambda: app.screen.query(OptionList), "the picker")
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is app.dashboard, "the picker to close")
        await until(pilot, lambda: "restore" in toasts(app), "the restore's answer")
        await pilot.pause(0.2)
        titles = [line for line in toasts(app).splitlines() if line != "done"]
        assert titles == ["restore"], titles
        assert [c.action for c in source.sent] == ["pause", "restore", "resume"]
