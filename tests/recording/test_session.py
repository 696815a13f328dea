"""The session file: strict JSON, non-finite encoding, tolerant reading, flushing."""

import json
import math

import pytest

from amp_tui.core import jsonsafe
from amp_tui.recording.format import SessionFormatError, event_record
from amp_tui.recording.reader import read_session
from amp_tui.recording.writer import SessionWriter

from support import FullDisk


def test_nonfinite_numbers_are_strings_a_strict_parser_accepts():
    record = {"loss": jsonsafe.encode_float(math.nan), "a": jsonsafe.encode_float(math.inf),
              "b": jsonsafe.encode_float(-math.inf), "c": jsonsafe.encode_float(1.5)}
    line = jsonsafe.dumps(record)
    assert line == '{"loss":"NaN","a":"Infinity","b":"-Infinity","c":1.5}'
    parsed = json.loads(line, parse_constant=lambda t: (_ for _ in ()).throw(ValueError(t)))
    assert math.isnan(jsonsafe.read_float(parsed["loss"]))
    assert jsonsafe.read_float(parsed["b"]) == -math.inf
    with pytest.raises(ValueError):
        jsonsafe.dumps({"x": math.nan})  # a raw NaN never reaches the file
    with pytest.raises(ValueError):
        jsonsafe.loads('{"x": NaN}')


def write_session(path, records, header=None):
    w = SessionWriter(path, header or {"layers": ["a"]})
    for r in records:
        w.write(r)
    w.close({"status": "finished"})


def test_reader_tolerates_torn_garbage_and_unknown_records(tmp_path):
    path = tmp_path / "session.jsonl"
    write_session(path, [{"type": "step", "step": i, "loss": 1.0} for i in range(3)])
    text = path.read_text().splitlines()
    text.insert(2, "}}garbage{{")
    text.insert(3, '{"type": "future-thing", "x": 1}')
    text.append('{"type": "step", "step": 3, "lo')  # torn last line
    path.write_text("\n".join(text))
    s = read_session(path)
    assert [r["step"] for r in s.steps] == [0, 1, 2]
    assert s.skipped_lines == 2 and s.unknown_records == 1
    assert s.end["status"] == "finished"


def test_newer_version_and_foreign_files_get_a_clear_message(tmp_path):
    path = tmp_path / "session.jsonl"
    path.write_text('{"type":"header","format":"amp-tui-session","version":99}\n')
    with pytest.raises(SessionFormatError, match="newer amp-tui .*format 99"):
        read_session(path)
    path.write_text("hello\n")
    with pytest.raises(SessionFormatError, match="not an amp-tui session"):
        read_session(path)
    with pytest.raises(SessionFormatError, match="no session found"):
        read_session(tmp_path / "missing")


def test_events_are_flushed_at_once_and_steps_within_a_second(tmp_path):
    path = tmp_path / "session.jsonl"
    w = SessionWriter(path, {"layers": []}, flush_interval=3600)
    w.write({"type": "step", "step": 0})
    assert len(path.read_text().splitlines()) == 1  # header only: the step waits for the interval
    w.write(event_record(0, "intervention", "dtype fp16 → bf16"))
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["kind"] == "intervention"
    w.close()


def test_append_after_a_torn_line_starts_clean(tmp_path):
    path = tmp_path / "session.jsonl"
    write_session(path, [{"type": "step", "step": 0}])
    with open(path, "a") as fh:
        fh.write('{"type": "step", "st')  # a writer killed mid-line
    w = SessionWriter(path, {}, append=True)
    w.write({"type": "step", "step": 1})
    w.close()
    s = read_session(path)
    assert [r["step"] for r in s.steps] == [0, 1] and s.skipped_lines == 1




def test_a_full_disk_loses_no_record_and_tears_no_line(tmp_path, monkeypatch):
    """The records written while the disk was full reach the file, whole and in order, once it
    takes bytes again; the failed writes raise so the run can pause or stop."""
    import amp_tui.recording.writer as session_module
    disk = FullDisk()
    monkeypatch.setattr(session_module, "os", disk)
    path = tmp_path / "session.jsonl"
    writer = SessionWriter(path, {"layers": []})
    record = lambda i: {"type": "event", "step": i, "kind": "x", "message": "m" * 50}  # noqa: E731
    writer.write(record(0))
    disk.full, disk.room = True, 30          # record 1 fits in part only
    failures = 0
    for i in range(1, 4):
        try:
            writer.write(record(i))
        except OSError:
            failures += 1
    assert failures == 3 and writer.pending_bytes > 0
    assert not path.read_bytes().endswith(b"\n")          # a record is cut short on disk...
    disk.full = False                                    # ...until space is freed
    writer.write(record(4))
    writer.close({"step": 5})
    s = read_session(path)
    assert [e["step"] for e in s.events] == [0, 1, 2, 3, 4] and s.skipped_lines == 0
    assert s.end == {"type": "end", "step": 5}


def test_a_refused_end_stays_pending_once_and_abandon_counts_and_cuts_what_was_refused(
        tmp_path, monkeypatch):
    import amp_tui.recording.writer as session_module
    disk = FullDisk()
    monkeypatch.setattr(session_module, "os", disk)
    path = tmp_path / "session.jsonl"
    writer = SessionWriter(path, {"layers": []}, flush_interval=3600)
    for i in range(3):
        writer.write({"type": "step", "step": i})
    disk.full, disk.room = True, 20              # the first step goes in part
    for _ in range(2):                           # tried twice: the end record is kept once
        with pytest.raises(OSError):
            writer.finish({"step": 3, "status": "finished"})
    assert not writer.closed
    assert writer.pending_records() == {"step": 3, "end": 1}
    assert not path.read_bytes().endswith(b"\n")     # a record is cut short on disk
    assert writer.abandon() == {"step": 3, "end": 1}
    assert writer.closed and path.read_bytes().endswith(b"\n")   # ... and cut off again
    s = read_session(path)
    assert s.steps == [] and s.end is None and s.skipped_lines == 0


def test_a_refused_end_is_written_whole_once_space_is_freed(tmp_path, monkeypatch):
    import amp_tui.recording.writer as session_module
    disk = FullDisk()
    monkeypatch.setattr(session_module, "os", disk)
    path = tmp_path / "session.jsonl"
    writer = SessionWriter(path, {"layers": []}, flush_interval=3600)
    writer.write({"type": "step", "step": 0})
    disk.full, disk.room = True, 30
    with pytest.raises(OSError):
        writer.finish({"step": 1, "status": "finished"})
    disk.full = False
    writer.finish({"step": 1, "status": "finished"})
    s = read_session(path)
    assert [r["step"] for r in s.steps] == [0] and s.end["status"] == "finished"
    assert s.skipped_lines == 0 and len(s.records) == 2
