"""Replay: the session index, the replay source (positions, playback, follow), the timeline and
the interventions as --at arguments, and the compact figure encoding."""

import json
import math

import pytest

from amp_tui.cli import main
from amp_tui.core.commands import parse_action
from amp_tui.core.text import one_line
from amp_tui.recording import index as index_mod
from amp_tui.recording.format import SessionFormatError, compact_figure, event_record, step_record
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.timeline import at_arguments, interventions_as_at, interventions_as_commands, timeline_lines
from amp_tui.sources.protocol import Snapshot
from amp_tui.sources.replay import ReplaySource

from support import LAYERS, OVERFLOW_SCRIPT, step_result, write_run


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now






@pytest.fixture
def recording(tmp_path):
    path = tmp_path / "session.jsonl"
    write_run(path)
    return path


# ---- the index --------------------------------------------------------------------------------

def test_index_reads_steps_events_and_end(recording):
    idx = SessionIndex(recording.parent)  # a run directory works too
    assert idx.frames == 30 and list(idx.steps) == list(range(30))
    assert idx.header["layers"] == LAYERS and idx.layer_names == LAYERS
    assert [idx.skipped_at(i) for i in (0, 2, 3, 25)] == [True, True, False, True]
    assert idx.scale_at(0) == 65536.0 and idx.scale_at(2) == 16384.0 and idx.scale_at(12) is None
    assert math.isnan(idx.loss_at(25)) and idx.loss_at(1) == pytest.approx(1.0)
    assert idx.dtype_at(9) == "float16" and idx.dtype_at(10) == "bfloat16"
    assert [idx.probed[i] for i in (0, 3, 4)] == [1, 0, 1]
    assert idx.end["status"] == "finished"
    kinds = [idx.event_kind(k) for k in range(idx.event_count)]
    assert kinds.count("nonfinite") == 4 and "intervention" in kinds and "paused" in kinds
    assert idx.damaged_lines == idx.unknown_records == 0 and idx.skipped_summary() is None
    assert idx.read_step(6)["layers"]["act"][0] == 7.5 and "layers" not in idx.read_step(7)


def test_fast_path_and_full_parse_agree(recording, monkeypatch):
    fast = SessionIndex(recording)
    monkeypatch.setattr(index_mod, "STEP_LINE", __import__("re").compile(rb"(?!)"))
    slow = SessionIndex(recording)
    for name in ("offsets", "lengths", "steps", "flags", "probed", "dtype_codes", "skipped_frames"):
        assert list(getattr(fast, name)) == list(getattr(slow, name)), name
    for name in ("loss", "scale", "times"):
        assert [repr(v) for v in getattr(fast, name)] == [repr(v) for v in getattr(slow, name)], name
    assert fast.dtypes == slow.dtypes and fast.records == slow.records


def test_torn_garbage_and_unknown_records_are_skipped_and_counted(recording):
    lines = recording.read_text().splitlines()
    lines.insert(5, "}}garbage{{")
    lines.insert(9, '{"type":"future-thing","x":1}')
    lines.insert(12, '{"type":"step","step":"not a number"}')
    text = "\n".join(lines) + "\n" + '{"type":"step","step":30,"lo'  # torn last line
    recording.write_text(text)
    idx = SessionIndex(recording)
    assert idx.frames == 30 and idx.damaged_lines == 2 and idx.unknown_records == 1 and idx.torn_tail
    assert idx.skipped_summary() == "2 damaged lines, 1 unknown record and an incomplete last line skipped"
    snap = ReplaySource(recording).snapshot()
    assert snap.notice == ("replay: 2 damaged lines, 1 unknown record and an incomplete last line "
                           "skipped")
    # Following, the last line may still be being written: not counted, not indexed, until done.
    follow = SessionIndex(recording, follow=True)
    assert follow.frames == 30 and not follow.torn_tail and follow.pending_bytes > 0
    with open(recording, "a") as fh:
        fh.write('ss":1.0}\n')
    assert follow.refresh() == 1 and follow.frames == 31 and follow.pending_bytes == 0


