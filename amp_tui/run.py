"""A run: the guarded trainer, its batches, the session file, checkpoints and the command loop.

The dashboard and the headless CLI both drive a `Run`; the run knows nothing of either. Observers
get every record (header, step, event, end) on the training thread and must be quick.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

import amp_tui
from amp_tui import checkpoint as ckpt
from amp_tui import precision
from amp_tui.commands import Command, CommandQueue, Outcome
from amp_tui.compiled import eagerly, original_module
from amp_tui.devices import describe_device, move_to_device
from amp_tui.engine import GuardedTrainer, LossError, PrecisionRefused, StepResult, check_loss
from amp_tui.guards import GuardConfig, PrecisionGuard
from amp_tui.local_fp32 import LocalFp32, ModuleMatchError
from amp_tui.jsonsafe import encode_float
from amp_tui.numfmt import number
from amp_tui.script import ScriptError, TrainSetup, describe_exception
from amp_tui.session import SessionWriter, event_record, step_record

NONFINITE_POLICIES = ("skip", "pause", "stop", "fallback")

# Exit statuses of a run (the CLI returns them).
EXIT_OK = 0
EXIT_ERROR = 1          # the script raised, or the session/checkpoints could not be written
EXIT_NONFINITE_STOP = 3  # --on-nonfinite stop ended the run


@dataclass
class RunConfig:
    script: Path
    script_argv: list[str] = field(default_factory=list)
    dtype: str = "float16"
    init_scale: float = 65536.0
    steps: int | None = None
    run_dir: Path | None = None
    checkpoint_every: int | None = None
    probe_every: int = 1
    underflow_every: int = 10           # underflow shares on every Nth probed step
    on_nonfinite: str = "skip"
    at: list[tuple[int, Command]] = field(default_factory=list)
    command_line: list[str] = field(default_factory=list)
    guard: GuardConfig = field(default_factory=GuardConfig)
    fp32_modules: list[str] = field(default_factory=list)
    on_io_error: str = "stop"           # a full disk: "stop" (headless) or "pause" (dashboard)
    control: bool = False                # serve the control socket (amp-tui ctl / attach)
    resume_from: Path | None = None      # a checkpoint to continue from, appending to the session


def default_run_dir(script: Path, root: Path = Path("runs")) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = root / f"{stamp}-{script.stem}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


class BatchFeed:
    """Yields batches on the device forever, re-iterating `batches` when it runs out."""

    def __init__(self, batches: Iterable, device: torch.device):
        self._batches = batches
        self._device = device
        self._iter = None
        self._pending: list = []
        self.consumed = 0

    def _next_raw(self):
        if self._pending:
            return self._pending.pop(0)
        if self._iter is None:
            self._iter = iter(self._batches)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self._batches)
            try:
                return next(self._iter)
            except StopIteration:
                raise ScriptError("'batches' yielded no batch (a generator can't be re-iterated: "
                                  "return a list or a DataLoader)") from None

    def peek(self):
        batch = self._next_raw()
        self._pending.insert(0, batch)
        return move_to_device(batch, self._device)

    def take(self, count: int) -> list:
        out = []
        for _ in range(count):
            out.append(move_to_device(self._next_raw(), self._device))
            self.consumed += 1
        return out

    def skip(self, count: int) -> None:
        for _ in range(count):
            self._next_raw()
            self.consumed += 1


def preflight(setup: TrainSetup, feed: BatchFeed, device: torch.device, dtype: str, script: Path) -> None:
    """Run loss_fn once on the first batch, before any file exists, so a broken script exits 2.

    RNG and train/eval modes are put back, and eval mode keeps BatchNorm statistics unchanged, so
    the run starts exactly as it would have without this check. Compiled code runs eagerly here:
    the first compile then happens at step 0, with the probes' hooks in place to be traced.
    """
    try:
        batch = feed.peek()
    except ScriptError:
        raise ScriptError(f"'batches' from {script.name} is empty") from None
    modes = [(m, m.training) for m in setup.model.modules()]
    setup.model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), eagerly():
            enabled = precision.uses_autocast(dtype)
            with torch.autocast(device.type, dtype=precision.torch_dtype(dtype), enabled=enabled):
                check_loss(setup.loss_fn(original_module(setup.model), batch))
    except LossError as exc:
        raise ScriptError(f"{script.name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's code failed: say where
        raise ScriptError(f"loss_fn in {script.name} failed on the first batch: "
                          f"{describe_exception(exc, script)}") from None
    finally:
        for module, mode in modes:
            module.training = mode
        setup.optimizer.zero_grad(set_to_none=True)


class Run:
    """Owns the trainer and the session; `run()` is the loop (call it on the training thread)."""

    def __init__(self, config: RunConfig, setup: TrainSetup, device: torch.device, feed: BatchFeed):
        if config.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"--on-nonfinite must be one of {', '.join(NONFINITE_POLICIES)}")
        self.config = config
        self.setup = setup
        self.device = device
        self.feed = feed
        setup.model.to(device)
        self.trainer = GuardedTrainer(
            setup.model, setup.optimizer, setup.loss_fn, device=device, dtype=config.dtype,
            init_scale=config.init_scale, scheduler=setup.scheduler,
            max_grad_norm=setup.max_grad_norm, probe_every=config.probe_every,
            underflow_every=config.underflow_every)
        self.accumulate = setup.accumulate
        self.guard = PrecisionGuard(config.guard)
        self.local_fp32 = LocalFp32(setup.model, device.type)
        for pattern in config.fp32_modules:
            self.local_fp32.add(pattern)  # ModuleMatchError names a pattern that matches nothing
        self.commands = CommandQueue()
        self.observers: list[Callable[[dict], None]] = []
        self.state = "starting"
        self.exit_status = EXIT_OK
        self.last_result: StepResult | None = None
        self.error: str | None = None
        self.run_dir = config.run_dir or default_run_dir(config.script)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.session_path = self.run_dir / "session.jsonl"
        self._writer: SessionWriter | None = None
        self._scheduled: dict[int, list[Command]] = {}
        for step, command in config.at:
            self._scheduled.setdefault(step, []).append(command)
        self._stop_requested = threading.Event()
        self._checkpoint_on_stop = False
        self._stop_reason: str | None = None
        self._session_failed = False
        self._control = None
        self._single_steps = 0
        self.nonfinite_events = 0
        self._act_unmeasured_said = False
        self.started_at = time.time()

    # ---- public, thread-safe ------------------------------------------------------------
    def submit(self, command: Command) -> None:
        self.commands.submit(command)

    def request_stop(self, *, checkpoint: bool = False, reason: str | None = None) -> None:
        """Stop at the next step boundary (from any thread, e.g. a signal handler); with
        `checkpoint`, save one first (an SSH drop must not lose the run's progress)."""
        if checkpoint:
            self._checkpoint_on_stop = True
        if reason and self._stop_reason is None:
            self._stop_reason = reason
        self._stop_requested.set()
        self.commands.wakeup.set()

    @property
    def step(self) -> int:
        return self.trainer.step_index

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
        }

    def _emit(self, record: dict) -> None:
        if self._writer is not None and not self._writer.closed:
            try:
                self._writer.write(record)
                self._session_failed = False
            except OSError as exc:
                self._on_io_error(f"could not append to {self.session_path}: {exc.strerror or exc}")
        for observer in list(self.observers):
            try:
                observer(record)
            except Exception:  # noqa: BLE001 - a broken observer must not stop training
                traceback.print_exc(file=sys.stderr)

    def _on_io_error(self, message: str) -> None:
        """The session can't be appended to (a full disk...): tell the observers, then halt.
        The records stay pending in the writer and reach the file once it takes them again."""
        if self._session_failed and (self.state == "paused" or self._stop_requested.is_set()):
            return  # already reported; the run is paused or stopping
        self._session_failed = True
        record = event_record(self.step, "error", message, during="io")
        with contextlib.suppress(OSError):
            self._writer.write(record)   # kept pending: the recording says why, once it can
        for observer in list(self.observers):
            with contextlib.suppress(Exception):
                observer(record)
        self._halt_for_io(message)

    def _halt_for_io(self, message: str) -> None:
        """Keep what is written; pause (dashboard) or stop with a non-zero status (headless)."""
        self.error = message
        if self.config.on_io_error == "pause":
            self._single_steps = 0
            self._set_state("paused")
            self.event("paused", "paused: the disk refused a write; free some space, then resume "
                       "(the records kept meanwhile are written then)", reason="io")
        else:
            self.exit_status = EXIT_ERROR
            self._stop_requested.set()

    def event(self, kind: str, message: str, *, step: int | None = None, **fields: Any) -> dict:
        record = event_record(self.step if step is None else step, kind, message, **fields)
        self._emit(record)
        return record

    def open(self) -> None:
        """Create the run directory and write the header (or, resuming, append to the session)."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        ckpt.cleanup_temporary_files(self.checkpoint_dir)
        header = self.header()
        resuming = self.config.resume_from is not None
        self._writer = SessionWriter(self.session_path, header, append=resuming)
        for observer in list(self.observers):
            observer({"type": "header", **header})
        if resuming:
            self._resume(self.config.resume_from)
        if self.config.control:
            from amp_tui.control import ControlServer
            self._control = ControlServer(self, self.run_dir)
            self._control.start()

    def _resume(self, path: Path) -> None:
        """Continue a crashed or stopped run from a checkpoint; the step counter goes on from the
        last recorded step, like a restore, so the recording stays one forward timeline."""
        from amp_tui.session import read_session
        previous = read_session(self.session_path)
        last_step = max((r["step"] for r in previous.steps), default=-1)
        t = self.trainer
        loaded = ckpt.read_checkpoint(path, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
        loaded.apply(t.model, t.optimizer, t.scheduler)
        t.restore_scaler(loaded.scaler_state)
        extra = loaded.extra or {}
        t.updates_applied = int(extra.get("updates_applied", 0))
        t.skipped_total = int(extra.get("skipped_total", 0))
        t.step_index = last_step + 1
        self.feed.skip(int(extra.get("micro_batches_consumed", 0)))  # same data order as before
        self.event("resumed", f"resumed from {self._rel(path)} (saved at step {loaded.step}, "
                   f"{loaded.dtype}) after the recording's step {last_step}; the step counter goes "
                   f"on from {t.step_index}", path=self._rel(path), checkpoint_step=loaded.step,
                   checkpoint_dtype=loaded.dtype, previous_last_step=last_step)

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> int:
        if self._writer is None:
            try:
                self.open()
            except (OSError, ckpt.CheckpointError, ValueError) as exc:
                # No session to write to: tell the observers (the dashboard) and give up cleanly.
                message = f"could not start the run in {self.run_dir}: {exc}"
                self.error, self.exit_status = message, EXIT_ERROR
                self._set_state("error")
                for observer in list(self.observers):
                    with contextlib.suppress(Exception):
                        observer(event_record(self.step, "error", message, during="step", traceback=""))
                self.close()
                return self.exit_status
        self._set_state("running")
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - recorded, then the session is closed cleanly
            self._record_failure(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self.close()
        return self.exit_status

    def _loop(self) -> None:
        cfg = self.config
        while True:
            for command in self._scheduled.pop(self.step, []):
                self._apply(command)
            for command in self.commands.drain():
                self._apply(command)
            if self._stop_requested.is_set():
                if self._stop_reason:
                    self.event("stopping", f"stopping: {self._stop_reason}", reason=self._stop_reason)
                if self._checkpoint_on_stop:
                    self._save_checkpoint(source=self._stop_reason or "stop")
                if self.state not in ("error",):
                    self._set_state("stopped")
                return
            if cfg.steps is not None and self.step >= cfg.steps:
                self._set_state("finished")
                return
            if self.state == "paused" and self._single_steps == 0:
                self.commands.wait(0.25)
                continue
            if self._single_steps:
                self._single_steps -= 1
            self._one_step()
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self._save_checkpoint(source="checkpoint_every")

    def _one_step(self) -> None:
        step = self.step
        micro = self.feed.take(self.accumulate)
        try:
            result = self.trainer.step(micro)
        except (LossError, ScriptError) as exc:
            raise StepFailure(step, f"step {step}: {exc}", exc) from exc
        except Exception as exc:  # noqa: BLE001
            where = describe_exception(exc, self.config.script)
            raise StepFailure(step, f"step {step}: the script raised {where}", exc) from exc
        self.last_result = result
        self._emit(step_record(result))
        if self.trainer.act_unmeasured and not self._act_unmeasured_said:
            self._act_unmeasured_said = True
            self.event("alert", self.trainer.act_unmeasured, step=result.step, reason="act_not_measured",
                       cause="the compiled graph was built before amp-tui attached its hooks",
                       fix="leave the first call of the compiled model to amp-tui (none in setup())")
        if result.nonfinite:
            self._on_nonfinite(result)
        self._apply_guards(result)

    def _apply_guards(self, result: StepResult) -> None:
        t = self.trainer
        bf16_ok = precision.unsupported_reason(self.device, "bfloat16") is None
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
        if result.nonfinite == "loss":
            where = f"; first non-finite output: {layer}" if layer else ""
            if diagnosis is not None and diagnosis.input_nonfinite:
                where += " (its input was already non-finite)"
            msg = f"non-finite loss ({number(result.loss, 4)}) in {precision.SHORT[result.dtype]}{where}: update skipped"
        else:
            where = f"; first non-finite gradient: {layer}" if layer else ""
            if result.scale is not None:
                msg = (f"gradients overflowed at scale {result.scale:g}{where}: update skipped, "
                       f"scale now {self.trainer.scale:g}")
            else:
                msg = f"non-finite gradients in {precision.SHORT[result.dtype]}{where}: update skipped"
        self.event("nonfinite", msg, step=result.step, where=result.nonfinite, layer=layer,
                   loss=encode_float(result.loss), scale=result.scale, dtype=result.dtype,
                   **(diagnosis.as_fields() if diagnosis is not None else {}))
        if result.nonfinite != "loss":
            return
        policy = self.config.on_nonfinite  # "skip" and "fallback" just go on (the guard decides)
        if policy == "pause" and self.state == "running":
            self._single_steps = 0
            self._set_state("paused")
            self.event("paused", f"paused after a non-finite loss at step {result.step} "
                                 "(--on-nonfinite pause): change the dtype, cut the scale or restore",
                       reason="nonfinite")
        elif policy == "stop":
            self.exit_status = EXIT_NONFINITE_STOP
            self._stop_requested.set()
            self.event("stopping", f"stopping after a non-finite loss at step {result.step} "
                                   "(--on-nonfinite stop)", reason="nonfinite")

    # ---- commands -----------------------------------------------------------------------
    def _apply(self, command: Command) -> None:
        try:
            outcome = self._dispatch(command)
        except Exception as exc:  # noqa: BLE001 - a refused command never stops the run
            outcome = Outcome(False, f"{command.text()} failed: {exc}")
            self.event("error", outcome.message, during=command.action, source=command.source)
        if command.on_done is not None:
            command.on_done(outcome)

    def _intervention(self, command: Command, before: dict, after: dict, message: str) -> Outcome:
        who = {"client": command.client} if command.client else {}
        self.event("intervention", message, action=command.action, value=_json_value(command.value),
                   source=command.source, before=before, after=after, **who)
        return Outcome(True, message)

    def status(self) -> dict:
        """A snapshot for `amp-tui ctl RUN status` (read from another thread: plain values only)."""
        t, r = self.trainer, self.last_result
        return {"state": self.state, "step": self.step, "steps": self.config.steps, "dtype": t.dtype,
                "scale": t.scale, "updates": t.updates_applied, "skipped": t.skipped_total,
                "loss": encode_float(r.loss) if r is not None else None, "pid": os.getpid(),
                "run_dir": str(self.run_dir), "script": str(self.config.script)}

    def status_line(self) -> str:
        s = self.status()
        scale = "-" if s["scale"] is None else f"{s['scale']:g}"
        total = f"/{s['steps']}" if s["steps"] else ""
        return (f"{s['state']} at step {s['step']}{total}: {precision.SHORT[s['dtype']]}, scale {scale}, "
                f"{s['updates']} updates applied, {s['skipped']} skipped, loss {s['loss']}")

    def _dispatch(self, command: Command) -> Outcome:
        action = command.action
        if action == "dtype":
            try:
                change = self.trainer.set_dtype(str(command.value))
            except PrecisionRefused as exc:
                self.event("error", f"dtype change refused: {exc}", during="dtype", source=command.source)
                return Outcome(False, str(exc))
            b, a = change["before"], change["after"]
            return self._intervention(command, b, a, f"dtype {precision.SHORT[b['dtype']]} → "
                                      f"{precision.SHORT[a['dtype']]}" + _scale_note(a))
        if action == "scale":
            try:
                change = self.trainer.set_scale(command.value)
            except PrecisionRefused as exc:
                self.event("error", f"scale change refused: {exc}", during="scale", source=command.source)
                return Outcome(False, str(exc))
            b, a = change["before"], change["after"]
            if b["scale"] is not None:
                text = f"loss scale {b['scale']:g} → {a['scale']:g}"
            else:
                text = (f"fp16 loss scale {b['fp16_scale']:g} → {a['fp16_scale']:g} "
                        f"(used when fp16 is next entered)")
            return self._intervention(command, b, a, text)
        if action == "save":
            info = self._save_checkpoint(source=command.source)
            if info is None:
                return Outcome(False, "checkpoint not saved (see the error event)")
            return self._intervention(command, {}, {"checkpoint": self._rel(info.path)},
                                      f"checkpoint saved: {self._rel(info.path)}")
        if action == "restore":
            return self._restore(command)
        if action == "fp32":
            return self._toggle_fp32(command)
        if action in ("pause", "resume", "step"):
            before = {"state": self.state}
            if action == "pause":
                self._single_steps = 0
                self._set_state("paused")
            elif action == "resume":
                self._single_steps = 0
                self._set_state("running")
            else:
                if self.state != "paused":
                    return Outcome(False, "single step works while paused (press space first)")
                self._single_steps += 1
            text = {"pause": "paused", "resume": "resumed", "step": f"single step {self.step}"}[action]
            return self._intervention(command, before, {"state": self.state}, text)
        if action == "stop":
            self._intervention(command, {"state": self.state}, {"state": "stopped"}, "stop requested")
            self._stop_requested.set()
            return Outcome(True, "stopping at this step boundary")
        return Outcome(False, f"unknown command {action!r}")

    def _toggle_fp32(self, command: Command) -> Outcome:
        pattern = str(command.value)
        before = {"fp32_modules": self.local_fp32.names}
        try:
            from amp_tui.local_fp32 import match_modules
            already = set(match_modules(self.trainer.model, pattern)) & set(self.local_fp32.names)
            changed = self.local_fp32.remove(pattern) if already else self.local_fp32.add(pattern)
        except ModuleMatchError as exc:
            self.event("error", str(exc), during="fp32", source=command.source)
            return Outcome(False, str(exc))
        verb = "back to autocast" if already else "now in fp32"
        return self._intervention(command, before, {"fp32_modules": self.local_fp32.names},
                                  f"{', '.join(changed) or pattern} {verb}")

    def _set_state(self, state: str) -> None:
        self.state = state

    def _rel(self, path: Path) -> str:
        try:
            return str(Path(path).relative_to(self.run_dir))
        except ValueError:
            return str(path)

    # ---- checkpoints --------------------------------------------------------------------
    def _save_checkpoint(self, *, source: str) -> ckpt.CheckpointInfo | None:
        t = self.trainer
        path = ckpt.checkpoint_path(self.checkpoint_dir, self.step)
        started = time.perf_counter()
        try:
            info = ckpt.save_checkpoint(
                path, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler,
                scaler_state=t.scaler_state(), step=self.step, dtype=t.dtype,
                extra={**t.checkpoint_extra(), "micro_batches_consumed": self.feed.consumed})
        except ckpt.CheckpointError as exc:
            self.event("error", str(exc), during="save", source=source)
            if isinstance(exc.__cause__, OSError):  # a full disk, not a bad model state
                self._halt_for_io(str(exc))
            return None
        size = os.path.getsize(info.path)
        self.event("checkpoint_saved", f"checkpoint {self._rel(info.path)} saved at step {self.step} "
                   f"({size / 1e6:.1f} MB, {time.perf_counter() - started:.2f}s)",
                   path=self._rel(info.path), checkpoint_step=self.step, dtype=t.dtype, bytes=size,
                   source=source)
        return info

    def checkpoints(self) -> list[ckpt.CheckpointInfo]:
        return ckpt.list_checkpoints(self.checkpoint_dir)

    def _restore(self, command: Command) -> Outcome:
        target = str(command.value or "latest")
        if target == "latest":
            found = self.checkpoints()
            if not found:
                self.event("error", "restore refused: this run has no checkpoint yet", during="restore",
                           source=command.source)
                return Outcome(False, "no checkpoint yet")
            path = found[0].path
        else:
            path = Path(target).expanduser()
            if not path.is_absolute() and not path.exists() and (self.run_dir / path).exists():
                path = self.run_dir / path
        t = self.trainer
        try:
            loaded = ckpt.read_checkpoint(path, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
        except ckpt.CheckpointError as exc:
            self.event("error", f"restore refused: {exc}", during="restore", source=command.source,
                       path=str(path))
            return Outcome(False, str(exc))
        before = t.describe_precision()
        loaded.apply(t.model, t.optimizer, t.scheduler)
        t.restore_scaler(loaded.scaler_state)
        after = t.describe_precision()
        ck_step = loaded.step
        note = f" ({loaded.notice})" if loaded.notice else ""
        saved = f"saved at step {ck_step}, {loaded.dtype}" if ck_step is not None else "weights only"
        message = (f"restored {self._rel(path)} ({saved}) before step {self.step}; the step counter "
                   f"goes on from {self.step}{note}")
        self.event("checkpoint_restored", message, path=self._rel(path), checkpoint_step=ck_step,
                   checkpoint_dtype=loaded.dtype, checkpoint_kind=loaded.kind, source=command.source,
                   before=before, after=after)
        return Outcome(True, message)

    # ---- ending -------------------------------------------------------------------------
    def _record_failure(self, exc: BaseException) -> None:
        if isinstance(exc, StepFailure):
            message, original, step = exc.message, exc.original, exc.step
        elif isinstance(exc, KeyboardInterrupt):
            self._set_state("stopped")
            self.event("stopping", "interrupted", reason="interrupt")
            return
        else:
            message, original, step = f"{type(exc).__name__}: {exc}", exc, self.step
        tb = "".join(traceback.format_exception(type(original), original, original.__traceback__))
        self.error = message
        self.exit_status = EXIT_ERROR
        self._set_state("error")
        self.event("error", message, step=step, during="step", traceback=tb[-20000:])

    def close(self) -> None:
        self.trainer.close()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._writer is None or self._writer.closed:
            return
        status = {"finished": "finished", "stopped": "stopped", "error": "error"}.get(self.state, "stopped")
        t = self.trainer
        end = {"step": self.step, "status": status, "updates": t.updates_applied,
               "skipped_total": t.skipped_total, "dtype": t.dtype, "scale": t.scale,
               "time": round(time.time(), 3), "exit_status": self.exit_status}
        with contextlib.suppress(OSError):
            self._writer.close(end)
        for observer in list(self.observers):
            with contextlib.suppress(Exception):
                observer({"type": "end", **end})


class StepFailure(Exception):
    def __init__(self, step: int, message: str, original: BaseException):
        super().__init__(message)
        self.step, self.message, self.original = step, message, original


def _json_value(v):
    return encode_float(v) if isinstance(v, float) else v


def _scale_note(after: dict) -> str:
    return f" (scale {after['scale']:g})" if after.get("scale") is not None else ""
