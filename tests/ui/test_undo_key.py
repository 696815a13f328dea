"""u undoes the autopilot's last decision (--on-nonfinite isolate) through the `undo` command, as
`amp-tui ctl RUN undo` does; refused, with the reason, when there is nothing left to undo and in a
replay. f leaves a fix the autopilot applied alone."""

from autopilot_cases import ATTENTION

from amp_tui.recording.reader import read_session
from amp_tui.recording.report import read_digest, summarize, summary_lines
from amp_tui.sources.replay import ReplaySource
from amp_tui.ui.app import create_app

from support import SIZE, build_live, run_async, toasts, until


@run_async
async def test_u_takes_the_isolation_back_then_says_nothing_is_left(write_script, tmp_path):
    run, source = build_live(write_script(ATTENTION), tmp_path / "run", steps=3, dtype="float16",
                             on_nonfinite="isolate", at=["1:pause"])
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: source.snapshot().state == "paused", "the pause at step 1", timeout=60)
            assert run.controller.local_fp32.names == ["attn"]
            await pilot.press("f")   # the verified fix is the autopilot's already: not toggled off
            await until(pilot, lambda: "the autopilot applied --fp32-modules 'attn' already" in toasts(app),
                        "the refusal of f")
            assert run.controller.local_fp32.names == ["attn"]
            await pilot.press("u")
            await until(pilot, lambda: "undid the autopilot's attn in fp32" in toasts(app), "the ack")
            assert run.controller.local_fp32.names == []
            await pilot.press("u")
            await until(pilot, lambda: "nothing to undo" in toasts(app), "the refusal")
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, "the app to exit")
    finally:
        source.stop(5.0)
    events = read_session(tmp_path / "run").events
    undo = [e for e in events if e["kind"] == "intervention" and e.get("action") == "undo"]
    assert [(e["source"], e["after"]) for e in undo] == [("dashboard", {"fp32_modules": []})]
    # Both refusals, f's and the second u's, recorded alike; the report counts them apart from errors.
    refused = [(e["command"], e["source"]) for e in events if e["kind"] == "refused"]
    assert refused == [("fix", "dashboard"), ("undo", "dashboard")]
    summary = summarize(read_digest(tmp_path / "run"))
    assert summary.errors == [] and [r["command"] for r in summary.refused] == ["fix", "undo"]
    assert ("refused commands", "2") in summary_lines(summary)
    assert not [row for row in summary_lines(summary) if row[0] == "errors"]


@run_async
async def test_u_in_a_replay_says_a_recording_cant_be_steered(write_script, tmp_path):
    recorded = tmp_path / "recorded"
    run, _ = build_live(write_script(ATTENTION), recorded, steps=2, dtype="float16", on_nonfinite="isolate")
    assert run.run() == 0
    app = create_app(ReplaySource(recorded, autoplay=False))
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.press("u")
        await until(pilot, lambda: "a recording can't be steered" in toasts(app), "the refusal")
