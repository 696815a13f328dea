"""Hostile recordings: lines longer than the readers' limit, megabyte-long names and messages,
bare NaN/Infinity tokens (not JSON: the writer never writes them) and arrays nested thousands deep.

Every reader (read_session for `report`, the replay index for `replay` and `replay --headless`)
skips and counts what it can't take, never crashes, holds no over-long line in memory, and the
dashboard draws megabytes of text as a bounded amount."""

from __future__ import annotations

import re
import time
import tracemalloc

import pytest

from amp_tui.cli import main
from amp_tui.recording import index as index_mod
from amp_tui.recording import reader as session_mod
from amp_tui.recording.format import MAX_LINE_BYTES, SessionFormatError
from amp_tui.recording.index import TEXT_LIMIT, SessionIndex
from amp_tui.recording.reader import read_session
from amp_tui.recording.writer import SessionWriter
from amp_tui.sources.replay import ReplaySource
from amp_tui.ui.app import NOTIFY_LIMIT, create_app
from amp_tui.ui.widgets.event_log import MESSAGE_LIMIT

from support import SIZE, run_async, toasts, until, write_run

HUGE_BYTES = 50_000_000          # one line, three times the limit
LONG = 3_000_000                 # a layer name and messages megabytes long, under the limit
LONG_NAME = "L" * LONG + ".tail"
HEADER = {"dtype": "float16", "init_scale": 65536.0, "script": "train.py", "steps": 30,
          "device": {"type": "cpu", "backend": "CPU", "name": "Test"}}


def recording(tmp_path, *lines: bytes, layers=("embed", "block.0", "head")):
    """The 30-step run of test_replay (steps 0-29, an end record), `lines` inserted before the end."""
    path = tmp_path / "session.jsonl"
    path.unlink(missing_ok=True)
    write_run(path, writer=SessionWriter(path, {"layers": list(layers), **HEADER},
                                         flush_interval=0))
    recorded = path.read_bytes().split(b"\n")
    assert recorded[-1] == b"" and recorded[-2].startswith(b'{"type":"end"')
    path.write_bytes(b"\n".join([*recorded[:-2], *lines, recorded[-2], b""]))
    return path


def huge_line() -> bytes:
    """Valid JSON, an ordinary alert event, only far too long."""
    return (b'{"type":"event","step":12,"kind":"alert","message":"'
            + b"A" * HUGE_BYTES + b'"}')


def bare_token_lines(path) -> list[bytes]:
    """Records as a lenient writer would put them (Python's json.dumps does), strict JSON aside."""
    step = next(line for line in path.read_bytes().split(b"\n")
                if line.startswith(b'{"type":"step","step":28,'))
    assert b'"layers":{"act":[' in step           # a probed step: the index's fast-path shape
    return [
        re.sub(rb'"loss":[^,]+', b'"loss":NaN', step.replace(b'"step":28', b'"step":30')),
        re.sub(rb'"act":\[[^\]]*\]', b'"act":[Infinity,-Infinity,NaN]',
               step.replace(b'"step":28', b'"step":31')),
        re.sub(rb'"duration":[^,]+', b'"duration":Infinity', step.replace(b'"step":28', b'"step":32')),
        b'{"type":"event","step":31,"kind":"intervention","message":"x","value":-Infinity}',
        b'{"type":"event","step":31,"kind":"alert","message":"deep","x":'
        + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ]


def hostile(tmp_path):
    """All of it in one file: 6 lines refused (one of them over the limit), long texts kept."""
    path = recording(tmp_path, layers=("embed", LONG_NAME, "head"))
    lines = [
        huge_line(),
        b'{"type":"event","step":13,"kind":"alert","message":"HEAD-' + b"m" * LONG + b'-TAIL"}',
        b'{"type":"event","step":14,"kind":"error","during":"step","message":"ERR-'
        + b"e" * LONG + b'","traceback":"' + b"t" * LONG + b'"}',
        *bare_token_lines(path)]
    return recording(tmp_path, *lines, layers=("embed", LONG_NAME, "head"))


def peak_bytes(read) -> int:
    tracemalloc.start()
    try:
        read()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---- the readers --------------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [MAX_LINE_BYTES, 4 << 20], ids=["16 MiB", "4 MiB"])
def test_a_line_over_the_limit_is_skipped_and_counted_without_being_held(tmp_path, limit,
                                                                        monkeypatch):
    """What a reader holds grows with the limit, not with the line (a line is only known to be
    too long once the limit's worth of it was read)."""
    monkeypatch.setattr(session_mod, "MAX_LINE_BYTES", limit)
    monkeypatch.setattr(index_mod, "MAX_LINE_BYTES", limit)
    path = recording(tmp_path, huge_line())
    assert path.stat().st_size > HUGE_BYTES > 2.5 * MAX_LINE_BYTES
    bound = 2.5 * limit + (1 << 20)

    session = read_session(path)
    assert (session.skipped_lines, session.long_lines) == (1, 1)
    assert len(session.steps) == 30 and session.end["status"] == "finished"
    assert peak_bytes(lambda: read_session(path)) < bound

    index = SessionIndex(path)
    assert (index.damaged_lines, index.long_lines, index.frames) == (1, 1, 30)
    assert index.end["status"] == "finished"
    assert index.skipped_summary() == f"1 line over {limit >> 20} MiB skipped"
    assert peak_bytes(lambda: SessionIndex(path).close()) < bound
    index.close()


