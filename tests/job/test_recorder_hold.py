"""The recorder holds every record made after a step whose record is not made yet (with several
ranks, its figures come from the other ranks a step later), and writes them behind it in order."""

from amp_tui.job.records.recorder import Recorder
from amp_tui.recording.format import event_record, step_record
from amp_tui.recording.reader import read_session

from support import step_result


def recorder(tmp_path):
    seen = []
    rec = Recorder(tmp_path / "session.jsonl", on_refused=lambda message, first: None)
    rec.observers.append(lambda record: seen.append((record["type"], record.get("step"), record.get("kind"))))
    rec.open({"layers": ["a", "b", "c"]}, append=False, flush_interval=0.0)   # every write flushed
    return rec, seen


def order(path):
    return [(r["type"], r.get("step"), r.get("kind")) for r in read_session(path).records]


def test_records_made_while_a_step_is_held_come_after_it_in_order(tmp_path):
    rec, seen = recorder(tmp_path)
    rec.emit(step_record(step_result(0)))
    rec.hold()
    rec.emit(event_record(2, "intervention", "dtype fp16 → bf16"))
    rec.keep(event_record(2, "error", "could not append", during="io"))
    rec.emit(event_record(2, "checkpoint_saved", "saved"))
    assert order(rec.path) == [("step", 0, None)]   # nothing of it reaches the file meanwhile
    assert seen == [("header", None, None), ("step", 0, None)]   # nor the observers
    rec.release(step_record(step_result(1)))
    expected = [("step", 0, None), ("step", 1, None), ("event", 2, "intervention"), ("event", 2, "error"),
                ("event", 2, "checkpoint_saved")]
    assert order(rec.path) == expected
    assert seen[1:] == expected and not rec.holding
    rec.emit(event_record(3, "paused", "paused"))   # not held any more
    rec.finish({"step": 3, "status": "finished"})
    assert order(rec.path)[-2:] == [("event", 3, "paused"), ("end", 3, None)]


def test_a_held_step_that_cannot_be_made_leaves_what_came_after_it(tmp_path):
    rec, _ = recorder(tmp_path)
    rec.hold()
    rec.emit(event_record(1, "intervention", "paused"))
    rec.release(None)   # its figures never came: the step goes unrecorded, the rest is written
    rec.hold()
    rec.emit(event_record(2, "error", "another rank is gone"))
    rec.finish({"step": 2, "status": "error"})   # the end never loses what was held
    assert order(rec.path) == [("event", 1, "intervention"), ("event", 2, "error"), ("end", 2, None)]