def test_a_complete_last_record_without_newline_is_read_when_not_following(recording):
    text = recording.read_text()
    recording.write_text(text.rstrip("\n"))   # the end record lost its newline
    assert SessionIndex(recording).end is not None
    assert SessionIndex(recording, follow=True).end is None


def test_newer_version_and_foreign_files_get_a_clear_message(tmp_path):
    path = tmp_path / "session.jsonl"
    path.write_text('{"type":"header","format":"amp-tui-session","version":99}\n')
    with pytest.raises(SessionFormatError, match="newer amp-tui .*format 99"):
        ReplaySource(path)
    path.write_text("hello\n")
    with pytest.raises(SessionFormatError, match="not an amp-tui session"):
        SessionIndex(path)
    path.write_text("")
    with pytest.raises(SessionFormatError, match="empty"):
        SessionIndex(path)
    with pytest.raises(SessionFormatError, match="no session found"):
        SessionIndex(tmp_path / "missing")


# ---- the source -------------------------------------------------------------------------------

def test_snapshot_at_positions_is_what_live_showed(recording):
    src = ReplaySource(recording, clock=Clock())
    assert src.mode == "replay" and src.total_steps == 30
    snap = src.snapshot()
    assert isinstance(snap, Snapshot) and snap.mode == "replay"
    assert snap.position == 0 and snap.last["step"] == 0 and snap.total_steps == 30
    assert snap.playback_state == "paused" and snap.state == "running" and snap.notice is None
    assert snap.layers.names == LAYERS and snap.layers.step == 0
    assert snap.events_seen == 1 and snap.events[0]["kind"] == "nonfinite"
    assert src.seek(9) == 9
    snap = src.snapshot()
    # The intervention before step 10 was applied (and shown live) right after step 9.
    assert snap.events[-1]["kind"] == "intervention" and snap.history.intervention_steps == [10]
    assert snap.history.steps == list(range(10)) and snap.history.skipped_steps == [0, 1, 2]
    assert snap.history.scale[:4] == [65536.0, 32768.0, 16384.0, 8192.0]
    src.seek(11)
    snap = src.snapshot()
    assert snap.history.scale[-1] is None and snap.last["dtype"] == "bfloat16"
    # Step 11 is not probed: the layer table shows step 10's figures.
    assert snap.layers.step == 10 and snap.layers.act == [11.5, 13580.0, 0.0001235]
    assert snap.layers.grad[1] == pytest.approx(3.3e-6) and snap.layers.grad[2] is None
    src.seek(25)
    snap = src.snapshot()
    assert math.isnan(snap.history.loss[-1]) and snap.layers.act[1] == math.inf
    # The run paused itself and was resumed before step 26: both were shown after step 25.
    assert [e["kind"] for e in snap.events[-3:]] == ["nonfinite", "paused", "intervention"]
    assert snap.state == "running"
    src.end()
    snap = src.snapshot()
    assert snap.position == 29 and snap.state == "finished" and snap.events_seen == 8
    assert snap.steps_per_second == pytest.approx(2.0)
    assert src.snapshot() is snap            # unchanged: the same object, the same version
    ok, message = src.send(parse_action("dtype=bf16"))
    assert not ok and message.startswith("replay: ")
    assert src.checkpoints() == []


def test_history_is_decimated_like_live(tmp_path):
    path = tmp_path / "session.jsonl"
    write_run(path, steps=40)
    src = ReplaySource(path, history_points=8)
    src.seek(39)
    h = src.snapshot().history
    assert h.stride == 8 and h.steps == [0, 8, 16, 24, 32] and len(h.loss) == len(h.scale) == 5


