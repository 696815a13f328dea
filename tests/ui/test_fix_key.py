"""f applies the fix the last non-finite step verified, through the same command a person would
type (fp32=MODULE, dtype=bf16); refused, with the reason, when there is none, twice, or in a
replay."""

from amp_tui.core.fixes import NO_FIX, fix_command, last_verified_fix
from amp_tui.recording.reader import read_session
from amp_tui.recording.report import read_digest, summarize
from amp_tui.sources.replay import ReplaySource
from amp_tui.ui.app import create_app

from support import ATTENTION_SCRIPT, SIZE, build_live, run_async, toasts, until


def test_a_fix_flag_becomes_the_command_that_applies_it():
    assert fix_command("--fp32-modules 'blocks.3.attn'").text() == "fp32=blocks.3.attn"
    assert fix_command("--dtype bf16").text() == "dtype=bf16"
    assert fix_command("--something else") is None and fix_command("--dtype 'unclosed") is None
    events = [{"kind": "nonfinite", "step": 1, "fix": "--dtype bf16", "fix_verified": True},
              {"kind": "nonfinite", "step": 2, "fix": "--fp32-modules 'head'", "fix_verified": False}]
    assert last_verified_fix(events)["step"] == 1
    assert last_verified_fix(events[1:]) is None


@run_async
async def test_f_applies_the_verified_fix_once(write_script, tmp_path):
    run, source = build_live(write_script(ATTENTION_SCRIPT), tmp_path / "run", steps=3)
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: source.snapshot().state == "paused", "the pause on the non-finite loss")
            # offered once verified, before anyone asks
            await until(pilot, lambda: "f applies it" in toasts(app) and "blocks.1.attn" in toasts(app),
                        "the verified fix offered")
            await pilot.press("f")
            await until(pilot, lambda: "blocks.1.attn now in fp32" in toasts(app), "the ack")
            assert run.local_fp32.names == ["blocks.1.attn"]
            await pilot.press("f")
            await until(pilot, lambda: "already applied" in toasts(app), "the refusal")
            assert run.local_fp32.names == ["blocks.1.attn"]
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, "the app to exit")
    finally:
        source.stop(5.0)
    events = read_session(tmp_path / "run").events
    fp32 = [e for e in events if e.get("action") == "fp32"]
    assert [(e["value"], e["source"]) for e in fp32] == [("blocks.1.attn", "dashboard")]
    # the second f: refused by the run, and recorded so
    [refused] = [e for e in events if e["kind"] == "refused"]
    assert (refused["command"], refused["source"]) == ("fix", "dashboard") and "already applied" in refused["reason"]


@run_async
async def test_f_without_a_verified_fix_and_in_a_replay_says_why(mlp_script, write_script, tmp_path):
    run, source = build_live(mlp_script, tmp_path / "run", at=["0:pause"])
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: source.snapshot().state == "paused", "the pause")
            await pilot.press("f")
            await until(pilot, lambda: "no verified fix" in toasts(app), "the refusal")
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, "the app to exit")
    finally:
        source.stop(5.0)
    # The run refused it, and the recording says so: a refusal, not an error.
    [refused] = [e for e in read_session(tmp_path / "run").events if e["kind"] == "refused"]
    assert (refused["command"], refused["reason"], refused["source"]) == ("fix", NO_FIX, "dashboard")
    summary = summarize(read_digest(tmp_path / "run"))
    assert summary.errors == [] and [r["command"] for r in summary.refused] == ["fix"]
    recorded = tmp_path / "recorded"
    run, source = build_live(write_script(ATTENTION_SCRIPT, "attention.py"), recorded, steps=1,
                             on_nonfinite="skip")
    assert run.run() == 0
    app = create_app(ReplaySource(recorded, autoplay=False))
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.press("f")
        await until(pilot, lambda: "run again with --fp32-modules 'blocks.1.attn'" in toasts(app), "the refusal")