def test_following_a_file_while_an_over_long_line_is_written(tmp_path):
    path = recording(tmp_path)
    line = huge_line()
    index = SessionIndex(path, follow=True)
    with open(path, "ab") as fh:
        for start in range(0, len(line), 7_000_000):      # written in pieces, read in between
            fh.write(line[start:start + 7_000_000])
            fh.flush()
            index.refresh()
        fh.write(b'\n{"type":"event","step":30,"kind":"alert","message":"after"}\n')
    index.refresh()
    assert (index.damaged_lines, index.long_lines) == (1, 1)
    assert index.event(index.event_count - 1)["message"] == "after"
    index.close()


def test_a_header_line_over_the_limit_is_refused_with_a_message(tmp_path):
    path = tmp_path / "session.jsonl"
    path.write_bytes(b'{"type":"header","format":"amp-tui-session","version":1,"x":"'
                     + b"x" * (MAX_LINE_BYTES + 10) + b'"}\n')
    for read in (read_session, SessionIndex):
        with pytest.raises(SessionFormatError, match="first line is longer than 16 MiB"):
            read(path)


@pytest.mark.parametrize("path_taken", ["fast path", "full parse"])
def test_bare_nan_and_infinity_tokens_are_refused_and_counted(tmp_path, path_taken, monkeypatch):
    path = recording(tmp_path)
    path = recording(tmp_path, *bare_token_lines(path))
    session = read_session(path)
    assert session.skipped_lines == 5 and session.long_lines == 0
    assert [r["step"] for r in session.steps] == list(range(30))
    if path_taken == "full parse":
        monkeypatch.setattr(index_mod, "STEP_LINE", re.compile(rb"(?!)"))
    index = SessionIndex(path)
    assert (index.damaged_lines, index.frames, index.steps[-1]) == (5, 30, 29)
    assert index.skipped_summary() == "5 damaged lines skipped"
    assert all(index.read_step(frame) is not None for frame in range(index.frames))
    index.close()


def test_long_texts_are_kept_cut_in_the_middle(tmp_path):
    index = SessionIndex(hostile(tmp_path))
    name = index.layer_names[1]
    assert len(name) < TEXT_LIMIT + 100
    assert name.startswith("LLL") and name.endswith("L.tail") and "characters cut]" in name
    error = index.event(index.error_events[-1])
    assert error["message"].startswith("ERR-") and len(error["traceback"]) < TEXT_LIMIT + 100
    index.close()


# ---- report, replay --headless, the replay dashboard ---------------------------------------------

def test_report_of_a_hostile_recording_counts_what_it_skipped_and_prints_bounded_text(
        tmp_path, capsys):
    run_dir = hostile(tmp_path).parent
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert len(out) < 10_000
    assert re.search(r"unreadable records\s+6 damaged \(1 over 16 MiB\), 0 unknown", out), out
    assert "ERR-eee" in out and "more characters)" in out
    assert main(["report", str(run_dir), "--json"]) == 0
    assert '"long_lines": 1' in capsys.readouterr().out


def test_headless_replay_of_a_hostile_recording_prints_bounded_lines(tmp_path, capsys):
    started = time.monotonic()
    assert main(["replay", "--headless", str(hostile(tmp_path).parent)]) == 0
    assert time.monotonic() - started < 30
    out = capsys.readouterr().out
    assert len(out) < 10_000 and max(len(line) for line in out.splitlines()) <= 1000
    assert "5 damaged lines and 1 line over 16 MiB skipped" in out
    assert "HEAD-mmm" in out


@run_async
async def test_replay_dashboard_of_a_hostile_recording_draws_bounded_text(tmp_path):
    source = ReplaySource(hostile(tmp_path), autoplay=False)
    app = create_app(source)
    started = time.monotonic()
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        table = app.dashboard.layer_table          # the name: its start, …, its own end
        drawn = [table.render_line(y).text for y in range(1, 4)]
        assert any(re.search(r"LLL+…L*\.tail", line) for line in drawn), drawn
        await pilot.press("end")                   # every event: the long ones, the error
        await until(pilot, lambda: source.position == 29, "the last step")
        await pilot.pause(0.3)
        assert app.is_running and time.monotonic() - started < 30
        status = str(app.dashboard.query_one("#status").render())
        assert "5 damaged lines and 1 line over 16 MiB skipped" in status
        panel = str(app.dashboard.query_one("#error-text").render())
        assert panel.startswith("ERR-eee") and len(panel) < 3 * TEXT_LIMIT
        log = app.dashboard.event_log
        assert "HEAD-mmm" in "".join(strip.text for strip in log.lines)
        assert len(log.lines) < 2 * MESSAGE_LIMIT // 10     # not 3 MB of folded text
        assert len(toasts(app)) < 3 * (NOTIFY_LIMIT + 100)
        assert "ERR-eee" in toasts(app)
        svg = app.export_screenshot()
        assert len(svg) < 1_000_000