def test_playback_follows_elapsed_time_and_speed(recording):
    clock = Clock()
    src = ReplaySource(recording, clock=clock, speed=16)
    src.start()
    assert src.playing and src.snapshot().playback_state == "playing"
    clock.now += 0.25
    assert src.snapshot().position == 4           # 0.25 s x 16 steps/s
    assert src.faster() == 32 and src.slower() == 16 and src.slower() == 8
    clock.now += 0.0625                           # half a step: kept for later
    assert src.snapshot().position == 4
    clock.now += 0.0625
    assert src.snapshot().position == 5
    src.pause()
    clock.now += 10
    assert src.snapshot().position == 5 and src.snapshot().playback_state == "paused"
    src.play()
    clock.now += 100                              # a late tick jumps, and stops at the end
    snap = src.snapshot()
    assert snap.position == 29 and not snap.playing
    src.play()                                    # play at the end starts over
    assert src.position == 0 and src.playing
    for _ in range(20):
        src.faster()
    assert src.speed == 1024
    for _ in range(20):
        src.slower()
    assert src.speed == 1


def test_step_seek_home_end_and_event_navigation(recording):
    src = ReplaySource(recording, clock=Clock())
    src.start()
    assert src.step_by(1) == 1 and not src.playing
    assert src.step_by(-5) == 0 and src.step_by(100) == 29
    assert src.home() == 0 and src.end() == 29 and src.seek(12) == 12 and src.seek(-3) == 0
    # Events: storm at 0-2 (one stop), intervention at 10, checkpoint at 20, loss at 25, pause at 26.
    src.home()
    assert [src.next_event() for _ in range(5)] == [10, 20, 25, 26, None]
    assert [src.previous_event() for _ in range(4)] == [25, 20, 10, 0]
    assert src.previous_event() is None and src.position == 0


def test_a_record_that_cant_be_read_pauses_with_a_notice(recording):
    raw = recording.read_bytes()
    start = raw.index(b'{"type":"step","step":6,')
    broken = raw.index(b'"weight":[', start)
    recording.write_bytes(raw[:broken] + b'"weight":[1,,' + raw[broken + 10:])
    clock = Clock()
    src = ReplaySource(recording, clock=clock, speed=1)
    src.start()
    clock.now += 6.5
    snap = src.snapshot()
    assert snap.position == 6 and not snap.playing and snap.playback_state == "paused"
    assert "step 6 can't be read" in snap.notice and "paused" in snap.notice
    assert snap.last["step"] == 6 and snap.last["loss"] == pytest.approx(2 / 7)  # from the index
    assert snap.layers.step == 5                  # the newest figures that could be read
    src.play()                                    # playing on from there is allowed
    assert src.snapshot().playing and src.snapshot().position == 6
    clock.now += 1
    snap = src.snapshot()
    assert snap.position == 7 and snap.playing and snap.notice is None
    assert src.step_by(-1) == 6 and "step 6" in src.snapshot().notice


def test_follow_a_session_that_is_still_written(tmp_path):
    path = tmp_path / "session.jsonl"
    write_run(path, steps=5, end=False).close()
    writer = open(path, "a", encoding="utf-8")    # the run's writer, appending as it goes

    def write(record, end="\n"):
        writer.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + end)
        writer.flush()

    clock = Clock()
    src = ReplaySource(path, follow=True, clock=clock, refresh_interval=0.2)
    src.start()
    snap = src.snapshot()
    assert snap.position == 4 and snap.total_steps == 5 and snap.playback_state == "following"
    for step in range(5, 8):
        write(step_record(step_result(step, scale=1024.0)))
    line = json.dumps(step_record(step_result(8, scale=1024.0)), separators=(",", ":"))
    writer.write(line[:100])                      # a line the writer is in the middle of
    writer.flush()
    clock.now += 0.1
    assert src.snapshot().total_steps == 5        # not refreshed yet (at most every 0.2 s)
    clock.now += 0.2
    snap = src.snapshot()
    assert snap.total_steps == 8 and snap.position == 7 and snap.playback_state == "following"
    assert snap.notice is None                    # a half line while following is not damage
    writer.write(line[100:] + "\n")
    writer.flush()
    clock.now += 0.2
    snap = src.snapshot()
    assert snap.total_steps == 9 and snap.position == 8 and snap.last["step"] == 8
    src.seek(2)                                   # looking back: stays there as the file grows
    src.pause()
    write(step_record(step_result(9, scale=1024.0)))
    clock.now += 1
    snap = src.snapshot()
    assert snap.total_steps == 10 and snap.position == 2
    write({"type": "end", "step": 10, "status": "stopped"})
    writer.close()
    src.end()
    src.play()
    clock.now += 1
    snap = src.snapshot()
    assert snap.position == 9 and snap.state == "stopped" and snap.playback_state == "playing"
    src.stop()


