"""A run of `amp-tui train`: amp-tui's own guarded step over the script's batches
(job/drivers/engine_driver.py) under a run controller (job/controller.py) it owns, with its pre-flight,
its resume and its loop. The dashboard and the headless CLI both drive a `Run`; the run knows nothing of either.
Observers get every record (header, step, event, end) on the training thread and must be quick.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from amp_tui.core.commands import Command
from amp_tui.core.records import RunState
from amp_tui.core.run_dirs import default_run_dir
from amp_tui.job.config import RunConfig
from amp_tui.job.controller import RunController
from amp_tui.job.drivers.engine_driver import EngineDriver, StepFailure
from amp_tui.job.drivers.feed import BatchFeed
from amp_tui.job.ranks.distributed import Ranks, RanksLost
from amp_tui.job.records.recorder import Observers
from amp_tui.job.states import EXIT_ERROR, IoPolicy
from amp_tui.recording.format import SessionFormatError, event_record
from amp_tui.training import checkpoint as ckpt
from amp_tui.training.script import ScriptError, TrainSetup

if TYPE_CHECKING:
    from amp_tui.recording.report import RunOutcome

PRECISION_ACTIONS = ("dtype", "scale", "fp32")  # what --at 0:... may set before the pre-flight


class Run:
    """A run of `amp-tui train`: the engine driver's steps under a run controller it owns
    (`controller`, which records and steers them); `run()` is the loop (call it on the training
    thread). A full disk stops it (headless) until `watched()` (the dashboard) makes it pause
    instead."""

    def __init__(self, config: RunConfig, setup: TrainSetup, device: torch.device, feed: BatchFeed,
                 ranks: Ranks | None = None):
        self.config = config
        self.setup = setup
        self.feed = feed
        self.driver = driver = EngineDriver(config, setup, device, feed, ranks)
        self.controller = RunController(
            driver, device=device, run_dir=config.run_dir or default_run_dir(config.script),
            script=config.script, ranks=ranks, guard=config.guard, on_nonfinite=config.on_nonfinite,
            io_policy=IoPolicy.STOP, checkpoint_every=config.checkpoint_every, at=config.at,
            steps=config.steps, flush_interval=config.flush_interval, control=config.control,
            echo=_print_line)
        self.controller.fsdp_checkpoint = config.fsdp_checkpoint   # how checkpoints write a sharded model
        driver.attach(self.controller)
        self.trainer = driver.trainer
        self._header: dict | None = None    # taken before the pre-flight's --at actions apply
        self._resumed = False

    # ---- what the dashboard and the CLI read and ask (the controller's, for short) --------
    @property
    def step(self) -> int:
        return self.controller.step_index

    @property
    def run_dir(self) -> Path:
        return self.controller.run_dir

    @property
    def session_path(self) -> Path:
        return self.controller.session_path

    @property
    def state(self) -> RunState:
        return self.controller.state

    @property
    def exit_status(self) -> int:
        return self.controller.exit_status

    @property
    def error(self) -> str | None:
        return self.controller.error

    @property
    def device(self) -> torch.device:
        return self.controller.device

    @property
    def observers(self) -> Observers:
        return self.controller.observers

    @property
    def stop_held(self) -> threading.Event:
        """Set while a stop waits on a full disk (`held_message` says what it would lose)."""
        return self.controller.stop_held

    @property
    def held_message(self) -> str | None:
        return self.controller.held_message

    @property
    def unwritten(self) -> dict[str, int]:
        """Records given up at the end, by type (`recording_error`: why)."""
        return self.controller.unwritten

    @property
    def recording_error(self) -> str | None:
        return self.controller.recording_error

    def checkpoints(self) -> list[ckpt.CheckpointInfo]:
        return self.controller.checkpoints()

    def outcome(self) -> RunOutcome:
        return self.controller.outcome()

    def submit(self, command: Command) -> None:
        self.controller.submit(command)

    def request_stop(self, **options) -> None:
        """`RunController.request_stop`: from any thread."""
        self.controller.request_stop(**options)

    def watched(self) -> None:
        self.controller.watched()

    def unattended(self) -> None:
        self.controller.unattended()

    def close(self) -> None:
        self.controller.close()

    # ---- starting -------------------------------------------------------------------------
    def open(self) -> None:
        """Create the run directory and write the header (or, resuming, append to the session)."""
        resuming = self.config.resume_from is not None
        if resuming and not self._resumed:
            self._go_on_from_checkpoint()   # first: the header says where it stops
        run = self.controller
        run.open_recording(self._header or run.header(), append=resuming)   # resuming, only the observers see it

    def _go_on_from_checkpoint(self) -> None:
        cfg, run = self.config, self.controller
        run.steps = cfg.steps = run.checkpointing.resume(
            cfg.resume_from, steps=cfg.steps, skipped=cfg.resume_skipped, skip_batches=self.feed.skip)
        self._resumed = True

    def preflight_batch(self):
        """The pre-flight's first part: the state it goes on from (--resume), the starting
        precision, and the first batch. With several ranks this is agreed on apart from the
        forward, whose DDP wrapper may already meet the other ranks (to broadcast buffers).

        The pre-flight checks the script before anything is written, without an extra call: the
        first step's forward runs now, under the precision that step uses, and is kept for that
        step. So the run starts exactly as a plain loop would. A failure is a ScriptError (exit
        2, no run directory)."""
        run = self.controller
        if self.config.resume_from is not None:
            try:
                self._go_on_from_checkpoint()   # the check runs on the state it goes on from
            except (OSError, ckpt.CheckpointError, SessionFormatError, ValueError) as exc:
                raise ScriptError(f"--resume {run.run_dir}: {exc}") from None
        self._header = run.header()  # the starting precision, as the --at events record it
        # The first step's --at precision actions (dtype, scale, fp32) apply before the
        # pre-flight, so its forward runs as the step will: a module that fails under autocast
        # is what fp32=NAME is for. Only those that lead the step's list: an action scheduled
        # before them (save, pause...) keeps its place, and a change after it drops the kept
        # forward.
        for command in run.scheduled_first(PRECISION_ACTIONS):
            run.apply(command)
        return self.driver.first_batch()

    def preflight_forward(self, batch) -> None:
        """The pre-flight's second part: the first step's forward, kept for that step."""
        self.driver.first_forward(batch)

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> int:
        run = self.controller
        run.training_thread = threading.current_thread()
        if not run.recorder.opened:
            try:
                self.open()
            except (OSError, ckpt.CheckpointError, ValueError) as exc:
                # No session to write to: tell the observers (the dashboard) and give up cleanly.
                message = f"could not start the run in {run.run_dir}: {exc}"
                run.error, run.exit_status = message, EXIT_ERROR
                run.set_state("error")
                run.observers.notify(event_record(self.step, "error", message, during="step", traceback=""))
                run.close()
                return run.exit_status
        run.set_state("running")
        try:
            while run.boundary(finished=self._finished):
                self.driver.step()   # ends in the controller's end_step
            self.driver.settle()   # the last probed step, before the end record
        except BaseException as exc:  # noqa: BLE001 - recorded, then the session is closed cleanly
            self._record_failure(exc)   # held behind a step whose figures are due, if one is
            if not isinstance(exc, Exception):
                raise
        finally:
            self.driver.settle(failed=True)
            if run.ranks:
                run.ranks.voting = False   # no collective after the loop: stops are this rank's own
            run.close()
        return run.exit_status

    def _finished(self) -> bool:
        steps = self.controller.steps
        return steps is not None and self.step >= steps

    def _record_failure(self, exc: BaseException) -> None:
        run = self.controller
        if isinstance(exc, KeyboardInterrupt):
            run.set_state("stopped")
            run.event("stopping", "interrupted", reason="interrupt")
            return
        if isinstance(exc, StepFailure):
            message, original, step = exc.message, exc.original, exc.step
        elif isinstance(exc, RanksLost):
            message, original, step = f"step {self.step}: {exc}", exc, self.step
        else:
            message, original, step = f"{type(exc).__name__}: {exc}", exc, self.step
        # A ScriptError is amp-tui's own wording of a contract breach, and a lost rank a fact of
        # the job: their frames are ours, not the user's.
        run.fail(message, None if isinstance(original, (ScriptError, RanksLost)) else original, step=step)


def _print_line(text: str) -> None:
    print(text, flush=True)
