"""x X-rays the next step: the run traces it op by op, and once its event comes the dashboard
shows the file in a dialog, the ops closest to their dtype's max first; in a replay x says why it
can't."""

from amp_tui.sources.replay import ReplaySource
from amp_tui.ui.app import create_app
from amp_tui.ui.dialogs.xray_dialog import XrayDialog

from support import SIZE, build_live, run_async, toasts, until


@run_async
async def test_x_xrays_the_next_step_and_shows_it_sorted_by_headroom(mlp_script, tmp_path):
    run, source = build_live(mlp_script, tmp_path / "run", at=["1:pause"], dtype="float16")
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: source.snapshot().state == "paused", "the pause")
            await pilot.press("x")
            await until(pilot, lambda: "step 1 will be X-rayed" in toasts(app), "the ack")
            await pilot.press("n")
            await until(pilot, lambda: isinstance(app.screen, XrayDialog), "the X-ray's dialog")
            dialog = app.screen
            text = str(dialog.query_one("#xray-text").render())
            bits = [float(line.split()[0]) for line in text.splitlines()
                    if line.startswith("  ") and " bits  aten." in line]
            assert bits and bits == sorted(bits)
            assert "aten.addmm (forward, float16) in 0" in text or "aten.addmm (forward, float16) in 2" in text
            assert "the loss (outside the model): float32" in text
            assert "xray-step-0000001.json" in text
            await pilot.press("escape")
            await until(pilot, lambda: app.screen is app.dashboard, "the dialog closed")
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, "the app to exit")
    finally:
        source.stop(5.0)
    assert (tmp_path / "run" / "xray-step-0000001.json").exists()


@run_async
async def test_x_in_a_replay_says_why_it_cant(mlp_script, tmp_path):
    run, _ = build_live(mlp_script, tmp_path / "recorded", steps=2)
    assert run.run() == 0
    app = create_app(ReplaySource(tmp_path / "recorded", autoplay=False))
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.press("x")
        await until(pilot, lambda: "a recording can't be X-rayed" in toasts(app), "the refusal")