# ---- timeline and --at ------------------------------------------------------------------------

def test_timeline_of_a_synthetic_run(recording):
    lines = timeline_lines(SessionIndex(recording))
    assert lines[0] == "train.py on CPU Test, fp16 (init_scale 65536), 30 steps recorded of 30"
    assert lines[1] == ("steps 0–2: 3 skipped updates in fp16 (gradient overflow ×3), "
                        "scale 65536 → 8192; first non-finite: head")
    assert lines[2] == "step 10: intervention: dtype fp16 → bf16 [at]"
    assert lines[3] == ("step 20: checkpoint checkpoints/step-0000020.safetensors saved "
                        "[checkpoint_every]")
    assert lines[4] == ("step 25: 1 skipped update in bf16 (non-finite loss ×1); "
                        "first non-finite: block.0")
    assert lines[5] == "step 26: paused after a non-finite loss"
    assert lines[6] == "step 26: intervention: resumed [key]"
    assert lines[-1] == ("summary: 30 steps, 26 updates applied, 4 skipped in 2 runs, "
                         "2 interventions, 1 checkpoint, final dtype bf16, scale none; ended: finished")
    assert interventions_as_at(recording) == ["10:dtype=bf16", "26:resume"]
    assert at_arguments(recording) == "--at 10:dtype=bf16 --at 26:resume"


def test_timeline_strips_control_characters(recording):
    with open(recording, "a") as fh:
        fh.write(json.dumps({"type": "event", "step": 30, "kind": "error", "during": "step",
                             "message": "boom \x1b[31mred\x1b[0m\x07\nnext [bold]x[/bold]"}) + "\n")
    line = [x for x in timeline_lines(recording) if x.startswith("step 30")][0]
    assert line == "step 30: error during step: boom red next [bold]x[/bold]"
    assert one_line("a\u202eb\x00c\td") == "abc d"


AT = ["3:scale=4096", "5:dtype=bf16", "6:save", "8:restore=checkpoints/step-0000006.safetensors",
      "9:pause", "9:resume", "10:dtype=fp16", "10:scale=half"]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay-run")
    script = tmp / "overflow.py"
    script.write_text(OVERFLOW_SCRIPT.replace("ACC", "1"))
    run_dir = tmp / "run"
    args = ["train", str(script), "--headless", "--steps", "12", "--run-dir", str(run_dir)]
    for at in AT:
        args += ["--at", at]
    assert main(args) == 0
    return run_dir


def test_timeline_of_a_real_run(real_run):
    lines = timeline_lines(real_run)
    assert lines[0].startswith("overflow.py on CPU") and "fp16 (init_scale 65536)" in lines[0]
    assert lines[0].endswith("12 steps recorded of 12")
    assert lines[1].startswith("steps 0–")
    assert "skipped updates in fp16 (GradScaler calibrating its scale ×4, gradient overflow" in lines[1]
    assert "scale 65536 → " in lines[1]
    body = "\n".join(lines)
    assert "step 5: intervention: dtype fp16 → bf16 [at]" in body
    assert "step 6: checkpoint checkpoints/step-0000006.safetensors saved at step 6" in body
    assert "step 8: restored checkpoints/step-0000006.safetensors (saved at step 6" in body
    assert "step 10: intervention: dtype bf16 → fp16" in body
    assert lines[-1].startswith("summary: 12 steps, ") and lines[-1].endswith("ended: finished")
    assert all("\x1b" not in line for line in lines)


