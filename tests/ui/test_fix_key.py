"""f applies the fix the last non-finite step verified, through the same command a person would
type (fp32=MODULE, dtype=bf16); refused, with the reason, when there is none, twice, or in a
replay."""

from amp_tui.core.fixes import NO_FIX, fix_command, last_verified_fix
from amp_tui.core.records import nonfinite_layer
from amp_tui.recording.reader import read_session
from amp_tui.recording.report import read_digest, summarize
from amp_tui.sources.replay import ReplaySource
from amp_tui.ui import view
from amp_tui.ui.app import create_app
from amp_tui.ui.widgets.notice import PauseNotice, notice_text

from fixed_source import FixedSource, synthetic_records
from support import ATTENTION_SCRIPT, SIZE, build_live, notified, run_async, toasts, until


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
            assert run.controller.local_fp32.names == ["blocks.1.attn"]
            await pilot.press("f")
            await until(pilot, lambda: "already applied" in toasts(app), "the refusal")
            assert run.controller.local_fp32.names == ["blocks.1.attn"]
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


@run_async
async def test_the_pause_banner_and_the_highlighted_rows_name_the_ops_module_and_offer_f(write_script, tmp_path):
    """The softmax in blocks.1.attn's own code makes the NaN that its dropout and `o` are handed:
    the banner and the layer table name blocks.1.attn, as the event's op does, and the banner's
    keys offer f with the fix it applies."""
    run, source = build_live(write_script(ATTENTION_SCRIPT), tmp_path / "run", steps=3)
    app = create_app(source)
    said = notified(app)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            notice = app.dashboard.query_one(PauseNotice)
            await until(pilot, lambda: notice.has_class("-visible"), "the pause notice")
            [event] = [e for e in source.snapshot().events if e["kind"] == "nonfinite"]
            assert event["op_module"] == "blocks.1.attn" and event["fix_verified"] is True
            text = str(notice.render())
            assert "first non-finite layer: blocks.1.attn;" in text
            assert f"verified fix: {event['fix']}" in text and "f apply the fix" in text
            # the pause's toast offers it too (it listed d, s and r alone)
            await until(pilot, lambda: f"f applies {event['fix']}" in " ".join(said), "the pause's toast")
            table = app.dashboard.layer_table
            await until(pilot, lambda: table._origin == "blocks.1.attn", "the origin's rows")
            # the name cell marked as the origin's (non-finite figures have a red style of their own)
            marked = [row.name for i, row in enumerate(table._ordered)
                      if any(str(span.style) == "bold reverse red" and str(table.row_text(i))[span.start:span.end]
                             .strip() == row.name for span in table.row_text(i).spans)]
            assert marked and all(name.startswith("blocks.1.attn.") for name in marked), marked
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, "the app to exit")
    finally:
        source.stop(5.0)


def test_a_recording_whose_origin_was_handed_the_nan_shows_the_ops_module():
    """A session written before the origin was the op's module: the dashboard still names it."""
    event = {"kind": "nonfinite", "where": "loss", "layer": "blocks.0.attn.out", "origin": "blocks.0.attn.out",
             "origin_input_nonfinite": True, "op": "aten.bmm", "op_module": "blocks.0.attn"}
    assert nonfinite_layer(event) == "blocks.0.attn"
    assert nonfinite_layer({**event, "op_module": None}) == "blocks.0.attn.out"   # the loss: no module


def test_the_pause_notice_stops_offering_f_once_the_fix_is_in_force():
    records = synthetic_records(ending="nonfinite")
    cause = next(r for r in reversed(records) if r.get("kind") == "nonfinite")
    cause.update(fix="--fp32-modules 'h.4.mlp.c_fc'", fix_verified=True)
    offered = notice_text(view.nonfinite_pause(FixedSource(records).snapshot())).plain
    assert "verified fix: --fp32-modules 'h.4.mlp.c_fc'" in offered and "f apply the fix" in offered

    def fp32(step, modules):
        return {"type": "event", "step": step, "kind": "intervention", "action": "fp32",
                "value": "h.4.mlp.c_fc", "source": "dashboard", "message": "h.4.mlp.c_fc now in fp32",
                "before": {"fp32_modules": []}, "after": {"fp32_modules": modules}}

    applied = records + [fp32(400, ["h.4.mlp.c_fc"])]
    said = notice_text(view.nonfinite_pause(FixedSource(applied).snapshot())).plain
    assert "fix applied: --fp32-modules 'h.4.mlp.c_fc'" in said and "f apply" not in said
    assert said.splitlines()[1].startswith("space resume")
    # taken back (the palette's toggle): offered again
    undone = applied + [fp32(400, [])]
    assert "f apply the fix" in notice_text(view.nonfinite_pause(FixedSource(undone).snapshot())).plain
