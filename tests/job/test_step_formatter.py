"""Step records made on a thread of their own: written in order with the events between them,
at the next drain, and the training thread never waits for them unless something must follow."""

import threading

import pytest

from amp_tui.job.recorder import Recorder
from amp_tui.recording.format import event_record, step_record
from amp_tui.recording.reader import read_session

from support import step_result


def order(path):
    return [(r["type"], r.get("step"), r.get("kind")) for r in read_session(path).records]


def recorder(tmp_path):
    seen = []
    rec = Recorder(tmp_path / "session.jsonl", on_refused=lambda message, first: None)
    rec.observers.append(lambda record: seen.append((record["type"], record.get("step"), record.get("kind"))))
    rec.open({"layers": ["a", "b", "c"]}, append=False, flush_interval=0.0)
    return rec, seen


def sent(rec, make, steps: int = 3) -> None:
    """Steps 0.. of a batch to `rec`, their records made by `make` on the formatter's thread."""
    rec._formatter.make = make
    for step in range(steps):
        rec.add_step(step_result(step))
    rec.send()


def test_records_are_made_off_the_training_thread_and_written_in_order(tmp_path):
    made_on = []

    def make(result):
        made_on.append(threading.current_thread().name)
        return step_record(result)
    rec, seen = recorder(tmp_path)
    sent(rec, make)
    rec.drain(flush=True)
    assert made_on == ["amp-tui-step-records"] * 3   # not the thread that trains
    assert order(rec.path) == [("step", 0, None), ("step", 1, None), ("step", 2, None)]
    assert seen[1:] == order(rec.path)
    rec.finish({"step": 3, "status": "finished"})
    assert not any(t.name == "amp-tui-step-records" for t in threading.enumerate())   # it ended


def test_an_event_raised_by_a_step_comes_right_after_that_step(tmp_path):
    """What a step raises (its non-finite event, a guard's alert) is recorded while the next
    steps of the batch are not made yet: it is written after its own step, before theirs."""
    made = []

    def make(result):
        made.append(result.step)
        return step_record(result)
    rec, _ = recorder(tmp_path)
    rec._formatter.make = make
    rec.add_step(step_result(0))
    rec.emit(event_record(0, "alert", "skips"))   # written at once: its step first
    assert order(rec.path) == [("step", 0, None), ("event", 0, "alert")]
    rec.add_step(step_result(1))
    rec.add_step(step_result(2))
    rec.send()
    rec.keep(event_record(2, "error", "could not append", during="io"))
    rec.finish({"step": 3, "status": "finished"})
    assert order(rec.path) == [("step", 0, None), ("event", 0, "alert"), ("step", 1, None), ("step", 2, None),
                               ("event", 2, "error"), ("end", 3, None)]
    assert made == [0, 1, 2]   # step 0, made for the event, was not sent to be made again


def test_a_drain_that_does_not_wait_writes_what_is_made(tmp_path):
    gate = threading.Event()

    def slow(result):
        if result.step == 1:
            gate.wait(10)
        return step_record(result)
    rec, _ = recorder(tmp_path)
    sent(rec, slow)
    while not rec._outbox[0].ready:   # step 0, made by the thread (which then waits at step 1)
        threading.Event().wait(0.001)
    rec.drain(wait=False, flush=True)
    assert order(rec.path) == [("step", 0, None)]   # step 1 is still being made: it, and 2, wait
    gate.set()
    rec.drain(flush=True)
    assert order(rec.path) == [("step", 0, None), ("step", 1, None), ("step", 2, None)]
    rec.finish({"step": 3, "status": "finished"})


def test_a_record_that_cannot_be_made_raises_on_the_training_thread(tmp_path):
    def broken(result):
        if result.step == 1:
            raise ValueError("a field that can't be written")
        return step_record(result)
    rec, _ = recorder(tmp_path)
    sent(rec, broken)
    with pytest.raises(ValueError, match="can't be written"):
        rec.drain()
    rec.drain()
    rec.finish({"step": 3, "status": "error"})
    assert order(rec.path) == [("step", 0, None), ("step", 2, None), ("end", 3, None)]
