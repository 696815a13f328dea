"""The live dashboard: every key reaches the engine, is acknowledged on screen and recorded; the
failure modes (non-finite pause, script exception, hostile layer names, small terminals, a hung
step) behave; the pure view logic is right.

Live tests drive a real Run of a tiny CPU model on its training thread (LiveSource). Most start
paused (`--at 0:pause`) so the 2 CI cores aren't busy training while the UI is being tested.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from textual.widgets import Input, OptionList, Static

from amp_tui.core.commands import Command, Outcome
from amp_tui.core.text import visible
from amp_tui.job.build import build_run
from amp_tui.recording.reader import read_session
from amp_tui.sources.protocol import LayerView
from amp_tui.ui import view
from amp_tui.ui.app import AmpTuiApp, create_app
from amp_tui.ui.dialogs.note_dialog import NoteDialog
from amp_tui.ui.dialogs.restore_dialog import check_path
from amp_tui.ui.dialogs.scale_dialog import ScaleDialog, parse_scale
from amp_tui.ui.screens.help_screen import HelpScreen, help_text
from amp_tui.ui.text import middle_ellipsis
from amp_tui.ui.widgets.charts import envelope, integer_ticks
from amp_tui.ui.widgets.error_panel import ErrorPanel
from amp_tui.ui.widgets.layer_table import LayerTable
from amp_tui.ui.widgets.notice import PauseNotice
from amp_tui.ui.widgets.too_small import TooSmall

from fixed_source import SYNTHETIC_START, FixedSource, synthetic_records
from support import HELD_SCRIPT, SIZE, build_live, notified, run_async, toasts, train_config, until

FROZEN = SYNTHETIC_START + 400 * 0.125

HOSTILE = "[bold red]x[/]\x1b[31m"

OVERFLOW_SCRIPT = '''
import torch
from torch import nn

class Amplify(nn.Module):
    """Fine in fp32/bf16; its output passes 65504 in fp16, so the loss is NaN."""
    def __init__(self):
        super().__init__()
        self.amplifier = nn.Linear(8, 8)
        with torch.no_grad():
            self.amplifier.weight.mul_(1e5)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)
    def forward(self, x):
        return self.head(self.norm(self.amplifier(x)))

def setup(ctx=None):
    torch.manual_seed(0)
    model = Amplify()
    xs = torch.randn(32, 8) * 4
    batches = [(xs[i:i + 8], xs[i:i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=1e-3),
            "loss_fn": loss_fn, "batches": batches}
'''

RAISING_SCRIPT = '''
import torch
from torch import nn

steps = {"n": 0}

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    xs = torch.randn(16, 4)
    batches = [(xs[i:i + 4], xs[i:i + 4].sum(1, keepdim=True)) for i in range(0, 16, 4)]
    def loss_fn(model, batch):
        if model.training:           # every call is a step's (the pre-flight check is step 0's forward)
            steps["n"] += 1
            if steps["n"] == 4:      # steps 0..2 train, step 3 raises
                raise_bad_batch()
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=1e-2),
            "loss_fn": loss_fn, "batches": batches}

def raise_bad_batch():
    raise ValueError("[red]bad batch[/] \\x1b[2J")
'''



# ---- helpers ----------------------------------------------------------------------------------







def dashboard_events(run, kind: str = "intervention") -> list[dict]:
    return [e for e in read_session(run.session_path).events
            if e.get("kind") == kind and e.get("source") == "dashboard"]


async def invoke(callback):
    """Run a palette callback the way the palette does (it may or may not be a coroutine)."""
    result = callback()
    if asyncio.iscoroutine(result):
        await result




@pytest.fixture
def paused_run(mlp_script, tmp_path):
    """A live run of the small MLP that pauses itself before step 0."""
    run, source = build_live(mlp_script, tmp_path / "run", at=["0:pause"])
    yield run, source
    source.stop(5.0)


async def wait_paused(pilot, source):
    await until(pilot, lambda: source.snapshot().state == "paused", "the run to pause")


# ---- every key: the engine gets the command, the screen acknowledges, the session records ------

@run_async
async def test_d_cycles_dtype_fp16_bf16_fp32_fp16(paused_run):
    run, source = paused_run
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_paused(pilot, source)
        expected = ["bfloat16", "float32", "float16"]
        for n, dtype in enumerate(expected, 1):
            await pilot.press("d")
            await until(pilot, lambda n=n: len(dashboard_events(run)) == n, f"dtype event {n}")
            await until(pilot, lambda: "dtype" in toasts(app) and "→" in toasts(app), "the toast")
            assert run.trainer.dtype == dtype
        events = dashboard_events(run)
        assert [(e["action"], e["before"]["dtype"], e["after"]["dtype"]) for e in events] == [
            ("dtype", "float16", "bfloat16"), ("dtype", "bfloat16", "float32"),
            ("dtype", "float32", "float16")]
        assert "dtype fp32 → fp16" in toasts(app)
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")


def commanded(run):
    """The probe schedule's changes a command made (the schedule's own spacing events aside)."""
    return [e for e in dashboard_events(run, "probes") if e["reason"] == "command"]


@run_async
async def test_p_probes_every_step_then_lets_the_schedule_decide(paused_run):
    run, source = paused_run
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_paused(pilot, source)
        await pilot.press("p")
        await until(pilot, lambda: commanded(run), "the escalation")
        await until(pilot, lambda: "probing every step: asked for" in toasts(app), "ack")
        await pilot.press("n")   # one step: its record says so in the status bar
        await until(pilot, lambda: "probes every step · " in str(app.dashboard.status_bar.render()),
                    "the status bar")
        await pilot.press("p")
        await until(pilot, lambda: len(commanded(run)) == 2, "the return")
    every, auto = commanded(run)
    assert (every["mode"], every["reason"], auto["mode"], auto["reason"]) == ("every", "command", "auto", "command")


def test_the_status_bar_says_the_probe_schedule():
    from amp_tui.ui.widgets.status_bar import probes_text
    assert probes_text(["auto", 9, 0.8]) == ("auto 1/9 · 0.8%", "bold")
    why = "blocks.3 at 2.4 bits of headroom"
    assert probes_text(["every", why]) == (f"every step · {why}", "bold yellow")
    assert probes_text(None) is None and probes_text(["later", 1]) is None


@run_async
async def test_s_halves_and_S_sets_an_exact_loss_scale(paused_run):
    run, source = paused_run
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_paused(pilot, source)
        before = run.trainer.scale
        await pilot.press("s")
        await until(pilot, lambda: dashboard_events(run), "the halving event")
        await until(pilot, lambda: f"loss scale {before:g} → {before / 2:g}" in toasts(app), "ack")
        assert run.trainer.scale == before / 2
        await pilot.press("S")
        await until(pilot, lambda: isinstance(app.screen, ScaleDialog), "the scale dialog")
        await pilot.press(*"2^12", "enter")
        await until(pilot, lambda: len(dashboard_events(run)) == 2, "the exact-scale event")
        await until(pilot, lambda: f"loss scale {before / 2:g} → 4096" in toasts(app), "ack")
        assert run.trainer.scale == 4096.0
    halve, exact = dashboard_events(run)
    assert (halve["action"], halve["value"]) == ("scale", "half")
    assert halve["before"]["scale"] == before and halve["after"]["scale"] == before / 2
    assert (exact["action"], exact["value"]) == ("scale", 4096.0)
    assert exact["after"]["scale"] == 4096.0


BAD_SCALES = [("abc", "not a number"), ("-4", "not positive"), ("0", "not positive"),
              ("inf", "not finite"), ("nan", "not finite"), ("", "type a number")]


@run_async
async def test_m_asks_for_a_note_and_sends_it_to_the_run(paused_run, monkeypatch):
    run, source = paused_run
    submitted: list[Command] = []
    submit = run.submit
    monkeypatch.setattr(run, "submit", lambda command: (submitted.append(command), submit(command)))
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_paused(pilot, source)
        await pilot.press("m")
        await until(pilot, lambda: isinstance(app.screen, NoteDialog), "the note dialog")
        await pilot.press("enter")      # nothing typed: refused in the dialog, nothing sent
        assert "the text is empty" in str(app.screen.query_one("#note-error", Static).render())
        assert isinstance(app.screen, NoteDialog) and submitted == []
        await pilot.press(*"x", "escape")
        assert app.screen is app.dashboard and submitted == []
        await pilot.press("m")
        await until(pilot, lambda: isinstance(app.screen, NoteDialog), "the note dialog")
        await pilot.press(*"lr=1e-4: shard 2")
        app.screen.query_one("#note-input", Input).value += " → données"
        await pilot.press("enter")
        await until(pilot, lambda: submitted, "the note to reach the run")
        assert app.screen is app.dashboard
        assert submitted == [Command("note", "lr=1e-4: shard 2 → données", "dashboard")]
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")


@run_async
async def test_S_refuses_bad_scales_with_a_message_and_sends_nothing():
    source = FixedSource(synthetic_records(), answer=Outcome(True, "ok"))
    app = create_app(source, clock=lambda: FROZEN)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.press("S")
        await until(pilot, lambda: isinstance(app.screen, ScaleDialog), "the scale dialog")
        field = app.screen.query_one("#scale-input", Input)
        for typed, problem in BAD_SCALES:
            field.value = typed
            await pilot.press("enter")
            error = str(app.screen.query_one("#scale-error", Static).render())
            assert problem in error, (typed, error)
            assert isinstance(app.screen, ScaleDialog), "a bad value must keep the dialog open"
        assert source.sent == []
        await pilot.press("escape")
        assert not isinstance(app.screen, ScaleDialog) and source.sent == []


@run_async
async def test_c_saves_r_lists_newest_first_and_restores_by_pick_or_path(paused_run, tmp_path):
    run, source = paused_run
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_paused(pilot, source)
        await pilot.press("c")
        await until(pilot, lambda: dashboard_events(run), "the save event")
        await until(pilot, lambda: "checkpoint saved" in toasts(app), "the save toast")
        assert dashboard_events(run)[0]["action"] == "save"
        await pilot.press("n")     # one more step, then a second checkpoint: newest must be first
        await until(pilot, lambda: run.step == 1, "the single step")
        await pilot.press("c")
        await until(pilot, lambda: len(dashboard_events(run, "checkpoint_saved")) == 2, "save 2")

        await pilot.press("r")
        await until(pilot, lambda: app.screen.query(OptionList), "the checkpoint picker")
        options = app.screen.query_one(OptionList)
        labels = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert len(labels) == 2 and "step       1" in labels[0] and "step       0" in labels[1]
        assert "fp16" in labels[0]
        await pilot.press("enter")
        await until(pilot, lambda: dashboard_events(run, "checkpoint_restored"), "the restore")
        await until(pilot, lambda: "restored" in toasts(app), "the restore toast")
        restored = dashboard_events(run, "checkpoint_restored")[0]
        assert restored["checkpoint_step"] == 1 and restored["path"].endswith(".safetensors")

        # the path field: any .safetensors file; a bad path is refused with a reason
        oldest = run.checkpoints()[-1].path
        await pilot.press("r")
        await until(pilot, lambda: app.screen.query(OptionList), "the checkpoint picker")
        await pilot.press("tab")
        field = app.screen.query_one("#restore-path", Input)
        assert field.has_focus
        (tmp_path / "notes.txt").write_text("x")
        for bad, problem in [(str(tmp_path / "missing.safetensors"), "no such file"),
                             (str(tmp_path / "notes.txt"), "not a .safetensors file")]:
            field.value = bad
            await pilot.press("enter")
            assert problem in str(app.screen.query_one("#restore-error", Static).render())
        assert len(dashboard_events(run, "checkpoint_restored")) == 1
        field.value = str(oldest)
        await pilot.press("enter")
        await until(pilot, lambda: len(dashboard_events(run, "checkpoint_restored")) == 2, "restore 2")
        assert dashboard_events(run, "checkpoint_restored")[1]["checkpoint_step"] == 0


@run_async
async def test_space_pauses_and_resumes_and_n_steps_only_while_paused(mlp_script, tmp_path):
    run, source = build_live(mlp_script, tmp_path / "run")
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: source.snapshot().state == "running" and run.step > 2,
                        "the run to be running")
            await pilot.press("n")
            await until(pilot, lambda: "while paused" in toasts(app), "the refusal of n")
            assert not dashboard_events(run), "a refused command is not an intervention"

            await pilot.press("space")
            await until(pilot, lambda: dashboard_events(run), "the pause event")
            await until(pilot, lambda: "paused" in toasts(app), "the pause toast")
            await until(pilot, lambda: "PAUSED" in str(app.dashboard.status_bar.render()),
                        "the status bar to say paused")
            paused_at = run.step
            await pilot.pause(0.3)
            assert run.step == paused_at, "a paused run must not step"

            await pilot.press("n")
            await until(pilot, lambda: run.step == paused_at + 1, "exactly one step")
            await until(pilot, lambda: "single step" in toasts(app), "the step toast")
            await pilot.pause(0.3)
            assert run.step == paused_at + 1

            await pilot.press("space")
            await until(pilot, lambda: len(dashboard_events(run)) == 3, "the resume event")
            await until(pilot, lambda: run.step > paused_at + 1, "training to go on")
    finally:
        source.stop(5.0)
    actions = [(e["action"], e["after"]["state"]) for e in dashboard_events(run)]
    assert actions == [("pause", "paused"), ("step", "paused"), ("resume", "running")]


@run_async
async def test_every_key_is_bound_with_id_in_footer_palette_and_help():
    source = FixedSource(synthetic_records(), answer=Outcome(True, "checkpoint saved: x"))
    app = create_app(source, clock=lambda: FROZEN)
    keys = {b.key: b for b in AmpTuiApp.BINDINGS}
    assert set(keys) == {"d", "s", "S", "c", "r", "space", "n", "m", "p", "f", "u", "x", "8", "question_mark", "q",
                         "ctrl+c"}
    assert all(b.id and b.description for b in keys.values())
    # ctrl+c is a second key for quit, f only does something after a verified fix and u after an
    # autopilot's decision: in the help, not in the footer or the palette
    assert [k for k, b in keys.items() if not b.show] == ["f", "u", "ctrl+c"]
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        active = app.dashboard.active_bindings
        assert set(keys) <= set(active)
        titles = [c.title for c in app.get_system_commands(app.dashboard)]
        assert sum(t.startswith("Quit") for t in titles) == 1
        for action in ("Cycle the dtype", "Halve the loss scale", "Set the loss scale",
                       "Save a checkpoint", "Restore a checkpoint", "Pause / resume",
                       "Run one step", "Add a note", "Probe every step", "X-ray the next step", "Help", "Quit"):
            assert any(t.startswith(action) for t in titles), action
        assert any(t.startswith("Sort layers") for t in titles)
        # a palette entry runs the same action as its key
        command = next(c for c in app.get_system_commands(app.dashboard)
                       if c.title.startswith("Save a checkpoint"))
        await invoke(command.callback)
        await until(pilot, lambda: "checkpoint saved: x" in toasts(app), "the toast")
        assert [c.action for c in source.sent] == ["save"]
        # local fp32 for the layer under the cursor (the worst one: the table opens sorted)
        toggle = next(c for c in app.get_system_commands(app.dashboard)
                      if c.title.startswith("Toggle fp32 for layer"))
        assert toggle.title.endswith("h.4.mlp.c_fc")
        await invoke(toggle.callback)
        assert (source.sent[-1].action, source.sent[-1].value) == ("fp32", "h.4.mlp.c_fc")
        # ? shows the help, generated from the same registry; Esc closes it
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        shown = [str(cell) for cell in help_text(live=True).columns[0]._cells]
        for key in ("d", "s", "S", "c", "r", "space", "n", "m", "f", "x", "?", "q", "ctrl+c", "headroom bits"):
            assert key in shown
        await pilot.press("escape")
        assert app.screen is app.dashboard


@run_async
async def test_q_stops_at_a_step_boundary_and_flushes_the_session(mlp_script, tmp_path):
    run, source = build_live(mlp_script, tmp_path / "run")
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: run.step > 2, "some steps")
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert not source.alive and not app.forced_exit
    session = read_session(run.session_path)
    assert session.end is not None and session.end["status"] == "stopped"
    assert session.end["step"] == len(session.steps)


@run_async
async def test_q_with_a_hung_step_forces_the_exit_after_the_bounded_wait(write_script, tmp_path):
    """The step hangs until the test lets it go (HELD_SCRIPT), no longer for 1.5 s: on a loaded machine
    q could land so late in such a step that it ended within the 0.3-s wait, a clean stop with no
    forcing. The test waits on the app's own flag, and finds the message among what the app
    notified rather than among the toasts on screen, which a starved poll can miss before the app
    exits 1.5 s later."""
    script = write_script(HELD_SCRIPT)
    run, source = build_live(script, tmp_path / "run", dtype="float32")
    app = create_app(source, stop_timeout=0.3)
    said = notified(app)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: run.step >= 2, "the run to reach the hanging step")
            held_at = run.step
            await pilot.press("q")
            await until(pilot, lambda: app.forced_exit, "the forced exit")
            await until(pilot, lambda: not app.is_running, "the app to exit")
        assert any("did not finish within 0.3 s: forcing the exit" in text for text in said), said
        assert run.step == held_at, "the app left while the step still hung"
    finally:
        script.with_name("release").touch()
        assert source.stop(60.0), "the run stops once the step is let go"
    assert read_session(run.session_path).end["status"] == "stopped"


def test_run_dashboard_stops_flushes_prints_summary_and_returns_status(mlp_script, tmp_path,
                                                                      monkeypatch, capsys):
    from amp_tui.cli.train import run_dashboard

    original_run = AmpTuiApp.run

    def headless_run(self, **kwargs):
        async def autopilot(pilot):
            await until(pilot, lambda: self.source.snapshot().last is not None, "a step")
            await pilot.press("q")
        return original_run(self, headless=True, size=SIZE, auto_pilot=autopilot)

    monkeypatch.setattr(AmpTuiApp, "run", headless_run)
    run, warnings = build_run(train_config(mlp_script, tmp_path / "r", device="cpu", on_nonfinite="pause",
                                           command_line=["amp-tui"]))
    assert run_dashboard(run, warnings, refresh_rate=10) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["status", "stopped"] for line in out.splitlines()), out
    assert read_session(run.session_path).end["status"] == "stopped"


# ---- failure modes ------------------------------------------------------------------------------

@run_async
async def test_nonfinite_loss_pauses_with_a_notice_naming_step_and_layer(write_script, tmp_path):
    run, source = build_live(write_script(OVERFLOW_SCRIPT), tmp_path / "run")
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            notice = app.dashboard.query_one(PauseNotice)
            await until(pilot, lambda: notice.has_class("-visible"), "the pause notice")
            text = str(notice.render())
            assert "NaN loss at step 0" in text and "first non-finite layer: amplifier" in text
            for key in ("d switch dtype", "s halve scale", "r restore"):
                assert key in text
            await until(pilot, lambda: "amplifier" in toasts(app), "the pause toast")
            assert source.snapshot().state == "paused" and run.step == 1
            # the origin's row is highlighted in the layer table
            table = app.dashboard.layer_table
            await until(pilot, lambda: table._origin == "amplifier", "the origin row")
            position = [r.name for r in table._ordered].index("amplifier")
            assert any("reverse" in str(span.style) for span in table.row_text(position).spans)
            # the fix: bf16 has room for the activations; resuming clears the notice
            await pilot.press("d", "space")
            await until(pilot, lambda: not notice.has_class("-visible"), "the notice to clear")
    finally:
        source.stop(5.0)
    kinds = [e["kind"] for e in read_session(run.session_path).events]
    assert kinds[:2] == ["nonfinite", "paused"]


@run_async
async def test_script_exception_shows_traceback_panel_keeps_session_and_q_exits(write_script, tmp_path):
    run, source = build_live(write_script(RAISING_SCRIPT), tmp_path / "run", checkpoint_every=2,
                             dtype="float32")   # fp32: no overflow skip re-running loss_fn
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        panel = app.dashboard.query_one(ErrorPanel)
        await until(pilot, lambda: panel.has_class("-visible"), "the error panel")
        text = str(panel.query_one("#error-text", Static).render())
        assert "raise_bad_batch" in text and "ValueError" in text
        assert "[red]bad batch[/] \\x1b[2J" in text, "markup and escapes are shown literally"
        assert "\x1b" not in text
        assert str(run.session_path) in text and "step-0000002.safetensors" in text
        assert "raised at step 3" in str(panel.border_title)
        assert not app.dashboard.query_one(LayerTable).display
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    session = read_session(run.session_path)
    assert session.end["status"] == "error"
    assert [e for e in session.events if e["kind"] == "error"][0]["traceback"]
    assert run.checkpoints(), "the last checkpoint is kept"


@run_async
async def test_hostile_layer_names_and_messages_are_shown_literally():
    records = synthetic_records(50, layers=["embed", HOSTILE, "h.4.mlp.c_fc"])
    records.append({"type": "event", "step": 50, "kind": "intervention", "source": "dashboard",
                    "message": f"odd {HOSTILE} message", "action": "save", "before": {}, "after": {}})
    app = create_app(FixedSource(records), clock=lambda: FROZEN)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        table = app.dashboard.layer_table
        drawn = [table.render_line(y).text for y in range(1, 4)]      # what the terminal gets
        assert any("[bold red]x[/]\\x1b[31m" in line for line in drawn), drawn
        row = next(table.row_text(i) for i in range(3) if "[bold" in table.row_text(i).plain)
        assert not any("bold red" in str(span.style) for span in row.spans)
        svg = app.export_screenshot()
        assert "[bold&#160;red]x[/]\\x1b[31m" in svg or "[bold red]x[/]\\x1b[31m" in svg
        log = "".join(strip.text for strip in app.dashboard.event_log.lines).replace(" ", "")
        assert "odd[boldred]x[/]\\x1b[31mmessage" in log
        assert "\x1b" not in svg


@run_async
async def test_the_event_log_keeps_its_newest_event_in_view_when_its_height_changes():
    app = create_app(FixedSource(synthetic_records(400, ending="nonfinite")), clock=lambda: FROZEN)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await pilot.pause()
        log = app.dashboard.event_log
        assert log.max_scroll_y > 0, "the case needs more events than the log shows"
        for height in (34, 44, 30):          # shorter, taller: the log follows its end each time
            await pilot.resize_terminal(120, height)
            await pilot.pause()
            await pilot.pause()
            assert log.scroll_y == log.max_scroll_y, height
        log.scroll_home(animate=False)       # a reader scrolled back is left where they are
        await pilot.pause()
        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        assert log.scroll_y == 0 < log.max_scroll_y


@run_async
async def test_layer_table_sorts_by_header_click_and_follows_the_picked_layer():
    app = create_app(FixedSource(synthetic_records()), clock=lambda: FROZEN)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        table = app.dashboard.layer_table
        assert table.highlighted_layer() == "h.4.mlp.c_fc"      # the worst layer is on top
        await pilot.press("down", "down")
        picked = table.highlighted_layer()
        assert picked != "h.4.mlp.c_fc"
        await pilot.click(table, offset=(6, 1))                 # the "layer" header: by name
        assert table.sort_column == "name"
        assert [table._ordered[i].name for i in range(3)] == sorted(r.name for r in table._rows)[:3]
        assert table.highlighted_layer() == picked, "the cursor stays on the picked layer"
        await pilot.click(table, offset=(6, 1))                 # again: reversed
        assert table.sort_reverse and "reversed" in str(table.border_subtitle)
        await pilot.press("end")
        assert table.cursor_position == len(table._ordered) - 1


@run_async
async def test_too_small_terminal_says_so_and_recovers():
    app = create_app(FixedSource(synthetic_records()), clock=lambda: FROZEN)
    async with app.run_test(size=(79, 30), notifications=True) as pilot:
        await pilot.pause()
        message = app.dashboard.query_one(TooSmall)
        assert message.display and app.dashboard.has_class("-too-small")
        assert "needs more room" in str(message.render()) and "79×30" in str(message.render())
        assert not app.dashboard.query_one("#main").display
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert not message.display and app.dashboard.query_one("#main").display
        await pilot.resize_terminal(100, 23)
        await pilot.pause()
        assert message.display


# ---- refresh pacing and read-only sources ----------------------------------------------------------

@run_async
async def test_redraws_only_when_the_snapshot_version_changes(monkeypatch):
    source = FixedSource(synthetic_records())
    app = create_app(source, refresh_rate=50, clock=lambda: FROZEN)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause(0.1)
        draws = []
        original = app.dashboard.show
        monkeypatch.setattr(app.dashboard, "show", lambda *a, **k: draws.append(1) or original(*a, **k))
        await pilot.pause(0.4)                # ~20 timer ticks, nothing new
        assert draws == []
        source.buffer.feed({"type": "event", "step": 400, "kind": "alert",
                            "message": "the loss scale fell 5 times in a row"})
        await until(pilot, lambda: draws, "a redraw after new data")
        await until(pilot, lambda: "fell 5 times" in toasts(app), "the alert toast")
        await pilot.pause(0.2)
        assert len(draws) <= 2


def test_refresh_rate_must_be_positive():
    with pytest.raises(ValueError, match="refresh rate"):
        create_app(FixedSource([]), refresh_rate=0)


@run_async
async def test_a_replay_hides_the_live_only_keys():
    source = FixedSource(synthetic_records(ending="finished"), mode="replay")
    app = create_app(source, clock=lambda: FROZEN)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        active = set(app.dashboard.active_bindings)
        assert {"question_mark", "q"} <= active
        assert not active & {"d", "s", "S", "c", "r", "space", "n"}
        await pilot.press("d", "s", "c", "space")
        assert source.sent == []
        titles = [c.title for c in app.get_system_commands(app.dashboard)]
        assert not any(t.startswith("Cycle the dtype") for t in titles)
        assert "replay (read-only)" in str(app.dashboard.query_one("#status").render())


# ---- pure view logic ----------------------------------------------------------------------------------

def test_headroom_uses_the_active_dtype_and_scales_gradients():
    layers = LayerView(["a", "b", "c", "d"], [60000.0, 1.0, None, math.inf], [1e-3, 1.0, None, 1.0],
                       [1.0, 1.0, None, 1.0], 5, "float16")
    rows = view.layer_rows(layers, view.Precision("float16", 65536.0))
    a, b, c, d = rows
    assert a.limit == "act" and a.headroom == pytest.approx(math.log2(65504 / 60000))
    assert b.limit == "grad" and b.headroom == pytest.approx(math.log2(65504 / 65536))
    assert c.headroom is None and c.limit is None
    assert d.nonfinite
    assert [r.name for r in view.sort_rows(rows, "headroom")] == ["d", "b", "a", "c"]
    bf16 = view.layer_rows(layers, view.Precision("bfloat16", None))
    assert bf16[0].headroom == pytest.approx(math.log2(3.3895313892515355e38 / 60000))
    assert [r.name for r in view.sort_rows(rows, "act", reverse=True)] == ["d", "a", "b", "c"]


def test_current_precision_follows_interventions_made_while_paused():
    records = synthetic_records(20)
    records.append({"type": "event", "step": 20, "kind": "intervention", "action": "dtype",
                    "before": {"dtype": "float16", "scale": 8192.0},
                    "after": {"dtype": "bfloat16", "scale": None}, "message": "dtype fp16 → bf16"})
    snap = FixedSource(records).snapshot()
    assert view.current_precision(snap) == view.Precision("bfloat16", None)


def test_nonfinite_pause_is_found_and_cleared_by_a_manual_pause():
    snap = FixedSource(synthetic_records(ending="nonfinite")).snapshot()
    pause = view.nonfinite_pause(snap)
    assert pause is not None and pause.step == 399 and pause.layer == "h.4.mlp.c_fc"
    records = synthetic_records(ending="nonfinite") + [
        {"type": "event", "step": 400, "kind": "intervention", "action": "resume",
         "before": {"state": "paused"}, "after": {"state": "running"}, "message": "resumed"},
        {"type": "event", "step": 401, "kind": "intervention", "action": "pause",
         "before": {"state": "running"}, "after": {"state": "paused"}, "message": "paused"}]
    assert view.nonfinite_pause(FixedSource(records).snapshot()) is None


def test_parse_scale_and_check_path(tmp_path):
    assert parse_scale("4096") == 4096.0 and parse_scale("2^12") == 4096.0
    assert parse_scale(" 2**-3 ") == 0.125 and parse_scale("1e4") == 1e4
    for bad in ("", "x", "0", "-1", "inf", "nan", "1e999"):
        with pytest.raises(ValueError):
            parse_scale(bad)
    good = tmp_path / "c.safetensors"
    good.write_bytes(b"x")
    assert check_path(str(good), None) == good
    assert check_path("c.safetensors", tmp_path) == good
    with pytest.raises(ValueError, match="not a .safetensors"):
        check_path(str(tmp_path), None)


def test_text_helpers():
    assert visible("a\x1bb\tc\u202e") == "a\\x1bb c\\u202e"
    assert visible("x\ny", keep_newlines=True) == "x\ny"
    assert middle_ellipsis("model.layers.23.self_attn.q_proj", 20) == "model.…f_attn.q_proj"
    assert middle_ellipsis("short", 20) == "short"
    xs, ys = envelope([(i, float(i % 10)) for i in range(1000)], buckets=50)
    assert len(xs) <= 100 and max(ys) == 9.0 and min(ys) == 0.0 and xs == sorted(xs)
    assert integer_ticks(0, 399) == [0, 100, 200, 300]


def test_hangup_guard_stops_the_run_flushes_and_leaves(monkeypatch):
    from amp_tui.ui import hangup

    class Stub:
        def __init__(self, stops: bool):
            self.calls = []
            self.stops = stops

        def post_message(self, message):
            self.calls.append(type(message).__name__)

        def stop(self, timeout):
            self.calls.append("stop")
            return self.stops

        def close(self):
            self.calls.append("close")

        def request_stop(self, checkpoint, reason):
            self.calls.append(("request_stop", checkpoint, reason))

        def unattended(self):
            self.calls.append("unattended")

    exits = []
    monkeypatch.setattr(hangup, "GRACE_S", 0.01)
    monkeypatch.setattr(hangup.os, "_exit", exits.append)
    # the UI exits by itself: the run is stopped with a checkpoint, nothing is forced
    app, source, run = Stub(True), Stub(True), Stub(True)
    guard = hangup.HangupGuard(app, source, run, stop_timeout=1.0)
    guard.finished.set()
    guard._stop_and_leave("SIGHUP", 129)
    assert app.calls == ["TerminalGone"] and source.calls == ["stop"]
    assert run.calls == ["unattended", ("request_stop", True, "SIGHUP")]   # nobody left to ask
    assert exits == []
    # a hung step and a stuck UI: flush what finished, then end the process (128 + SIGHUP)
    app, source, run = Stub(True), Stub(False), Stub(True)
    hangup.HangupGuard(app, source, run, stop_timeout=1.0)._stop_and_leave("SIGHUP", 129)
    assert run.calls == ["unattended", ("request_stop", True, "SIGHUP"), "close"] and exits == [129]
