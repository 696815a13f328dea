"""Replay keys in the dashboard: play/pause, speed, stepping, events, home/end, go to a step, quit,
on a real recording; and one picture of a paused replay."""

from __future__ import annotations

import pytest
from textual.widgets import Input, Static

from amp_tui.cli import main
from amp_tui.recording.reader import read_session
from amp_tui.sources.replay import ReplaySource
from amp_tui.ui.app import create_app
from amp_tui.ui.dialogs.goto_dialog import GotoDialog, parse_step
from amp_tui.ui.screens.help_screen import help_text

from support import MLP_SCRIPT, run_async, until, write_run

SIZE = (120, 40)
STEPS = 30


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """A real 30-step headless run: dtype bf16 before step 10, a checkpoint before step 20."""
    folder = tmp_path_factory.mktemp("replay_keys")
    script = folder / "train_script.py"
    script.write_text(MLP_SCRIPT, encoding="utf-8")
    run_dir = folder / "run"
    assert main(["train", str(script), "--headless", "--steps", str(STEPS), "--run-dir", str(run_dir),
                 "--at", "10:dtype=bf16", "--at", "20:save"]) == 0
    return run_dir


def status(app) -> str:
    return str(app.dashboard.query_one("#status").render())


async def settle(pilot, app, source, what="the status bar"):
    """Until the status bar shows the source's position."""
    await until(pilot, lambda: f"step {source.frame + 1}/{STEPS}" in status(app), what)


@run_async
async def test_replay_keys_move_the_playback(recording):
    source = ReplaySource(recording, autoplay=False)
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        assert source.position == 0 and not source.playing
        await settle(pilot, app, source)
        text = status(app)
        assert "replay" in text and "step 1/30" in text and "paused" in text and "16 steps/s" in text
        active = set(app.dashboard.active_bindings)
        assert {"space", "plus", "minus", "left", "right", "left_square_bracket",
                "right_square_bracket", "home", "end", "g", "q", "question_mark"} <= active
        assert not active & {"d", "s", "S", "c", "r", "n", "m", "Q"}

        await pilot.press("right", "right", "right")
        assert source.position == 3
        await settle(pilot, app, source)
        assert "step 4/30" in status(app)
        await pilot.press("left")
        assert source.position == 2
        await pilot.press("plus")
        assert source.speed == 32
        await settle(pilot, app, source)
        assert "32 steps/s" in status(app)
        await pilot.press("minus", "minus")
        assert source.speed == 8
        await pilot.press("end")
        assert source.position == STEPS - 1
        await settle(pilot, app, source)
        assert "step 30/30" in status(app)
        await pilot.press("home")
        assert source.position == 0
        # events: the dtype change before step 10, the checkpoint before step 20
        events = {e["step"] for e in read_session(recording).events
                  if e["kind"] in ("intervention", "checkpoint_saved")}
        assert {10, 20} <= events
        await pilot.press("right_square_bracket")
        first = source.position
        assert first is not None and first > 0
        while source.position < 20:
            before = source.position
            await pilot.press("right_square_bracket")
            assert source.position > before
        assert source.position == 20
        await pilot.press("left_square_bracket")
        assert source.position < 20
        # space plays, and the same key pauses (the timer moves the position meanwhile)
        await pilot.press("home", "space")
        assert source.playing
        await until(pilot, lambda: source.position > 0, "playback to move")
        await until(pilot, lambda: "playing 8 steps/s" in status(app), "the playing status")
        await pilot.press("space")
        assert not source.playing
        # q quits
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")


@run_async
async def test_go_to_a_step_validates_the_input(recording):
    source = ReplaySource(recording, autoplay=False)
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        await pilot.press("g")
        assert isinstance(app.screen, GotoDialog)
        for bad, says in (("abc", "not a whole number"), ("30", "out of range"), ("-1", "out of range"),
                          ("", "type a step")):
            field = app.screen.query_one(Input)
            field.value = bad
            await pilot.press("enter")
            assert isinstance(app.screen, GotoDialog), bad
            assert says in str(app.screen.query_one("#goto-error", Static).render()), bad
        assert source.position == 0
        # arrows, home/end, + and - belong to the input while the dialog is open
        field = app.screen.query_one(Input)
        field.value = ""
        await pilot.press("1", "home", "minus", "end", "left", "right")
        assert field.value == "-1" and source.position == 0 and source.speed == 16
        field.value = "17"
        await pilot.press("enter")
        assert app.screen is app.dashboard
        assert source.position == 17
        await settle(pilot, app, source)
        assert "step 18/30" in status(app)
        await pilot.press("g", "escape")
        assert app.screen is app.dashboard and source.position == 17


@run_async
async def test_palette_and_help_list_the_replay_keys(recording):
    source = ReplaySource(recording, autoplay=False)
    app = create_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        titles = [c.title for c in app.get_system_commands(app.dashboard)]
        for title in ("Play / pause the replay  [space]", "Replay faster  [+]", "Step back  [←]",
                      "Next event  []]", "Go to the end  [end]", "Go to a step…  [g]"):
            assert title in titles
        assert not any(t.startswith("Cycle the dtype") or t.startswith("Stop the job") for t in titles)
    shown = [str(cell) for cell in help_text(mode="replay").columns[0]._cells]
    for key in ("space", "+", "-", "←", "→", "[", "]", "home", "end", "g", "q"):
        assert key in shown
    live = [str(cell) for cell in help_text(live=True).columns[0]._cells]
    assert "Q" not in live


@run_async
async def test_m_adds_no_note_to_a_recording(recording):
    source = ReplaySource(recording, autoplay=False)
    app = create_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("m")
        await pilot.pause()
        assert app.screen is app.dashboard
        assert not any(c.title.startswith("Add a note") for c in app.get_system_commands(app.dashboard))
    assert "m" not in [str(cell) for cell in help_text(mode="replay").columns[0]._cells]


def test_parse_step():
    assert parse_step(" 0 ", 30) == 0 and parse_step("29", 30) == 29
    for bad in ("x", "1.5", "30", "-1", ""):
        with pytest.raises(ValueError):
            parse_step(bad, 30)


def test_paused_replay_snapshot(snap_compare, tmp_path):
    """A synthetic recording (fixed device and figures), paused at step 12, frozen clock."""
    write_run(tmp_path / "session.jsonl")
    source = ReplaySource(tmp_path, autoplay=False, clock=lambda: 100.0)
    source.seek(12)
    assert snap_compare(create_app(source, clock=lambda: 1015.0), terminal_size=SIZE)


@run_async
async def test_replay_follows_a_session_that_grows_while_the_app_runs(recording, tmp_path):
    """`amp-tui replay --follow`: records appended by a running job show up in the open app."""
    lines = (recording / "session.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    steps = [i for i, line in enumerate(lines) if '"type":"step"' in line]
    growing = tmp_path / "session.jsonl"
    growing.write_text("".join(lines[:steps[9] + 1]), encoding="utf-8")  # header .. step 9
    source = ReplaySource(growing, follow=True)
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: "step 10" in status(app), "the first ten steps")
        with open(growing, "a", encoding="utf-8") as fh:  # the job writes on
            fh.write("".join(lines[steps[9] + 1:steps[24] + 1]))
        await until(pilot, lambda: "step 25" in status(app), "the appended steps")
        assert source.total_steps == 25
        events = [e.get("kind") for e in source.snapshot().events]
        assert "intervention" in events  # the dtype switch before step 10 arrived with them
