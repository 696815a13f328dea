"""8 casts the next step's Linear layers to fp8 in a what-if: once its event comes, the dashboard
shows a line per layer with its verdict, sortable; in a replay 8 says why it can't."""

from textual.widgets import DataTable

from amp_tui.sources.replay import ReplaySource
from amp_tui.ui.app import create_app
from amp_tui.ui.dialogs.fp8_dialog import Fp8Dialog

from support import SIZE, build_live, run_async, toasts, until


@run_async
async def test_8_casts_the_next_step_and_shows_each_layers_verdict(mlp_script, tmp_path):
    run, source = build_live(mlp_script, tmp_path / "run", at=["1:pause"], dtype="bfloat16")
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: source.snapshot().state == "paused", "the pause")
            await pilot.press("8")
            await until(pilot, lambda: "step 1 will be cast to fp8" in toasts(app), "the ack")
            await pilot.press("n")
            await until(pilot, lambda: isinstance(app.screen, Fp8Dialog), "the what-if's dialog")
            dialog = app.screen
            table = dialog.query_one(DataTable)
            layers = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
            verdicts = {str(table.get_row_at(i)[0]): str(table.get_row_at(i)[1]) for i in range(table.row_count)}
            assert set(verdicts.values()) <= {"fp8", "bf16"} and layers
            head = str(dialog.query_one("#fp8-head").render())
            assert "fp8-step-0000001.json" in head and "fp8-filter-step-0000001.py" in head
            # s sorts by the next column (input dB), then a second time by the one after it.
            await pilot.press("s")
            dbs = [float(str(table.get_row_at(i)[2])) for i in range(table.row_count)]
            assert dbs == sorted(dbs)
            await pilot.press("escape")
            await until(pilot, lambda: app.screen is app.dashboard, "the dialog closed")
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, "the app to exit")
    finally:
        source.stop(5.0)
    assert (tmp_path / "run" / "fp8-filter-step-0000001.py").exists()


@run_async
async def test_8_in_a_replay_says_why_it_cant(mlp_script, tmp_path):
    run, _ = build_live(mlp_script, tmp_path / "recorded", steps=2)
    assert run.run() == 0
    app = create_app(ReplaySource(tmp_path / "recorded", autoplay=False))
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.press("8")
        await until(pilot, lambda: "a recording can't be cast to fp8" in toasts(app), "the refusal")


@run_async
async def test_a_what_if_of_fp8_every_is_a_toast_not_a_dialog(mlp_script, tmp_path):
    run, source = build_live(mlp_script, tmp_path / "run", at=["3:pause"], dtype="bfloat16", fp8_every=2)
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: source.snapshot().state == "paused", "the pause")
            await until(pilot, lambda: "fp8 what-if of step 2" in toasts(app), "the toast")
            assert app.screen is app.dashboard
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, "the app to exit")
    finally:
        source.stop(5.0)
