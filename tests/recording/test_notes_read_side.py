"""A `note` event, read back: the replay's timeline, `amp-tui report` (text and JSON), the event
log's line, headless train's event line and the TensorBoard export show its text; `--as-at`
does not repeat it."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from amp_tui.cli import main
from amp_tui.cli.headless import HeadlessPrinter
from amp_tui.recording.reader import read_session
from amp_tui.recording.report import read_digest, summarize
from amp_tui.recording.timeline import interventions_as_at, timeline_lines
from amp_tui.sources.replay import ReplaySource
from amp_tui.ui.widgets.event_log import event_line

from support import write_run

NOTE = "changed the data shard: lr=3e-4 → 1e-4, données ✓"


def note_event(step: int, text: str, **fields) -> bytes:
    record = {"type": "event", "step": step, "kind": "note", "message": text, "time": 1006.0,
              "text": text, **fields}
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@pytest.fixture
def noted(tmp_path):
    """write_run's recording with two notes: one from ctl before step 12, one by hand before 27."""
    path = tmp_path / "session.jsonl"
    write_run(path)
    lines = path.read_bytes().split(b"\n")

    def before_step(step: int) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(b'{"type":"step","step":%d,' % step))
    lines.insert(before_step(12), note_event(12, NOTE, source="ctl pid=7 user=me"))
    lines.insert(before_step(27), note_event(27, "second"))
    path.write_bytes(b"\n".join(lines))
    return tmp_path


def test_the_timeline_shows_a_note_at_its_step_with_its_text(noted, capsys):
    lines = timeline_lines(noted)
    assert f"step 12: note: {NOTE} [ctl pid=7 user=me]" in lines
    assert "step 27: note: second" in lines
    assert "2 notes" in lines[-1]
    assert main(["replay", str(noted), "--headless"]) == 0
    assert f"step 12: note: {NOTE} [ctl pid=7 user=me]" in capsys.readouterr().out


def test_report_lists_the_notes_and_as_at_leaves_them_out(noted, capsys):
    assert main(["report", str(noted)]) == 0
    out = capsys.readouterr().out
    assert f"note at step 12: {NOTE}" in out and "note at step 27: second" in out
    assert main(["report", str(noted), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == [{"step": 12, "text": NOTE}, {"step": 27, "text": "second"}]
    # the one-pass digest reads them as the whole session does
    assert summarize(read_digest(noted)).as_json() == summarize(read_session(noted)).as_json()
    assert interventions_as_at(noted) == ["10:dtype=bf16", "26:resume"]


def test_a_note_without_its_text_field_reads_its_message(tmp_path):
    path = tmp_path / "session.jsonl"
    write_run(path)
    lines = path.read_bytes().split(b"\n")
    bare = {"type": "event", "step": 30, "kind": "note", "message": "from the message"}
    lines.insert(-2, json.dumps(bare).encode())
    path.write_bytes(b"\n".join(lines))
    assert summarize(read_digest(tmp_path)).notes == [{"step": 30, "text": "from the message"}]


def test_the_event_log_shows_the_note_once_labelled(noted):
    source = ReplaySource(noted, autoplay=False)
    source.end()
    note = next(e for e in source.snapshot().events if e.get("kind") == "note")
    row = event_line(note).columns
    assert [str(c._cells[0]) for c in row] == ["12", "note", NOTE]


def test_the_tensorboard_export_has_the_note_as_text_at_its_step(noted, tmp_path):
    assert main(["export", str(noted), "--tensorboard", str(tmp_path / "tb")]) == 0
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    written = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("events/note")}
    assert sorted(written) == [12, 27]
    assert written[12].splitlines()[0].strip() == NOTE.replace("_", "\\_")
    assert "source: ctl pid=7 user=me" in written[12] and written[27].strip() == "second"


def test_headless_prints_a_note_as_it_comes_once_labelled():
    out = io.StringIO()
    HeadlessPrinter(Console(file=out, width=200), None).print_event(json.loads(note_event(12, NOTE)))
    assert out.getvalue().split() == ["step", "12", "note", *NOTE.split()]
