"""One run, however its steps are driven: the state, the step boundary, the commands, every record,
the checkpoints, the control socket; a disk that refuses writes is job/records/full_disk.py's.

Two drivers run the steps (docs/architecture.md, "One step, two drivers"):
- the engine driver (job/drivers/engine_driver.py, `amp-tui train`): amp-tui's own guarded step over the
  script's batches, the loop amp-tui owns;
- the hook driver (job/drivers/hook_driver.py, `amp_tui.monitor` and the framework callbacks): the user's
  loop, seen through hooks on its optimizer and GradScaler.

The controller knows neither loop. A driver hands it each step's `StepResult` (`end_step`, the one
end of a step) and calls `boundary()` between steps, where the queued and `--at` commands apply, a pause holds and a
stop ends the run. A command is one handler in `_handlers`, whatever runs the steps.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from amp_tui.core.commands import Command, Outcome
from amp_tui.core.fixes import fix_in_words
from amp_tui.core.policies import NonfinitePolicy
from amp_tui.core.records import RunState, end_status, traced_module
from amp_tui.job.checkpoints.run_checkpoints import RunCheckpoints, TrainingState
from amp_tui.job.drivers.driver import Driver
from amp_tui.job.records.forecasts import RunForecasts
from amp_tui.job.records.full_disk import FullDisk
from amp_tui.job.records.probe_budget import ProbeBudget
from amp_tui.job.records.probe_events import announce_probe_changes
from amp_tui.job.records.recorder import Observers, RankEcho, Recorder
from amp_tui.job.records.run_records import record_replays, session_header, status_snapshot
from amp_tui.job.states import EXIT_ERROR, EXIT_OK, TRAIN_LOOP, IoPolicy, LoopKind, PauseReason
from amp_tui.job.steering import autopilot
from amp_tui.job.steering import command_handlers as handlers
from amp_tui.job.steering.commands import CommandQueue, apply_command
from amp_tui.job.steering.fix_choice import VerifiedFixes
from amp_tui.job.steering.fp8_schedule import Fp8Schedule
from amp_tui.job.steering.trouble import TroubleResponse
from amp_tui.recording.format import event_record, step_record
from amp_tui.training import checkpoint as ckpt
from amp_tui.training.local_fp32 import LocalFp32
from amp_tui.training.step.autocast import unsupported_reason
from amp_tui.training.step.engine import StepResult
from amp_tui.training.step.guards import GuardConfig, PrecisionGuard

if TYPE_CHECKING:
    from amp_tui.job.ranks.distributed import Ranks
    from amp_tui.recording.report import RunOutcome

ENDING_WAIT_S = 5.0   # how long another thread waits for the training thread to end the file
# Seconds: the most a batched step waits to be recorded (record_step). The first record of a
# batch finds the code that makes it cold from the training step; at 0.25 s, a 9 ms step pays
# 24 µs for its record where 0.1 s made it 31 (the live dashboard lags by at most this).
PUBLISH_INTERVAL = 0.25


class RunController:
    """The run around a driver's steps (see the module docstring). Thread-safe from outside:
    `submit`, `request_stop`, `status`, `checkpoints`; everything else on the training thread."""

    fsdp_checkpoint = "auto"   # how checkpoints write a sharded model (`Run`: --fsdp-checkpoint)

    def __init__(self, driver: Driver, *, device: torch.device, run_dir: Path, script: Path,
                 ranks: Ranks | None = None, guard: GuardConfig | None = None, on_nonfinite: NonfinitePolicy = "skip",
                 io_policy: IoPolicy = IoPolicy.STOP, checkpoint_every: int | None = None,
                 at: list[tuple[int, Command]] = (), steps: int | None = None, flush_interval: float = 1.0,
                 control: bool = False, echo: Callable[[str], None] | None = None, loop: LoopKind = TRAIN_LOOP):
        self.driver = driver
        self.loop = loop
        if (schedule := self._schedule) is not None:   # figures of a module in fp32 count to fp32's max
            # Not the driver: a cycle through it kept a DDP model's group (gloo's threads) to the end.
            local = driver.local_fp32
            schedule.fp32_modules = lambda: local.names
        self.device = device
        self.run_dir = Path(run_dir)
        self.session_path = self.run_dir / "session.jsonl"
        self.script = script
        self.ranks = ranks   # several ranks (job/ranks/distributed.py): what they agree on goes through it
        self.guard = PrecisionGuard(guard or GuardConfig(), words=self.fix_words)
        self.autopilot = autopilot.Autopilot(self, on_nonfinite == "isolate", self.guard.config)
        self.forecasts = RunForecasts(self, self.guard.config.forecast_horizon)   # job/records/forecasts.py
        self.on_nonfinite = on_nonfinite
        self.io_policy = io_policy
        self.checkpoint_every = checkpoint_every
        self.steps = steps
        self.flush_interval = flush_interval
        self.serve_control = control
        self.state: RunState = "starting"
        self.exit_status = EXIT_OK
        self.error: str | None = None
        self.last_result: StepResult | None = None
        self.nonfinite_events = 0
        main = not ranks or ranks.is_main
        self.full_disk = FullDisk(self)
        self.recorder = (Recorder(self.session_path, on_refused=self.full_disk.on_refused) if main
                         else RankEcho(self.session_path, prefix=ranks.describe(), echo=echo))
        self.checkpointing = RunCheckpoints(self)
        self.commands = CommandQueue()
        self._handlers = handlers.table(self, stop=self._stop, fix=self._apply_fix, undo=partial(autopilot.undo, self))
        self.fixes = VerifiedFixes(self.refused)   # what `fix` applies (job/steering/fix_choice.py)
        self._scheduled: dict[int, list[Command]] = {}   # --at's commands, by the step they wait for
        for step, command in at:
            self._scheduled.setdefault(step, []).append(command)
        self.trouble = TroubleResponse(self, bf16_ok=unsupported_reason(device, "bfloat16") is None)
        self._unpublished: list[StepResult] = []   # measured, not yet recorded (record_step)
        self._published_at = time.monotonic()
        self.budget = ProbeBudget(self._schedule, told=not ranks)   # job/records/probe_budget.py
        options = driver.probe_options   # the what-if runs with one process only
        self.fp8_schedule = Fp8Schedule(None if ranks else options.fp8_every, options.budget)
        self.single_steps = 0
        self.pause_reason: PauseReason | None = None
        self._stopping_state()
        self._control = None
        self.training_thread: threading.Thread | None = None   # the thread that runs the steps
        self.started_at = time.time()

    def _stopping_state(self) -> None:
        """How the run stops: asked, held by a full disk, or giving records up."""
        self.should_stop = False                    # the run stops at this boundary (stopping ran)
        self.stop_requested = threading.Event()
        self._checkpoint_on_stop = False
        self._stop_reason: str | None = None
        self.checkpoint_due: str | None = None   # the source of a save the disk refused
        self.give_up_unwritten = False           # quit even if the recording can't be completed
        # Set when a stop was held because records could not be written (a full disk): whoever
        # asked is told how many would be lost and may ask again to give them up.
        self.stop_held = threading.Event()
        self.held_message: str | None = None      # what the held stop would have lost
        self.unwritten: dict[str, int] = {}       # records given up at the end, by type
        self.recording_error: str | None = None   # why they were: the OS's words and the path

    # ---- what the driver holds ------------------------------------------------------------
    @property
    def training(self) -> TrainingState:
        return self.driver.training

    @property
    def precision(self):
        return self.training.precision

    @property
    def local_fp32(self) -> LocalFp32:
        return self.driver.local_fp32

    @property
    def step_index(self) -> int:
        """The index of the next step (`Run.step`; a monitor's `step()` is the loop's block)."""
        return self.training.step_index

    @property
    def _schedule(self):
        """The driver's probe schedule, told what recording the steps costs."""
        return self.driver.probe_schedule

    @property
    def observers(self) -> Observers:
        return self.recorder.observers

    # ---- public, thread-safe ------------------------------------------------------------
    def submit(self, command: Command) -> None:
        self.commands.submit(command)

    def request_stop(self, *, checkpoint: bool = False, reason: str | None = None,
                     give_up_unwritten: bool = False) -> None:
        """Stop at the next step boundary (from any thread, e.g. a signal handler); with
        `checkpoint`, save one first (an SSH drop must not lose the run's progress).

        Records that a full disk refused are written before the run ends; where the disk still
        refuses them, a watched run (the dashboard) holds the stop and sets `stop_held`, so the
        user can free space or confirm. `give_up_unwritten` confirms: the run ends without them,
        and says how many were lost."""
        if give_up_unwritten:
            self.give_up_unwritten = True
        self.stop_held.clear()
        self.ask_stop(checkpoint=checkpoint, reason=reason)
        self.commands.wakeup.set()

    def ask_stop(self, *, checkpoint: bool = False, reason: str | None = None) -> None:
        if self.ranks and self.ranks.voting:   # every rank stops at the boundary that agrees on it
            self.ranks.vote_stop(checkpoint=checkpoint, reason=reason)
            return
        if checkpoint:
            self._checkpoint_on_stop = True
        if reason and self._stop_reason is None:
            self._stop_reason = reason
        self.stop_requested.set()

    def watched(self) -> None:
        """Someone watches the run (the dashboard): a full disk pauses it, to be resumed once
        space is freed, instead of stopping it as headless does."""
        self.io_policy = IoPolicy.PAUSE

    def unattended(self) -> None:
        """Nobody is watching any more (the terminal is gone): a full disk stops the run as in
        headless mode instead of pausing it for a user who can't answer."""
        self.io_policy = IoPolicy.STOP
        self.give_up_unwritten = True

    def checkpoints(self) -> list[ckpt.CheckpointInfo]:
        return self.checkpointing.list()

    def saved_extra(self) -> dict:
        return self.driver.saved_extra()

    def status(self) -> dict:
        """A snapshot for `amp-tui ctl RUN status` (read from another thread: plain values only)."""
        return status_snapshot(self, pid=os.getpid())

    def outcome(self) -> RunOutcome:
        # The read side's report module, imported when the run's summary needs it: not before
        # the first step.
        from amp_tui.recording.report import RunOutcome
        return RunOutcome(state=self.state, steps=self.step_index, unwritten=dict(self.unwritten),
                          recording_error=self.recording_error)

    def pending_records(self) -> dict[str, int]:
        """Records the disk has refused so far and that are still kept, by type."""
        return self.recorder.pending_records()

    # ---- recording ----------------------------------------------------------------------
    def header(self) -> dict:
        return session_header(self, self.driver.description())

    def open_recording(self, header: dict, *, append: bool = False) -> None:
        """Create the run directory and the session (or append to it), then the control socket."""
        if not self.ranks or self.ranks.is_main:
            self.checkpointing.folder.mkdir(parents=True, exist_ok=True)
            ckpt.cleanup_temporary_files(self.checkpointing.folder)
        self.recorder.open(header, append=append, flush_interval=self.flush_interval)
        if self.serve_control:
            from amp_tui.job.steering.control import ControlServer
            self._control = ControlServer(self, self.run_dir)
            self._control.start()

    def event(self, kind: str, message: str, *, step: int | None = None, **fields: Any) -> dict:
        self.publish()   # the steps before it first, in the order they happened
        record = event_record(self.step_index if step is None else step, kind, message, **fields)
        self.recorder.emit(record)
        self.fixes.seen(record)
        return record

    def fix_words(self, fix: str) -> str:
        """A fix flag (`--dtype bf16`) as this way of running takes it."""
        return fix_in_words(fix, self.loop.way, str(self.run_dir))

    def alert(self, reason: str, message: str, *, cause: str, fix: str, step: int | None = None) -> dict:
        """An alert in the recording: what was seen, its likely cause and the fix, in one text."""
        return self.event("alert", f"{message}. Likely cause: {cause}. Fix: {fix}", step=step,
                          reason=reason, cause=cause, fix=fix)

    def set_state(self, state: RunState) -> None:
        self.state = state

    def end_step(self, result: StepResult, *, since: float, apart: float, held: bool = False,
                 batched: bool = True, boundary: Callable[[], object] | None = None) -> None:
        """The end of every step, for either driver, in this order: the step recorded (`held`:
        kept back until every rank's figures are in, for the driver's `settle()` to record), its
        X-ray, the probe schedule's changes, what the driver alone can tell, a checkpoint every N
        steps, the driver's `boundary` where the step's end is one (the user's loop: it decides
        when the next step starts), and last the run's own work on the step, told to the probe
        budget: from `since`, less what `budget.apart_seconds` counted from `apart` on. A new per-step
        effect goes here, once, for both drivers."""
        if held:
            self.last_result = result
            self.recorder.hold()
            self.after_step(result)   # what decides from the step uses what the ranks agreed on
        else:
            self.record_step(result, batched=batched)
        record_replays(self, result)   # the X-ray and the fp8 what-if asked of the step
        self.fp8_schedule.observe(result)
        announce_probe_changes(self, step=result.step + 1)
        for alert in self.driver.news(result):
            self.alert(alert.reason, alert.message, cause=alert.cause, fix=alert.fix, step=result.step)
        self.after_update()
        if boundary is not None:
            boundary()
        self.budget.own_work_done(since, apart)

    def record_step(self, result: StepResult, *, batched: bool = False) -> None:
        """Record a step, then what it raises (a non-finite event, the guards' alerts and moves).
        `batched`: formatted a few steps at a time (at most PUBLISH_INTERVAL late, at once when
        non-finite): formatting a run of records together costs a fraction of doing it between
        every two steps, when the training step has left the caches cold."""
        self.last_result = result
        if (traced := traced_module(result.op_trace)) is not None:
            # Where the op replay found the op, the event, the guards' alerts and the dashboard
            # name its module (a module after it may have been the first to hold the inf/NaN).
            result.first_nonfinite_layer = traced
        self._unpublished.append(result)
        if result.figures is None:
            self.forecasts.observe(result)   # before it is recorded: its ETAs go in its record
        else:   # a probed step's forecasts (the trend fits) are probing's cost
            started = time.perf_counter()
            self.forecasts.observe(result)
            self.budget.probed(time.perf_counter() - started)
        if not batched or result.nonfinite is not None or self.state == "paused" \
                or time.monotonic() - self._published_at >= PUBLISH_INTERVAL:
            self.publish()

    def publish(self, *, flush: bool = False) -> None:
        """Record the steps measured since the last call, each followed by what it raises, on the
        training thread: made in a batch, the records find the code that makes them warm. (Made on
        a thread of their own instead, they cost the steps more than they saved: every GIL handover
        at a torch op's boundary slowed the next step.) `flush`: in the file now."""
        results, self._unpublished = self._unpublished, []
        if not results:
            return
        self._published_at, started = time.monotonic(), time.perf_counter()
        last = len(results) - 1
        for i, result in enumerate(results):
            # A step while paused: no later record comes to push it to the file, where `ctl`,
            # `attach` and `replay --follow` look for it.
            self.recorder.emit(step_record(result), flush=self.state == "paused" or (flush and i == last))
            self.after_step(result)
        self.budget.published(time.perf_counter() - started, len(results))

    def after_step(self, result: StepResult) -> None:
        """What a recorded step raises (job/steering/trouble.py)."""
        self.trouble.after_step(result)

    def fail(self, message: str, original: BaseException | None, *, step: int | None = None) -> None:
        """The run ends in error: `message`, with `original`'s traceback (none: the message is
        amp-tui's own wording, and the frames would be ours, not the user's)."""
        tb = "" if original is None else "".join(
            traceback.format_exception(type(original), original, original.__traceback__))
        self.error = message
        self.exit_status = EXIT_ERROR
        self.set_state("error")
        self.event("error", message, step=step, during="step", traceback=tb[-20000:])

    # ---- the step boundary ----------------------------------------------------------------
    def boundary(self, *, hold: bool = True, finished: Callable[[], bool] | None = None) -> bool:
        """Between two steps: apply what was asked; while paused (and `hold`), wait here until
        resumed, single-stepped or stopped. False: the run ends here (stopped, or `finished`)."""
        if (finished is None and not self.ranks and self.commands.idle() and self.checkpoint_due is None
                and not self.single_steps and not (hold and self.state == "paused")
                and not self.stop_requested.is_set() and self.step_index not in self._scheduled):
            return True   # nothing asked, nothing to hold for: every step passes here, and at once
        with self.budget.held():   # a pause, a command: not what every step costs
            return self._boundary_at_work(hold, finished)

    def _boundary_at_work(self, hold: bool, finished: Callable[[], bool] | None) -> bool:
        """`boundary` with something to do: the commands, a pause held, a stop."""
        while True:
            for command in self._boundary_commands():
                self.apply(command)
            if self.stop_requested.is_set():
                self._stopping()
                return False
            if self.checkpoint_due is not None and self.state == "running":
                # A save the disk refused, tried again first once the user resumed.
                self.save_checkpoint(source=self.checkpoint_due)
                continue
            if finished is not None and finished() and self.pause_reason is not PauseReason.IO:
                self.set_state("finished")
                return False
            if not hold or self.state != "paused" or self.single_steps:
                break
            self.driver.settle(flush=True)   # the paused dashboard, ctl and attach show the last step
            if self.ranks:
                self.ranks.hold(self.commands)   # the next boundary is the heartbeat
            else:
                self.commands.wait(0.25)
        if hold and self.single_steps:
            self.single_steps -= 1
        return True

    def after_update(self) -> None:
        """A step is done: a checkpoint every N steps (not what every step costs: told apart from
        the run's own work, as a boundary that held is)."""
        if self.checkpoint_every and self.step_index % self.checkpoint_every == 0:
            with self.budget.held():
                self.save_checkpoint(source="checkpoint_every")

    def _boundary_commands(self) -> list[Command]:
        """What applies at this step boundary: the `--at` commands of this step, then those
        queued meanwhile. With several ranks, rank 0's, on every rank, and a stop that a signal
        (or a full disk) brought to any rank stops them all here."""
        if not self.ranks:
            return self.queued(self.step_index)
        commands, stop = self.ranks.agree_commands(lambda: self.fixes.chosen(self.queued(self.step_index)))
        if stop is not None:
            self._checkpoint_on_stop = self._checkpoint_on_stop or stop.checkpoint
            self._stop_reason = self._stop_reason or stop.reason
            self.stop_requested.set()
        return commands

    def queued(self, step: int) -> list[Command]:
        """The `--at` commands of boundary `step`, then those queued meanwhile."""
        return self._scheduled.pop(step, []) + self.fp8_schedule.commands(step) + self.commands.drain()

    def _apply_fix(self, command: Command) -> Outcome:
        choice = self.fixes.choose(command)
        if isinstance(choice, Outcome):
            return choice
        choice.on_done = None   # the fix command's own is answered with this outcome
        return self.apply(choice)

    def scheduled_first(self, actions: tuple[str, ...]) -> list[Command]:
        """The `--at` commands of this step that lead its list and are among `actions`, taken
        out of the schedule (the pre-flight applies them before the first forward)."""
        scheduled = self._scheduled.get(self.step_index, [])
        taken = []
        while scheduled and scheduled[0].action in actions:
            taken.append(scheduled.pop(0))
        return taken

    def _stopping(self) -> None:
        if self.should_stop:
            return
        self.driver.settle()
        if self._stop_reason:
            self.event("stopping", f"stopping: {self._stop_reason}", reason=self._stop_reason)
        if self._checkpoint_on_stop or self.checkpoint_due is not None:
            self.save_checkpoint(source=self._stop_reason or self.checkpoint_due or "stop")
        self.should_stop = True
        if self.state != "error":
            self.set_state("stopped")

    # ---- commands -----------------------------------------------------------------------
    def apply(self, command: Command) -> Outcome:
        if command.action not in self._handlers:
            outcome = self.refused(command, f"unknown command {command.action!r}")
            if command.on_done is not None:
                command.on_done(outcome)
            return outcome
        return apply_command(self._handlers, command, self._command_failed)

    def refuse(self, action: str, reason: str) -> None:
        """Turn a command off in this run: from now on it is refused with `reason` (say what owns
        what it would change, e.g. an engine that owns the loss scale)."""
        self._handlers[action] = lambda command: self.refused(command, reason)

    def _command_failed(self, command: Command, message: str) -> None:
        self.event("error", message, during=command.action, source=command.source)

    def intervention(self, command: Command, before: dict, after: dict, message: str) -> Outcome:
        """Record what a command changed, in the run's words; the command's answer."""
        self.event("intervention", message, action=command.action, before=before, after=after,
                   **command.record_fields())
        return Outcome(True, message)

    def refused(self, command: Command, reason: str, **fields: Any) -> Outcome:
        """A command the run would not apply, and why: one `refused` event, whoever sent it (a
        key, ctl, --at, the API), never an error (the run goes on as it was)."""
        message = reason if "refused" in reason else f"{command.text()} refused: {reason}"
        self.event("refused", message, command=command.text(), action=command.action, reason=reason,
                   **command.record_fields(), **fields)
        return Outcome(False, message)

    def save_checkpoint(self, *, source: str) -> ckpt.CheckpointInfo | None:
        # The session holds every step the checkpoint has in it (a resume goes on from the
        # session's last step).
        self.driver.settle()
        info = self.checkpointing.save(source=source)
        if info is not None:
            self.checkpoint_due = None
        return info

    def _stop(self, command: Command) -> Outcome:
        self.intervention(command, {"state": self.state}, {"state": "stopped"}, "stop requested")
        self.stop_requested.set()
        if self.loop.stops_at_once:
            self._stopping()
        return Outcome(True, self.loop.stop_answer)

    def checkpoint_refused(self, source: str, message: str) -> None:
        self.full_disk.checkpoint_refused(source, message)

    # ---- ending -------------------------------------------------------------------------
    def close(self) -> None:
        """End the recording with its end record. The last flush counts like every other one:
        where the disk refuses it, a watched run pauses on the training thread until space is
        freed (or the user gives the records up); otherwise the records are given up, counted in
        `unwritten`, and the exit status says so."""
        self.driver.close()
        if self.full_disk.ending.is_set() and threading.current_thread() is not self.training_thread:
            # The training thread is writing the end, or waiting for space to: it gives up
            # itself (two threads never write to the file at once).
            self.unattended()
            self.request_stop(give_up_unwritten=True)
            self.full_disk.ended.wait(ENDING_WAIT_S)
            return
        for command in self.commands.drain():   # asked for after the last step: never applied
            if command.on_done is not None:
                command.on_done(Outcome(False, "the run ended before applying it"))
        if self.recorder.opened and not self.recorder.closed:
            self.publish()
            self.full_disk.finish(end_status(self.state),
                                  on_training_thread=threading.current_thread() is self.training_thread)
        if self._control is not None:   # after the end: ctl resume may be what completes it
            self._control.close()
            self._control = None
