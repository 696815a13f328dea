"""A run: the guarded trainer stepped by a loop that applies commands at step boundaries, with
its batches (job/feed.py), its recording (job/recorder.py) and its checkpoints (job/checkpoints.py).

The dashboard and the headless CLI both drive a `Run`; the run knows nothing of either. Observers
get every record (header, step, event, end) on the training thread and must be quick.

With several ranks a probed step's figures come from every rank a step later (its gather is
waited for once the next step's loss check has been answered): until then rank 0 holds the step's
record and every record after it, and writes them in order. The run waits for them at once where
something must see the step recorded first: a pause, a stop, a checkpoint saved or restored, the
end of the run (job/distributed.py, docs/distributed.md).
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import threading
import time
import traceback
from datetime import datetime
from typing import Any, Callable

import torch

import amp_tui
from amp_tui.core import precision
from amp_tui.core.commands import Command, Outcome
from amp_tui.core.jsonsafe import encode_float
from amp_tui.core.numfmt import number
from amp_tui.core.records import RunState, end_status
from amp_tui.core.run_dirs import default_run_dir
from amp_tui.job.checkpoints import RunCheckpoints
from amp_tui.job.commands import CommandQueue, Handler, apply_command
from amp_tui.job.config import RunConfig
from amp_tui.job.distributed import Ranks, RanksLost, communication_failure
from amp_tui.job.feed import BatchFeed
from amp_tui.job.handlers import SharedHandlers
from amp_tui.job.recorder import Observers, RankEcho, Recorder
from amp_tui.recording.format import SessionFormatError, event_record, step_record
from amp_tui.recording.report import RunOutcome, describe_records
from amp_tui.training import checkpoint as ckpt
from amp_tui.training.autocast import unsupported_reason
from amp_tui.training.devices import describe_device
from amp_tui.training.engine import GuardedTrainer, LossError, PrecisionRefused, StepResult
from amp_tui.training.guards import PrecisionGuard
from amp_tui.training.local_fp32 import LocalFp32
from amp_tui.training.script import ScriptError, TrainSetup, describe_exception

NONFINITE_POLICIES = ("skip", "pause", "stop", "fallback")
PRECISION_ACTIONS = ("dtype", "scale", "fp32")  # what --at 0:... may set before the pre-flight
ENDING_WAIT_S = 5.0   # how long another thread waits for the training thread to end the file

# Exit statuses of a run (the CLI returns them).
EXIT_OK = 0
EXIT_ERROR = 1          # the script raised, or the session/checkpoints could not be written
EXIT_NONFINITE_STOP = 3  # --on-nonfinite stop ended the run


class Run(SharedHandlers):
    """Owns the trainer and the session; `run()` is the loop (call it on the training thread)."""

    def __init__(self, config: RunConfig, setup: TrainSetup, device: torch.device, feed: BatchFeed,
                 ranks: Ranks | None = None):
        if config.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"--on-nonfinite must be one of {', '.join(NONFINITE_POLICIES)}")
        self.config = config
        self.setup = setup
        self.device = device
        self.feed = feed
        self.ranks = ranks   # several ranks (job/distributed.py): what they agree on goes through it
        setup.model.to(device)
        self.trainer = GuardedTrainer(
            ranks.replicate(setup.model) if ranks else setup.model, setup.optimizer, setup.loss_fn,
            device=device, dtype=config.dtype,
            init_scale=config.init_scale, scheduler=setup.scheduler,
            max_grad_norm=setup.max_grad_norm, probe_every=config.probe_every,
            underflow_every=config.underflow_every)
        if ranks:
            self.trainer.agree_finite = ranks.agree_finite
            # Each step's loss check carries what applies at the boundary after it (the step
            # counter has not moved on yet when the check runs).
            ranks.upcoming = lambda: self._queued(self.step + 1)
            # ... in DDP's own gradient all-reduce where it can, with the figures.
            ranks.carry_in_gradients(self.trainer.model, len(self.trainer.layer_names))
        self.accumulate = setup.accumulate
        self.guard = PrecisionGuard(config.guard)
        self.local_fp32 = LocalFp32(setup.model, device.type)
        for pattern in config.fp32_modules:
            self.local_fp32.add(pattern)  # ModuleMatchError names a pattern that matches nothing
        self.commands = CommandQueue()
        self.state: RunState = "starting"
        self.exit_status = EXIT_OK
        self.last_result: StepResult | None = None
        self.error: str | None = None
        self.run_dir = config.run_dir or default_run_dir(config.script)
        self.session_path = self.run_dir / "session.jsonl"
        self.recorder = (Recorder(self.session_path, on_refused=self._on_io_error) if not ranks or ranks.is_main
                         else RankEcho(self.session_path, prefix=ranks.describe(), echo=_print_line))
        self.checkpointing = RunCheckpoints(self)
        self._handlers: dict[str, Handler] = {
            "dtype": self._set_dtype, "scale": self._set_scale, "save": self._save,
            "restore": self._restore, "fp32": self._toggle_fp32, "pause": self._pause,
            "resume": self._resume_running, "step": self._single_step, "stop": self._stop,
        }
        self._scheduled: dict[int, list[Command]] = {}
        # Several ranks: the last probed step's figures on their way to rank 0 (what waits for
        # them, and the step's own result), its record held until then.
        self._figures_due: tuple[Callable[[], StepResult], StepResult] | None = None
        for step, command in config.at:
            self._scheduled.setdefault(step, []).append(command)
        self._header: dict | None = None    # taken before the pre-flight's --at actions apply
        self._resumed = False
        self._stop_requested = threading.Event()
        self._checkpoint_on_stop = False
        self._stop_reason: str | None = None
        self._pause_reason: str | None = None     # "io": held until the disk takes writes again
        self._io_error: str | None = None         # the last write the disk refused
        self._checkpoint_due: str | None = None   # the source of a save the disk refused
        self._give_up_unwritten = False           # quit even if the recording can't be completed
        # Set when a stop was held because records could not be written (a full disk): whoever
        # asked is told how many would be lost and may ask again to give them up.
        self.stop_held = threading.Event()
        self.held_message: str | None = None      # what the held stop would have lost
        self._stop_replies: list[Command] = []    # ctl stops answered once the end is tried
        self._ending = threading.Event()          # the training thread is writing the end
        self._ended = threading.Event()           # the end is written, or given up
        self.unwritten: dict[str, int] = {}       # records given up at the end, by type
        self.recording_error: str | None = None   # why they were: the OS's words and the path
        self._control = None
        self._thread: threading.Thread | None = None   # the thread that runs the loop
        self._single_steps = 0
        self.nonfinite_events = 0
        self._act_unmeasured_said = False
        self.started_at = time.time()

    # ---- public, thread-safe ------------------------------------------------------------
    @property
    def observers(self) -> Observers:
        return self.recorder.observers

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
            self._give_up_unwritten = True
        self.stop_held.clear()
        self._ask_stop(checkpoint=checkpoint, reason=reason)
        self.commands.wakeup.set()

    def _ask_stop(self, *, checkpoint: bool = False, reason: str | None = None) -> None:
        if self.ranks and self.ranks.voting:   # every rank stops at the boundary that agrees on it
            self.ranks.vote_stop(checkpoint=checkpoint, reason=reason)
            return
        if checkpoint:
            self._checkpoint_on_stop = True
        if reason and self._stop_reason is None:
            self._stop_reason = reason
        self._stop_requested.set()

    def unattended(self) -> None:
        """Nobody is watching any more (the terminal is gone): a full disk stops the run as in
        headless mode instead of pausing it for a user who can't answer."""
        self.config.on_io_error = "stop"
        self._give_up_unwritten = True

    @property
    def step(self) -> int:
        return self.trainer.step_index

    def checkpoints(self) -> list[ckpt.CheckpointInfo]:
        return self.checkpointing.list()

    def saved_extra(self) -> dict:
        """What a checkpoint of this run holds beyond the trainer's state: the micro-batches
        consumed, so a resume reads the data in the same order."""
        return {"micro_batches_consumed": self.feed.consumed}

    def status(self) -> dict:
        """A snapshot for `amp-tui ctl RUN status` (read from another thread: plain values only)."""
        t, r = self.trainer, self.last_result
        return {"state": self.state, "step": self.step, "steps": self.config.steps, "dtype": t.dtype,
                "scale": t.scale, "updates": t.updates_applied, "skipped": t.skipped_total,
                "loss": encode_float(r.loss) if r is not None else None, "pid": os.getpid(),
                "run_dir": str(self.run_dir), "script": str(self.config.script),
                **(self.ranks.header_fields() if self.ranks else {})}

    def outcome(self) -> RunOutcome:
        return RunOutcome(state=self.state, steps=self.step, unwritten=dict(self.unwritten),
                          recording_error=self.recording_error)

    def pending_records(self) -> dict[str, int]:
        """Records the disk has refused so far and that are still kept, by type."""
        return self.recorder.pending_records()

    # ---- recording ----------------------------------------------------------------------
    def header(self) -> dict:
        setup, cfg = self.setup, self.config
        return {
            "amp_tui_version": amp_tui.__version__,
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "device": describe_device(self.device),
            "script": str(cfg.script),
            "argv": list(cfg.script_argv),
            "command": list(cfg.command_line),
            "dtype": self.trainer.dtype,
            "init_scale": self.trainer.init_scale,
            "steps": cfg.steps,
            "accumulate": self.accumulate,
            "max_grad_norm": setup.max_grad_norm,
            "probe_every": cfg.probe_every,
            "underflow_every": cfg.underflow_every,
            "on_nonfinite": cfg.on_nonfinite,
            "checkpoint_every": cfg.checkpoint_every,
            "optimizer": type(setup.optimizer).__name__,
            "scheduler": type(setup.scheduler).__name__ if setup.scheduler is not None else None,
            "parameters": sum(p.numel() for p in setup.model.parameters()),
            "layers": self.trainer.layer_names,
            "compile": self.trainer.compile_info(),
            "fp32_modules": self.local_fp32.names,
            "guards": {k: v for k, v in vars(cfg.guard).items()},
            "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            **(self.ranks.header_fields() if self.ranks else {}),
        }

    def event(self, kind: str, message: str, *, step: int | None = None, **fields: Any) -> dict:
        record = event_record(self.step if step is None else step, kind, message, **fields)
        self.recorder.emit(record)
        return record

    def set_state(self, state: RunState) -> None:
        self.state = state

    # ---- a disk that refuses writes ------------------------------------------------------
    def _waits_for_space(self) -> bool:
        """A full disk pauses the run (someone watching can free space), or stops it."""
        return self.config.on_io_error == "pause" and not self._give_up_unwritten

    def _on_io_error(self, message: str, first: bool = True) -> None:
        """The session can't be appended to (a full disk...): say so, then halt. The records
        stay pending in the writer and reach the file once it takes them again."""
        if not first and (self.state == "paused" or self._stop_requested.is_set()):
            return  # already reported; the run is paused or stopping
        self.recorder.keep(event_record(self.step, "error", message, during="io"))
        self._halt_for_io(message)

    def _halt_for_io(self, message: str) -> None:
        """Keep what is written; pause (dashboard) or stop with a non-zero status (headless)."""
        self.error = self._io_error = message
        if self._waits_for_space():
            self._single_steps = 0
            self._pause_reason = "io"
            self.set_state("paused")
            self.event("paused", "paused: the disk refused a write; free some space, then resume "
                       "(the records kept meanwhile are written then)", reason="io")
        else:
            self.exit_status = EXIT_ERROR
            self._ask_stop()

    def checkpoint_refused(self, source: str, message: str) -> None:
        """A checkpoint the disk refused: saved again once the user frees space and resumes."""
        if self._waits_for_space():
            self._checkpoint_due = source
        self._halt_for_io(message)

    def _save_checkpoint(self, *, source: str) -> ckpt.CheckpointInfo | None:
        # The session holds every step the checkpoint has in it (a resume goes on from the
        # session's last step).
        self._settle_figures()
        info = self.checkpointing.save(source=source)
        if info is not None:
            self._checkpoint_due = None
        return info

    # ---- starting -------------------------------------------------------------------------
    def open(self) -> None:
        """Create the run directory and write the header (or, resuming, append to the session)."""
        if not self.ranks or self.ranks.is_main:
            self.checkpointing.folder.mkdir(parents=True, exist_ok=True)
            ckpt.cleanup_temporary_files(self.checkpointing.folder)
        resuming = self.config.resume_from is not None
        if resuming and not self._resumed:
            self.checkpointing.resume(self.config.resume_from)   # first: the header says where it stops
            self._resumed = True
        header = self._header or self.header()   # resuming, only the observers see it
        self.recorder.open(header, append=resuming, flush_interval=self.config.flush_interval)
        if self.config.control:
            from amp_tui.job.control import ControlServer
            self._control = ControlServer(self, self.run_dir)
            self._control.start()

    def preflight(self) -> None:
        """Check the script before anything is written, without an extra call: run the first
        step's forward now, under the precision that step uses, and keep it for that step
        (GuardedTrainer.start_step). So the run starts exactly as a plain loop would: loss_fn
        is called once per micro-batch, in training mode, with the RNG and any state of the
        script's own going on from there. A failure is a ScriptError (exit 2, no run directory).
        """
        self.preflight_forward(self.preflight_batch())

    def preflight_batch(self):
        """The pre-flight's first part: the state it goes on from (--resume), the starting
        precision, and the first batch. With several ranks this is agreed on apart from the
        forward, whose DDP wrapper may already meet the other ranks (to broadcast buffers)."""
        script = self.config.script
        if self.config.resume_from is not None:
            try:
                self.checkpointing.resume(self.config.resume_from)  # the check runs on the state it goes on from
            except (OSError, ckpt.CheckpointError, SessionFormatError, ValueError) as exc:
                raise ScriptError(f"--resume {self.run_dir}: {exc}") from None
            self._resumed = True
        self._header = self.header()  # the starting precision, as the --at events record it
        self._apply_starting_precision()
        try:
            return self.feed.peek()
        except ScriptError:
            raise ScriptError(f"'batches' from {script.name} is empty") from None
        except Exception as exc:  # noqa: BLE001 - the user's DataLoader or dataset failed
            raise ScriptError(f"'batches' from {script.name} failed on the first batch: "
                              f"{describe_exception(exc, script)}") from None

    def preflight_forward(self, batch) -> None:
        """The pre-flight's second part: the first step's forward, kept for that step."""
        script = self.config.script
        try:
            self.trainer.start_step(batch)
        except LossError as exc:
            raise ScriptError(f"{script.name}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the user's code failed: say where
            raise ScriptError(f"loss_fn in {script.name} failed on the first batch: "
                              f"{describe_exception(exc, script)}") from None

    def _apply_starting_precision(self) -> None:
        """The first step's `--at` precision actions (dtype, scale, fp32) apply before the
        pre-flight, so its forward runs as the step will: a module that fails under autocast
        is what fp32=NAME is for. Only those that lead the step's list: an action scheduled
        before them (save, pause...) keeps its place, and a change after it drops the kept
        forward."""
        scheduled = self._scheduled.get(self.step, [])
        while scheduled and scheduled[0].action in PRECISION_ACTIONS:
            self._apply(scheduled.pop(0))

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> int:
        self._thread = threading.current_thread()
        if not self.recorder.opened:
            try:
                self.open()
            except (OSError, ckpt.CheckpointError, ValueError) as exc:
                # No session to write to: tell the observers (the dashboard) and give up cleanly.
                message = f"could not start the run in {self.run_dir}: {exc}"
                self.error, self.exit_status = message, EXIT_ERROR
                self.set_state("error")
                self.observers.notify(event_record(self.step, "error", message, during="step", traceback=""))
                self.close()
                return self.exit_status
        self.set_state("running")
        try:
            self._loop()
            self._settle_figures()   # the last probed step, before the end record
        except BaseException as exc:  # noqa: BLE001 - recorded, then the session is closed cleanly
            self._record_failure(exc)   # held behind a step whose figures are due, if one is
            if not isinstance(exc, Exception):
                raise
        finally:
            self._settle_figures(failed=True)
            if self.ranks:
                self.ranks.voting = False   # no collective after the loop: stops are this rank's own
            self.close()
        return self.exit_status

    def _loop(self) -> None:
        cfg = self.config
        while True:
            for command in self._boundary_commands():
                self._apply(command)
            if self._stop_requested.is_set():
                self._settle_figures()
                if self._stop_reason:
                    self.event("stopping", f"stopping: {self._stop_reason}", reason=self._stop_reason)
                if self._checkpoint_on_stop or self._checkpoint_due is not None:
                    self._save_checkpoint(source=self._stop_reason or self._checkpoint_due or "stop")
                if self.state != "error":
                    self.set_state("stopped")
                return
            if self._checkpoint_due is not None and self.state == "running":
                # A save the disk refused, tried again first once the user resumed.
                self._save_checkpoint(source=self._checkpoint_due)
                continue
            if cfg.steps is not None and self.step >= cfg.steps and self._pause_reason != "io":
                self.set_state("finished")
                return
            if self.state == "paused" and self._single_steps == 0:
                self._settle_figures()   # the paused dashboard, ctl and attach show the last step
                if self.ranks:
                    self.ranks.hold(self.commands)   # the next boundary is the heartbeat
                else:
                    self.commands.wait(0.25)
                continue
            if self._single_steps:
                self._single_steps -= 1
            self._one_step()
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self._save_checkpoint(source="checkpoint_every")

    def _boundary_commands(self) -> list[Command]:
        """What applies at this step boundary: the `--at` commands of this step, then those
        queued meanwhile. With several ranks, rank 0's, on every rank, and a stop that a signal
        (or a full disk) brought to any rank stops them all here."""
        if not self.ranks:
            return self._queued(self.step)
        commands, stop = self.ranks.agree_commands(lambda: self._queued(self.step))
        if stop is not None:
            self._checkpoint_on_stop = self._checkpoint_on_stop or stop.checkpoint
            self._stop_reason = self._stop_reason or stop.reason
            self._stop_requested.set()
        return commands

    def _queued(self, step: int) -> list[Command]:
        """The `--at` commands of boundary `step`, then those queued meanwhile."""
        return self._scheduled.pop(step, []) + self.commands.drain()

    def _one_step(self) -> None:
        step = self.step
        due = None
        try:
            micro = self.feed.take(self.accumulate)  # the user's DataLoader or dataset may raise too
            result = self.trainer.step(micro)
            if self.ranks:
                # The last probed step's gather: every rank issued it before this step's loss
                # check, which has been answered, so it is in (or as good as).
                self._settle_figures()
                if result.nonfinite is None and self.state != "paused":
                    due = self.ranks.gather_later(result, self.trainer.layer_names)
                else:   # rare, and the details need every rank's words; a single step is shown at once
                    result = self.ranks.gather_step(result, self.trainer.layer_names, details=True)
        except (LossError, ScriptError) as exc:
            raise StepFailure(step, f"step {step}: {exc}", exc) from exc
        except Exception as exc:  # noqa: BLE001
            if self.ranks and communication_failure(exc):   # DDP's all-reduce, or one of ours
                lost = RanksLost(self.ranks.lost_message(exc))
                raise StepFailure(step, f"step {step}: {lost}", lost) from exc
            where = describe_exception(exc, self.config.script)
            raise StepFailure(step, f"step {step}: the script raised {where}", exc) from exc
        self.last_result = result
        if due is not None:
            # Recorded once every rank's figures are in; what comes meanwhile is held behind it.
            # What decides from this step (the guards below) uses what the ranks agreed on, the
            # same in this rank's own result.
            self._figures_due = (due, result)
            self.recorder.hold()
        else:
            # A single step while paused: no later record comes to push it to the file, where
            # `ctl`, `attach` and `replay --follow` look for it.
            self.recorder.emit(step_record(result), flush=self.state == "paused")
        if self.trainer.act_unmeasured and not self._act_unmeasured_said:
            self._act_unmeasured_said = True
            self.event("alert", self.trainer.act_unmeasured, step=result.step, reason="act_not_measured",
                       cause="the compiled graph was built before amp-tui attached its hooks",
                       fix="leave the first call of the compiled model to amp-tui (none in setup())")
        if result.nonfinite:
            self._on_nonfinite(result)
        self._apply_guards(result)

    def _settle_figures(self, *, failed: bool = False, flush: bool = False) -> None:
        """Record the probed step whose figures were on their way from every rank, then what was
        held behind it. Where they can't come (a rank is gone), that step goes unrecorded, as when
        its gather was waited for at once, and what came after it is written all the same; after
        a failure (`failed`, the error already recorded) that is said no more. `flush`: in the
        file now, for whoever reads it next (as while paused)."""
        due, self._figures_due = self._figures_due, None
        if due is None:
            return
        figures, own = due
        try:
            result = figures(failed=failed)
        except Exception:
            self.recorder.release(None)
            if failed:
                return
            raise
        if self.last_result is own:
            self.last_result = result
        self.recorder.release(step_record(result), flush=flush or self.state == "paused")

    def _apply_guards(self, result: StepResult) -> None:
        t = self.trainer
        bf16_ok = unsupported_reason(self.device, "bfloat16") is None
        decisions = self.guard.observe(result, t.scale, bf16_ok)
        if decisions.clamp_scale is not None:
            t.clamp_scale(decisions.clamp_scale)
        for alert in decisions.alerts:
            self.event("alert", f"{alert.message}. Likely cause: {alert.cause}. Fix: {alert.fix}",
                       step=result.step, reason=alert.reason, cause=alert.cause, fix=alert.fix)
        move = decisions.move
        if move is None:
            return
        if move.rollback_before is not None:
            good = [c for c in self.checkpoints() if c.step is not None and c.step <= move.rollback_before]
            if self.ranks:   # rank 0's listing for every rank: the restore is a collective
                good = self.ranks.share(good[:1])
            if good:
                self._apply(Command("restore", str(good[0].path), "fallback"))
            else:
                self.event("alert", f"--rollback: no checkpoint saved at or before step "
                           f"{move.rollback_before}; moving on without one", reason="no_checkpoint",
                           cause="no checkpoint yet", fix="use --checkpoint-every N")
        before = t.describe_precision()
        t.set_dtype(move.to_dtype)
        self.event("intervention", f"fallback {precision.SHORT[before['dtype']]} → "
                   f"{precision.SHORT[move.to_dtype]}: {move.reason}", step=self.step, action="dtype",
                   value=move.to_dtype, source="fallback", reason=move.reason, before=before,
                   after=t.describe_precision())

    def _on_nonfinite(self, result: StepResult) -> None:
        self.nonfinite_events += 1
        layer = result.first_nonfinite_layer
        diagnosis = result.diagnosis
        rank = result.per_rank.nonfinite_rank if result.per_rank is not None else None
        on = f" on rank {rank}" if rank is not None else ""
        if result.nonfinite == "loss":
            where = f"; first non-finite output: {layer}" if layer else ""
            if diagnosis is not None and diagnosis.input_nonfinite:
                where += " (its input was already non-finite)"
            msg = (f"non-finite loss ({number(result.loss, 4)}){on} in {precision.SHORT[result.dtype]}{where}: "
                   "update skipped")
        else:
            where = f"; first non-finite gradient: {layer}" if layer else ""
            if result.scale is not None:
                msg = (f"gradients overflowed at scale {result.scale:g}{on}{where}: update skipped, "
                       f"scale now {self.trainer.scale:g}")
            else:
                msg = f"non-finite gradients{on} in {precision.SHORT[result.dtype]}{where}: update skipped"
        self.event("nonfinite", msg, step=result.step, where=result.nonfinite, layer=layer,
                   loss=encode_float(result.loss), scale=result.scale, dtype=result.dtype,
                   **(diagnosis.as_fields() if diagnosis is not None else {}),
                   **({"rank": rank} if rank is not None else {}))
        if result.nonfinite != "loss":
            return
        policy = self.config.on_nonfinite  # "skip" and "fallback" just go on (the guard decides)
        if policy == "pause" and self.state == "running":
            self._single_steps = 0
            self.set_state("paused")
            self.event("paused", f"paused after a non-finite loss at step {result.step} "
                                 "(--on-nonfinite pause): change the dtype, cut the scale or restore",
                       reason="nonfinite")
        elif policy == "stop":
            self.exit_status = EXIT_NONFINITE_STOP
            self._stop_requested.set()
            self.event("stopping", f"stopping after a non-finite loss at step {result.step} "
                                   "(--on-nonfinite stop)", reason="nonfinite")

    # ---- commands -----------------------------------------------------------------------
    def _apply(self, command: Command) -> Outcome:
        return apply_command(self._handlers, command, self._command_failed)

    def _command_failed(self, command: Command, message: str) -> None:
        self.event("error", message, during=command.action, source=command.source)

    def _set_dtype(self, command: Command) -> Outcome:
        try:
            change = self.trainer.set_dtype(str(command.value))
        except PrecisionRefused as exc:
            self._refused(command, f"dtype change refused: {exc}")
            return Outcome(False, str(exc))
        b, a = change["before"], change["after"]
        return self.intervention(command, b, a, f"dtype {precision.SHORT[b['dtype']]} → "
                                 f"{precision.SHORT[a['dtype']]}" + _scale_note(a))

    def _set_scale(self, command: Command) -> Outcome:
        try:
            change = self.trainer.set_scale(command.value)
        except PrecisionRefused as exc:
            self._refused(command, f"scale change refused: {exc}")
            return Outcome(False, str(exc))
        b, a = change["before"], change["after"]
        if b["scale"] is not None:
            text = f"loss scale {b['scale']:g} → {a['scale']:g}"
        else:
            text = f"fp16 loss scale {b['fp16_scale']:g} → {a['fp16_scale']:g} (used when fp16 is next entered)"
        return self.intervention(command, b, a, text)

    def _fp32_root(self):
        return self.trainer.model

    def _fp32_changed(self) -> None:
        self.trainer.discard_started_step()  # it ran under the old autocast policy

    def _restore(self, command: Command) -> Outcome:
        self._settle_figures()   # the steps the restore undoes are recorded before it
        return self.checkpointing.restore(command)

    def _pause(self, command: Command) -> Outcome:
        # The paused state (ctl status, attach) comes with the last step in the file.
        self._settle_figures(flush=True)
        return super()._pause(command)

    def _resume_running(self, command: Command) -> Outcome:
        before = {"state": self.state}
        self._single_steps = 0
        self._pause_reason = None
        self.set_state("running")
        return self.intervention(command, before, {"state": self.state}, "resumed")

    def _single_step(self, command: Command) -> Outcome:
        if self.state != "paused":
            return Outcome(False, self._pause_first(command.source))
        self._single_steps += 1
        return self.intervention(command, {"state": self.state}, {"state": self.state},
                                 f"single step {self.step}")

    def _stop(self, command: Command) -> Outcome:
        self.intervention(command, {"state": self.state}, {"state": "stopped"}, "stop requested")
        self._stop_requested.set()
        return Outcome(True, "stopping at this step boundary")

    def _pause_first(self, source: str) -> str:
        """Why a single step was refused, in the terms of whoever asked for it."""
        if source == "dashboard":
            return "single step works while paused (press space first)"
        if source.startswith("ctl"):
            run_dir = shlex.quote(str(self.run_dir))
            return (f"step works while the job is paused: send pause first "
                    f"(amp-tui ctl {run_dir} pause), then step")
        return "a single step works while the run is paused: pause it first"

    # ---- ending -------------------------------------------------------------------------
    def _record_failure(self, exc: BaseException) -> None:
        if isinstance(exc, StepFailure):
            message, original, step = exc.message, exc.original, exc.step
        elif isinstance(exc, KeyboardInterrupt):
            self.set_state("stopped")
            self.event("stopping", "interrupted", reason="interrupt")
            return
        elif isinstance(exc, RanksLost):
            message, original, step = f"step {self.step}: {exc}", exc, self.step
        else:
            message, original, step = f"{type(exc).__name__}: {exc}", exc, self.step
        # A ScriptError is amp-tui's own wording of a contract breach, and a lost rank a fact of
        # the job: their frames are ours, not the user's.
        tb = "" if isinstance(original, (ScriptError, RanksLost)) else "".join(
            traceback.format_exception(type(original), original, original.__traceback__))
        self.error = message
        self.exit_status = EXIT_ERROR
        self.set_state("error")
        self.event("error", message, step=step, during="step", traceback=tb[-20000:])

    def close(self) -> None:
        """End the recording with its end record. The last flush counts like every other one:
        where the disk refuses it, a watched run pauses on the training thread until space is
        freed (or the user gives the records up); otherwise the records are given up, counted in
        `unwritten`, and the exit status says so."""
        self.trainer.close()
        if self._ending.is_set() and threading.current_thread() is not self._thread:
            # The training thread is writing the end, or waiting for space to: it gives up
            # itself (two threads never write to the file at once).
            self.unattended()
            self.request_stop(give_up_unwritten=True)
            self._ended.wait(ENDING_WAIT_S)
            return
        if self.recorder.opened and not self.recorder.closed:
            self._finish_recording(end_status(self.state))
        if self._control is not None:   # after the end: ctl resume may be what completes it
            self._control.close()
            self._control = None

    def _end_record(self, status: str) -> dict:
        t = self.trainer
        return {"step": self.step, "status": status, "updates": t.updates_applied,
                "skipped_total": t.skipped_total, "dtype": t.dtype, "scale": t.scale,
                "time": round(time.time(), 3), "exit_status": self.exit_status}

    def _finish_recording(self, status: str) -> None:
        waiting_allowed = threading.current_thread() is self._thread   # others can't block
        if waiting_allowed:
            self._ending.set()
        try:
            self._write_end(status, waiting_allowed)
        finally:
            self._ended.set()

    def _write_end(self, status: str, waiting_allowed: bool) -> None:
        while True:
            try:
                self.recorder.finish(self._end_record(status))
                break
            except OSError as exc:
                why = f"{exc.strerror or exc}: {self.session_path}"
                if not (waiting_allowed and self._waits_for_space()):
                    self._give_up(status, why)
                    return
                self._on_io_error(f"could not write the end of {self.session_path}: "
                                  f"{exc.strerror or exc}")   # each try at the end is reported
                self._wait_for_space(why)
        if self.error is not None and self.error == self._io_error and self._checkpoint_due is None:
            self.error = None   # the disk took everything in the end: nothing was lost
        self.set_state(status)
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
        if self._stop_requested.is_set() and not self._give_up_unwritten:
            self._stop_requested.clear()
            self.held_message = (f"{describe_records(self.pending_records())} would be lost "
                                 f"({why}). Free some space and stop again to write them; "
                                 "stopping again without freeing any ends the run without them")
            self.stop_held.set()
            self._answer_stops(Outcome(False, self.held_message))
        while True:
            for command in self.commands.drain():
                if command.action == "stop":
                    # A second stop while one is held gives the records up if they still
                    # don't fit; either way it is answered once the last flush was tried.
                    if self.stop_held.is_set():
                        self._give_up_unwritten = True
                    self.intervention(command, {"state": self.state}, {"state": "stopped"},
                                      "stop requested")
                    self._stop_replies.append(command)
                    self._stop_requested.set()
                elif command.action in ("resume", "step", "pause"):
                    self._apply(command)
                elif command.on_done is not None:
                    command.on_done(Outcome(False, f"{command.text()} refused: the run has ended "
                                                   f"and its last records wait for the disk ({why})"))
            if self.state == "running" or self._single_steps or self._stop_requested.is_set():
                self._single_steps = 0
                self._pause_reason = None
                return
            self.commands.wait(0.25)

    def _give_up(self, status: str, why: str) -> None:
        """End without what the disk refused: counted, said, and a non-zero exit status."""
        self.recording_error = why
        self.error = self.error or why
        self.exit_status = self.exit_status or EXIT_ERROR
        self.set_state(status)
        self.unwritten = self.recorder.give_up(self._end_record(status))
        self._answer_stops(Outcome(True, f"stopped without {describe_records(self.unwritten)} "
                                         f"({why})"))


class StepFailure(Exception):
    def __init__(self, step: int, message: str, original: BaseException):
        super().__init__(message)
        self.step, self.message, self.original = step, message, original


def _print_line(text: str) -> None:
    print(text, flush=True)


def _scale_note(after: dict) -> str:
    return f" (scale {after['scale']:g})" if after.get("scale") is not None else ""
