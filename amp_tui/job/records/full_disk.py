"""What a run does when the disk refuses a write (a full disk, a quota): the records wait in the
writer; a watched run pauses until space is freed, a headless one stops, the user's own loop goes
on; and at the end the last flush is tried again until it is written or the records are given up,
counted and said."""

from __future__ import annotations

import sys
import threading
import time

from amp_tui.core.commands import Command, Outcome
from amp_tui.job.run_context import RunContext
from amp_tui.job.states import EXIT_ERROR, IoPolicy, PauseReason
from amp_tui.recording.format import event_record


def describe_records(counts: dict[str, int]) -> str:
    # The read side's report module (the words are its own), imported only once the disk has
    # refused a write: a run starts without it.
    from amp_tui.recording.report import describe_records
    return describe_records(counts)


class FullDisk:
    """A run's answer to a disk that refuses its writes (on the training thread; `ending` and
    `ended` tell another thread's `close` whether the training thread is writing the end)."""

    def __init__(self, run: RunContext):
        self.run = run
        self.last_refusal: str | None = None      # the last write the disk refused
        self._said = False                        # CARRY_ON: the refusal was said once
        self._stop_replies: list[Command] = []    # ctl stops answered once the end is tried
        self.ending = threading.Event()           # the training thread is writing the end
        self.ended = threading.Event()            # the end is written, or given up

    def waits_for_space(self) -> bool:
        """A full disk pauses the run (someone watching can free space), or stops it."""
        return self.run.io_policy is IoPolicy.PAUSE and not self.run.give_up_unwritten

    def on_refused(self, message: str, first: bool = True) -> None:
        """The session can't be appended to: say so, then halt (or, in the user's own loop, go
        on). The records stay pending in the writer and reach the file once it takes them again."""
        run = self.run
        if run.io_policy is IoPolicy.CARRY_ON:
            if first and not self._said:
                self._said = True
                say(f"{message}; the records are kept and written once space is freed")
            run.recorder.keep(event_record(run.step_index, "error", message, during="io"))
            return
        if not first and (run.state == "paused" or run.stop_requested.is_set()):
            return  # already reported; the run is paused or stopping
        run.recorder.keep(event_record(run.step_index, "error", message, during="io"))
        self._halt(message)

    def _halt(self, message: str) -> None:
        """Keep what is written; pause (dashboard) or stop with a non-zero status (headless)."""
        run = self.run
        run.error = self.last_refusal = message
        if self.waits_for_space():
            run.single_steps = 0
            run.pause_reason = PauseReason.IO
            run.set_state("paused")
            run.event("paused", "paused: the disk refused a write; free some space, then resume "
                      "(the records kept meanwhile are written then)", reason="io")
        else:
            run.exit_status = EXIT_ERROR
            run.ask_stop()

    def checkpoint_refused(self, source: str, message: str) -> None:
        """A checkpoint the disk refused: saved again once the user frees space and resumes (the
        user's own loop goes on: the event says it)."""
        if self.run.io_policy is IoPolicy.CARRY_ON:
            say(message)
            return
        if self.waits_for_space():
            self.run.checkpoint_due = source
        self._halt(message)

    # ---- the end record -------------------------------------------------------------------
    def finish(self, status: str, *, on_training_thread: bool) -> None:
        """Write the end record. Only the training thread may wait for space (others can't block)."""
        if on_training_thread:
            self.ending.set()
        try:
            self._write_end(status, on_training_thread)
        finally:
            self.ended.set()

    def _end_record(self, status: str) -> dict:
        run, t = self.run, self.run.training
        return {"step": run.step_index, "status": status, "updates": t.updates_applied,
                "skipped_total": t.skipped_total, "dtype": t.dtype, "scale": run.precision.scale,
                "time": round(time.time(), 3), "exit_status": run.exit_status}

    def _write_end(self, status: str, waiting_allowed: bool) -> None:
        run = self.run
        while True:
            try:
                run.recorder.finish(self._end_record(status))
                break
            except OSError as exc:
                why = f"{exc.strerror or exc}: {run.session_path}"
                if not (waiting_allowed and self.waits_for_space()):
                    self._give_up(status, why)
                    return
                self.on_refused(f"could not write the end of {run.session_path}: "
                                f"{exc.strerror or exc}")   # each try at the end is reported
                self._wait_for_space(why)
        if run.error is not None and run.error == self.last_refusal and run.checkpoint_due is None:
            run.error = None   # the disk took everything in the end: nothing was lost
        run.set_state(status)
        self._answer_stops(Outcome(True, "stopped; every record is written"))

    def _answer_stops(self, outcome: Outcome) -> None:
        replies, self._stop_replies = self._stop_replies, []
        for command in replies:
            if command.on_done is not None:
                command.on_done(outcome)

    def _wait_for_space(self, why: str) -> None:
        """Paused after the last flush failed: return to try it again once the user resumes,
        single-steps or stops. A stop while the records still can't be written is held once and
        `stop_held` set, so whoever asked can say what would be lost; a second stop (with
        `give_up_unwritten`) tries once more and then ends without them."""
        run = self.run
        if run.stop_requested.is_set() and not run.give_up_unwritten:
            run.stop_requested.clear()
            run.held_message = (f"{describe_records(run.pending_records())} would be lost "
                                f"({why}). Free some space and stop again to write them; "
                                "stopping again without freeing any ends the run without them")
            run.stop_held.set()
            self._answer_stops(Outcome(False, run.held_message))
        while True:
            for command in run.commands.drain():
                if command.action == "stop":
                    # A second stop while one is held gives the records up if they still
                    # don't fit; either way it is answered once the last flush was tried.
                    if run.stop_held.is_set():
                        run.give_up_unwritten = True
                    run.intervention(command, {"state": run.state}, {"state": "stopped"},
                                     "stop requested")
                    self._stop_replies.append(command)
                    run.stop_requested.set()
                elif command.action in ("resume", "step", "pause"):
                    run.apply(command)
                elif command.on_done is not None:
                    command.on_done(Outcome(False, f"{command.text()} refused: the run has ended "
                                                   f"and its last records wait for the disk ({why})"))
            if run.state == "running" or run.single_steps or run.stop_requested.is_set():
                run.single_steps = 0
                run.pause_reason = None
                return
            run.commands.wait(0.25)

    def _give_up(self, status: str, why: str) -> None:
        """End without what the disk refused: counted, said, and a non-zero exit status."""
        run = self.run
        run.recording_error = why
        run.error = run.error or why
        run.exit_status = run.exit_status or EXIT_ERROR
        run.set_state(status)
        run.unwritten = run.recorder.give_up(self._end_record(status))
        if run.io_policy is IoPolicy.CARRY_ON:   # nobody else tells the user's loop
            say(f"error: {why}: {describe_records(run.unwritten)} could not be written")
        self._answer_stops(Outcome(True, f"stopped without {describe_records(run.unwritten)} "
                                         f"({why})"))


def say(message: str) -> None:
    print(f"amp-tui: {message}", file=sys.stderr, flush=True)