def test_interventions_as_at_round_trip(real_run):
    assert interventions_as_at(real_run) == AT
    pairs = interventions_as_commands(real_run)
    assert [(s, c.action, c.value, c.source) for s, c in pairs][:3] == [
        (3, "scale", 4096.0, "repeat"), (5, "dtype", "bfloat16", "repeat"), (6, "save", None, "repeat")]
    assert len(pairs) == len(AT)


def test_replay_of_a_real_run_reaches_the_end(real_run):
    src = ReplaySource(real_run)
    src.end()
    snap = src.snapshot()
    assert snap.position == 11 and snap.state == "finished" and snap.notice is None
    assert snap.layers.names == snap.header["layers"] and snap.layers.step == 11
    assert [c.step for c in src.checkpoints()] == [6]


# ---- compact figures ----------------------------------------------------------------------------

def test_compact_figures_are_short_strict_numbers():
    assert [compact_figure(x) for x in (1234.5678, 65504.0, 0.000123456, 0.5, 7.0, 123456.7)] == \
        [1235, 65504, 0.0001235, 0.5, 7, 123500]
    assert json.dumps(compact_figure(0.0)) == "0" and json.dumps(compact_figure(-0.0)) == "-0.0"
    assert [compact_figure(x) for x in (math.nan, math.inf, -math.inf, None)] == \
        ["NaN", "Infinity", "-Infinity", None]
    record = step_record(step_result(3))
    assert record["layers"]["act"] == [4.5, 4938, 0.0001235]
    line = json.dumps(record, allow_nan=False, separators=(",", ":"))
    assert '"act":[4.5,4938,0.0001235]' in line


def test_crlf_lines_and_foreign_field_order_are_read_in_full(recording):
    text = recording.read_text().replace("\n", "\r\n")
    text += json.dumps({"type": "step", "loss": 1.0, "step": 30, "dtype": "float32"}) + "\r\n"
    recording.write_text(text, newline="")
    idx = SessionIndex(recording)
    assert idx.frames == 31 and idx.damaged_lines == 0 and idx.dtype_at(30) == "float32"
    assert idx.read_step(5)["step"] == 5 and idx.scale_at(30) is None


def test_as_at_skips_automatic_interventions_and_keeps_fp32(recording):
    with open(recording, "a") as fh:
        for record in (
            event_record(30, "intervention", "fallback fp16 → bf16", action="dtype", value="bfloat16",
                         source="fallback", after={"dtype": "bfloat16"}),
            event_record(30, "intervention", "blocks.0 now in fp32", action="fp32", value="blocks.*",
                         source="key", after={}),
            event_record(31, "checkpoint_restored", "restored", path="checkpoints/a b.safetensors",
                         source="key", after={"dtype": "float16"}),
        ):
            fh.write(json.dumps(record) + "\n")
    assert interventions_as_at(recording)[-2:] == ["30:fp32=blocks.*",
                                                   "31:restore=checkpoints/a b.safetensors"]
    assert at_arguments(recording).endswith(
        "--at '30:fp32=blocks.*' --at '31:restore=checkpoints/a b.safetensors'")


def test_a_frame_that_fails_to_render_pauses_instead_of_raising(recording, monkeypatch):
    clock = Clock()
    src = ReplaySource(recording, clock=clock)
    src.start()
    before = src.snapshot()
    monkeypatch.setattr(src, "_history", lambda *a: 1 / 0)
    clock.now += 1
    snap = src.snapshot()
    assert not snap.playing and "can't be shown (ZeroDivisionError" in snap.notice
    assert snap.position == src.position != before.position and snap.history == before.history
