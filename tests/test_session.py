"""The session file: strict JSON, non-finite encoding, tolerant reading, flushing."""

import json
import math

import pytest

from amp_tui import jsonsafe
from amp_tui.session import SessionFormatError, SessionWriter, event_record, read_session


def test_nonfinite_numbers_are_strings_a_strict_parser_accepts():
    record = {"loss": jsonsafe.encode_float(math.nan), "a": jsonsafe.encode_float(math.inf),
              "b": jsonsafe.encode_float(-math.inf), "c": jsonsafe.encode_float(1.5)}
    line = jsonsafe.dumps(record)
    assert line == '{"loss":"NaN","a":"Infinity","b":"-Infinity","c":1.5}'
    parsed = json.loads(line, parse_constant=lambda t: (_ for _ in ()).throw(ValueError(t)))
    assert math.isnan(jsonsafe.decode_float(parsed["loss"]))
    assert jsonsafe.decode_float(parsed["b"]) == -math.inf
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
