"""amp-tui inside the user's own training loop.

    monitor = amp_tui.monitor(model, optimizer, scaler=scaler, scheduler=scheduler)
    for batch in loader:
        with monitor.step() as step:            # a step boundary: queued commands apply here
            with monitor.autocast():             # the dtype in force, which the dashboard switches
                loss = compute_loss(model, batch)
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            ...
            scaler.step(optimizer)
            scaler.update()
        if monitor.should_stop:
            break
    monitor.close()

The monitor records the same session as `amp-tui train` and serves the same control socket, so
`amp-tui attach RUN_DIR` shows the dashboard and its keys steer the loop at step boundaries. It
never drives the loop: it watches it through hooks on the user's own objects, and they are left
as they were on `close()`.

- Gradients are read where they are true: right after GradScaler's `unscale_` (called by the user
  or by `scaler.step`), or in the optimizer's step pre-hook when there is no scaler; a fused
  optimizer stepped with still-scaled gradients has its figures divided by the scale on the host.
  So where the loop calls `zero_grad` doesn't matter, and a step GradScaler skipped (it never calls
  `optimizer.step()`) is measured like the others.
- A step is skipped when GradScaler found an inf/NaN at `scaler.step` (its own decision: right for
  fused optimizers too, which are stepped anyway). Without a scaler nothing skips: the loop
  applies every update, and a non-finite gradient is recorded as such.
- One step of the monitor is one update attempt: `monitor.step()` blocks that end without one
  (gradient accumulation) are folded into the next, and commands apply only between updates.
- Everything measured stays on the device until the step's end, which brings it to the host in
  one transfer with the loss.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

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
from amp_tui.job.distributed import Ranks
from amp_tui.job.handlers import SharedHandlers
from amp_tui.job.recorder import Observers, RankEcho, Recorder
from amp_tui.recording.format import event_record, step_record
from amp_tui.recording.report import describe_records
from amp_tui.training import checkpoint as ckpt
from amp_tui.training.autocast import autocast, torch_dtype, unsupported_reason
from amp_tui.training.compiled import compiled_module_names, original_module
from amp_tui.training.devices import describe_device
from amp_tui.training.engine import PrecisionRefused, StepResult
from amp_tui.training.forward_autocast import ForwardAutocast, wrapped_in_autocast
from amp_tui.training.guards import GuardConfig, PrecisionGuard
from amp_tui.training.local_fp32 import LocalFp32
from amp_tui.training.probes import LayerProbe

RUN_DIR_VARIABLE = "AMP_TUI_RUN_DIR"   # set by `amp-tui run`: where the monitor records
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
PUBLISH_INTERVAL = 0.1   # seconds: the most a measured step waits to be recorded (see _publish)

_current: Monitor | None = None        # one monitor per process: it owns the control socket
_current_lock = threading.Lock()


class MonitorError(RuntimeError):
    """The monitor was used in a way it can't follow; the message says what to change."""


class _Attempt:
    """What one update attempt saw, from its first hook to the step's end."""

    __slots__ = ("gradients", "scaled", "found_inf", "stepped", "scale", "lr")

    def __init__(self, scale: float | None, lr: float | None):
        self.gradients = False   # the gradients were measured (or there was nothing to measure)
        self.scaled = False      # ... while they still carried the loss scale
        self.found_inf: torch.Tensor | None = None   # GradScaler's verdict, on the device
        self.stepped = False     # optimizer.step() ran
        self.scale = scale       # the loss scale this attempt's backward used
        self.lr = lr


class MonitoredStep:
    """What `with monitor.step() as step:` hands the loop: set `step.loss` to the loss tensor."""

    def __init__(self) -> None:
        self.loss: Any = None


def monitor(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scaler=None, scheduler=None,
            dtype: str | None = None, run_dir: str | Path | None = None, probe_every: int = 1,
            underflow_every: int = 10, checkpoint_every: int | None = None, control: bool = True,
            announce: bool = True, tensorboard_dir: str | Path | None = None) -> Monitor:
    """Watch the user's own loop; see the module docstring (and docs/user-guide.md, "Your own loop").

    `dtype`: what `monitor.autocast()` applies to start with (fp16, bf16, fp32); by default fp16
    when an enabled GradScaler is given, else bf16 where the device has it (fp32 otherwise).
    `run_dir`: where the session goes (default: $AMP_TUI_RUN_DIR, set by `amp-tui run`, or
    runs/<time>-<script>). `announce`: print one line saying how to attach. `tensorboard_dir`:
    also write the recording there as TensorBoard event files, live (pip install
    'amp-tui[tensorboard]')."""
    return Monitor(model, optimizer, scaler=scaler, scheduler=scheduler, dtype=dtype, run_dir=run_dir,
                   probe_every=probe_every, underflow_every=underflow_every,
                   checkpoint_every=checkpoint_every, control=control, announce=announce,
                   tensorboard_dir=tensorboard_dir)


class Monitor(SharedHandlers):
    def __init__(self, model, optimizer, *, scaler=None, scheduler=None, dtype=None, run_dir=None,
                 probe_every=1, underflow_every=10, checkpoint_every=None, control=True, announce=True,
                 tensorboard_dir=None, framework: str | None = None):
        _check_objects(model, optimizer, scaler, scheduler)
        # A framework's callback drives this monitor (amp_tui.integrations): it opens and ends the
        # steps from its hooks, and the dtype it starts with is the framework's choice, recorded
        # as it is (fp16 without a GradScaler included, which the callback warns about).
        self.framework = framework
        self.model = model
        self.optimizer = _inner_optimizer(optimizer)
        # The scaler the loop calls (maybe disabled: bf16 and fp32 loops often keep one with
        # enabled=False), and the one that scales (None: no loss scaling in this loop).
        self.loop_scaler = scaler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.scheduler = scheduler
        self.device = _device_of(model)
        self._bf16_ok = unsupported_reason(self.device, "bfloat16") is None
        self.dtype = self._starting_dtype(dtype)
        self.probe_every = max(1, int(probe_every))
        self.underflow_every = max(1, int(underflow_every))
        self.checkpoint_every = checkpoint_every
        self.script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else Path("python")
        # A loop under torchrun: rank 0 records and serves the socket, every rank agrees at the
        # boundaries (job/distributed.py).
        self.ranks = Ranks.of_loop(model)
        self.run_dir = Path(run_dir or os.environ.get(RUN_DIR_VARIABLE) or default_run_dir(self.script))
        if self.ranks:
            self.run_dir = Path(self.ranks.share(str(self.run_dir)))
        main = not self.ranks or self.ranks.is_main
        self.session_path = self.run_dir / "session.jsonl"
        eager = original_module(model)
        self.compiled_modules = compiled_module_names(model)
        self.probe = LayerProbe(eager, keep_hooks=bool(self.compiled_modules))
        self.local_fp32 = LocalFp32(eager, self.device.type)
        self.guard = PrecisionGuard(GuardConfig())
        self.commands = CommandQueue()
        self.recorder = (Recorder(self.session_path, on_refused=self._disk_refused) if main
                         else RankEcho(self.session_path, prefix=self.ranks.describe()))
        self.checkpointing = RunCheckpoints(self)
        self.trainer = self   # what the checkpoints save and restore (TrainingState)
        self._handlers: dict[str, Handler] = {
            "dtype": self._set_dtype, "scale": self._set_scale, "save": self._save,
            "restore": self.checkpointing.restore, "fp32": self._toggle_fp32, "pause": self._pause,
            "resume": self._resume, "step": self._single_step, "stop": self._stop,
        }
        self.state: RunState = "starting"
        self.step_index = 0
        self.updates_applied = 0
        self.skipped_total = 0
        self.nonfinite_events = 0
        self.exit_status = 0
        self.error: str | None = None
        self.last_loss: float | None = None
        self.last_skipped = False   # the last update was skipped (a scheduler stepped only after
                                    # applied updates reads this)
        self._scale_value = self.scaler.get_scale() if self.scaler is not None else None
        self._starting_scale = self._scale_value
        self._fp16_scale = self._scale_value   # what fp16 takes up again after bf16/fp32
        self._single_steps = 0
        self._stop_requested = threading.Event()
        self._checkpoint_on_stop = False
        self._stop_reason: str | None = None
        self.should_stop = False
        self._open_step: MonitoredStep | None = None
        self._open_block: AbstractContextManager | None = None   # begin_step()'s, until end_step()
        self._forward_autocast: ForwardAutocast | None = None
        self._released = False   # the last boundary let the loop go on (resumed, or not paused)
        self._pending_losses: list[torch.Tensor] = []   # micro-steps folded into the next update
        self._unpublished: list[StepResult] = []        # measured, not yet recorded (_publish)
        self._published_at = time.monotonic()
        self._step_started: float | None = None
        self._attempt: _Attempt | None = None            # what the current update attempt saw
        self._autocast_used = False                      # monitor.autocast() entered this step
        self._autocast_used_last = None                  # ... in the last update (None: none yet)
        self._disk_said = False
        self._closed = False
        self._control = None
        self._handles: list = []
        self._patched: list[str] = []
        self._previous_signals: dict = {}
        if tensorboard_dir is not None and main:   # before anything is made: a missing package
            self.recorder.observers.append(_tensorboard_observer(Path(tensorboard_dir)))
        _claim(self)
        try:
            self._attach_hooks()
            if wrapped_in_autocast(model) is not None:
                # Accelerate's prepare() fixed the forward's autocast: put it under ours, so that
                # the dtype in force is what runs (and `d` switches it).
                self.autocast_forward(wrapped_in_autocast(model))
            if self.ranks:   # a rank's step time ends with its forward, before DDP's all-reduce
                self._handles.append(model.register_forward_hook(self.ranks.forward_done))
            if main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self.checkpointing.folder.mkdir(parents=True, exist_ok=True)
                ckpt.cleanup_temporary_files(self.checkpointing.folder)
            self.recorder.open(self._header(), append=False, flush_interval=1.0)
            if control and main:
                from amp_tui.job.control import ControlServer
                self._control = ControlServer(self, self.run_dir)
                self._control.start()
        except BaseException:
            self._detach_hooks()
            _release(self)
            raise
        self._install_signal_handlers()
        atexit.register(self._close_at_exit)
        self.state = "running"
        if announce and main:
            print(f"amp-tui: recording this loop to {self.run_dir} ({precision.SHORT[self.dtype]}); "
                  f"watch and steer it with: amp-tui attach {self.run_dir}", file=sys.stderr, flush=True)

    # ---- the loop's side -----------------------------------------------------------------
    def step(self) -> AbstractContextManager[MonitoredStep]:
        """One step of the loop: commands queued meanwhile apply on entry (a pause holds here)."""
        return self._step()

    @contextmanager
    def _step(self) -> Iterator[MonitoredStep]:
        if self._closed:
            raise MonitorError("monitor.step() after monitor.close(): the monitor is closed")
        if self._open_step is not None:
            raise MonitorError("monitor.step() inside another monitor.step(): close the first one "
                               "(one `with monitor.step() as step:` block per step, not nested)")
        if not self._pending_losses:      # between updates: the boundary where commands apply
            # The update before ended at a boundary already (which held the loop while paused):
            # hold here only before the first update, or for a pause asked for since.
            paused_before = self.state == "paused"
            self._boundary(hold=False)
            if not self._released or (self.state == "paused" and not paused_before):
                self._boundary(hold=True)
            self._released = False
        step = self._open_step = MonitoredStep()
        if self._step_started is None:
            self._step_started = time.perf_counter()
            self._autocast_used = False
            if self._probing():
                self.probe.begin()
        try:
            yield step
        except BaseException as exc:
            self._open_step = None
            self._failed(exc)
            raise
        self._open_step = None
        self._end_of_block(step)

    def autocast(self, *, cache_enabled: bool | None = None) -> AbstractContextManager:
        """`torch.autocast` in the dtype in force now (fp32: off); `d` in the dashboard switches it.
        `cache_enabled`: torch.autocast's (None: torch's default)."""
        self._autocast_used = True
        if cache_enabled is None:
            return autocast(self.device.type, self.dtype)
        return torch.autocast(self.device.type, dtype=torch_dtype(self.dtype),
                              enabled=precision.uses_autocast(self.dtype), cache_enabled=cache_enabled)

    # ---- for a framework's callback (amp_tui.integrations) -------------------------------------
    def begin_step(self) -> MonitoredStep:
        """`with monitor.step()` split in two, for a framework whose hooks start and end a step:
        queued commands apply here (a pause holds here). End it with `end_step(loss)`, or
        `fail_step(exc)` when it raised."""
        block = self._step()
        step = block.__enter__()
        self._open_block = block
        return step

    def end_step(self, loss: Any) -> None:
        """The end of the step `begin_step()` opened, whose loss tensor is `loss`. None: the
        framework ran no loss in it (nothing is recorded, micro-batches folded so far included)."""
        block, self._open_block = self._open_block, None
        if block is None:
            raise MonitorError("end_step() without begin_step(): open the step first")
        if loss is None:
            block.__exit__(GeneratorExit, GeneratorExit(), None)   # let go without a record
            return
        self._open_step.loss = loss
        block.__exit__(None, None, None)

    def fail_step(self, exc: BaseException) -> None:
        """The framework's step (or its loop between steps) raised `exc`: recorded with its
        traceback, the run ends in error; the caller re-raises it."""
        block, self._open_block = self._open_block, None
        if block is not None:
            block.__exit__(type(exc), exc, exc.__traceback__)
        elif self.state != "error":
            self._failed(exc)

    def gradients_ready(self) -> None:
        """The framework's hook between the backward and the update (Lightning's
        on_before_optimizer_step): without a GradScaler, the gradients are read here. An optimizer
        stepped with a closure only has them once the closure ran inside its step(), after the
        step's pre-hook. With a GradScaler they are read at its unscale_ (or step) already."""
        if self._open_step is not None and self.scaler is None:
            self._gradients_seen(scaled=False)

    def refuse(self, action: str, reason: str) -> None:
        """Turn a command off in this loop: from now on it is refused with `reason` (say what owns
        what it would change, e.g. an engine that owns the loss scale)."""
        self._handlers[action] = lambda command: self._refused(command, reason)

    def autocast_forward(self, module: torch.nn.Module) -> None:
        """Run `module`'s forward under `monitor.autocast()` from now on (in place of the fixed
        autocast Accelerate's prepare() wrapped it in, if any), so that `d` switches what the
        forward runs in; undone on close()."""
        if self._forward_autocast is None:
            self._forward_autocast = ForwardAutocast(module, self.autocast, lambda: self.dtype != "float32")

    def close(self) -> None:
        """End the recording (the end record says how the loop ended) and leave the user's objects
        as they were: no hooks, no patched methods, no signal handlers of ours."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        if self.ranks:
            self.ranks.voting = False   # no boundary after the last one: stops are this rank's own
        if self._open_step is not None:
            self.error = self.error or "monitor.close() inside monitor.step(): that step is not recorded"
        if self.state not in ("error", "stopped"):
            self.state = "stopped" if self.should_stop else "finished"
        self._detach_hooks()
        self._restore_signal_handlers()
        self.probe.detach()
        for command in self.commands.drain():   # asked for after the last step: never applied
            if command.on_done is not None:
                command.on_done(Outcome(False, "the loop ended before applying it"))
        self._publish()
        end = {"step": self.step_index, "status": end_status(self.state), "updates": self.updates_applied,
               "skipped_total": self.skipped_total, "dtype": self.dtype, "scale": self._scale(),
               "time": round(time.time(), 3), "exit_status": self.exit_status}
        try:
            self.recorder.finish(end)
        except OSError as exc:
            lost = self.recorder.give_up(end)
            print(f"amp-tui: error: {exc.strerror or exc}: {self.session_path}: "
                  f"{describe_records(lost)} could not be written", file=sys.stderr, flush=True)
        finally:
            if self._control is not None:
                self._control.close()
                self._control = None
            _release(self)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, GeneratorExit)) \
                and self.state != "error":
            self._failed(exc)
        self.close()

    # ---- for the control socket and the dashboard -----------------------------------------
    def submit(self, command: Command) -> None:
        self.commands.submit(command)

    def request_stop(self, *, checkpoint: bool = False, reason: str | None = None) -> None:
        """Stop at the next step boundary (`should_stop` turns True); with `checkpoint`, save one."""
        if self.ranks and self.ranks.voting:   # every rank stops at the boundary that agrees on it
            self.ranks.vote_stop(checkpoint=checkpoint, reason=reason)
            self.commands.wakeup.set()
            return
        if checkpoint:
            self._checkpoint_on_stop = True
        if reason and self._stop_reason is None:
            self._stop_reason = reason
        self._stop_requested.set()
        self.commands.wakeup.set()

    def status(self) -> dict:
        return {"state": self.state, "step": self.step_index, "steps": None, "dtype": self.dtype,
                "scale": self._scale(), "updates": self.updates_applied, "skipped": self.skipped_total,
                "loss": encode_float(self.last_loss), "pid": os.getpid(), "run_dir": str(self.run_dir),
                "script": str(self.script), **(self.ranks.header_fields() if self.ranks else {})}

    def checkpoints(self) -> list[ckpt.CheckpointInfo]:
        return self.checkpointing.list()

    # ---- what the checkpoints save and restore (TrainingState) ------------------------------
    def scaler_state(self) -> dict | None:
        return dict(self.scaler.state_dict()) if self.scaler is not None else None

    def restore_scaler(self, state: dict | None) -> None:
        """The checkpoint's scaler state into the loop's scaler; away from fp16 its scale is kept
        for fp16's return (the scaler scales by 1 meanwhile, see _set_dtype)."""
        if state is None or self.scaler is None:
            return
        if self.dtype == "float16":
            self.scaler.load_state_dict(dict(state))
            self._scale_value = float(state["scale"])
        else:
            self._fp16_scale = float(state["scale"])
            self.scaler.load_state_dict({**dict(state), "scale": 1.0})
            self._scale_value = 1.0

    def checkpoint_extra(self) -> dict:
        return {"updates_applied": self.updates_applied, "skipped_total": self.skipped_total}

    def saved_extra(self) -> dict:
        return {}

    def describe_precision(self) -> dict:
        scale = self._scale()
        fp16 = scale if self.dtype == "float16" else self._fp16_scale
        return {"dtype": self.dtype, "scale": scale, "init_scale": self._starting_scale, "fp16_scale": fp16}

    def discard_started_step(self) -> None:
        """Nothing runs ahead in the user's loop."""

    # ---- recording -------------------------------------------------------------------------
    @property
    def observers(self) -> Observers:
        return self.recorder.observers

    def event(self, kind: str, message: str, *, step: int | None = None, **fields: Any) -> dict:
        self._publish()   # the steps before it first, in the order they happened
        record = event_record(self.step_index if step is None else step, kind, message, **fields)
        self.recorder.emit(record)
        return record

    def _header(self) -> dict:
        return {
            "amp_tui_version": amp_tui.__version__,
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "device": describe_device(self.device),
            "script": str(self.script),
            "argv": list(sys.argv[1:]),
            "command": [sys.executable, *sys.argv],
            "dtype": self.dtype,
            "init_scale": self._scale_value,
            "steps": None,
            "accumulate": None,
            "max_grad_norm": None,
            "probe_every": self.probe_every,
            "underflow_every": self.underflow_every,
            "on_nonfinite": "skip",
            "checkpoint_every": self.checkpoint_every,
            "optimizer": type(self.optimizer).__name__,
            "scheduler": type(self.scheduler).__name__ if self.scheduler is not None else None,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "layers": self.probe.names,
            "compile": ({"modules": list(self.compiled_modules), "act": "in_graph", "diagnosis": "none"}
                        if self.compiled_modules else None),
            "fp32_modules": self.local_fp32.names,
            "guards": vars(self.guard.config).copy(),
            "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            **(self.ranks.header_fields() if self.ranks else {}),
        }

    def _disk_refused(self, message: str, first: bool) -> None:
        """The user's loop goes on: the records are kept and written once the disk takes them."""
        if first and not self._disk_said:
            self._disk_said = True
            print(f"amp-tui: {message}; the records are kept and written once space is freed",
                  file=sys.stderr, flush=True)
        self.recorder.keep(event_record(self.step_index, "error", message, during="io"))

    # ---- hooks on the user's objects ---------------------------------------------------------
    def _attach_hooks(self) -> None:
        self._handles.append(self.optimizer.register_step_pre_hook(self._before_optimizer_step))
        self._handles.append(self.optimizer.register_step_post_hook(self._after_optimizer_step))
        if self.loop_scaler is not None:
            # Instance attributes over the class's methods: GradScaler.step calls self.unscale_,
            # so an unscale it does on its own is seen too. A disabled scaler is watched as well:
            # where the loop calls its unscale_ is where the gradients are read, before clipping.
            for name, wrapper in (("unscale_", self._scaler_unscale), ("step", self._scaler_step)):
                setattr(self.loop_scaler, name, wrapper(getattr(self.loop_scaler, name)))
                self._patched.append(name)

    def _detach_hooks(self) -> None:
        if self._forward_autocast is not None:
            self._forward_autocast.undo()
            self._forward_autocast = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for name in self._patched:
            self.loop_scaler.__dict__.pop(name, None)
        self._patched = []

    def _scaler_unscale(self, original):
        def unscale_(optimizer):
            result = original(optimizer)
            if optimizer is self.optimizer and self._open_step is not None:
                self._gradients_seen(scaled=False)
            return result
        return unscale_

    def _scaler_step(self, original):
        def step(optimizer, *args, **kwargs):
            if optimizer is not self.optimizer or self._open_step is None:
                return original(optimizer, *args, **kwargs)
            self._attempt_starts()
            result = original(optimizer, *args, **kwargs)
            if self.scaler is not None:
                # GradScaler's own decision, for this optimizer, whatever the kind of optimizer.
                found = self.scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {})
                self._attempt.found_inf = _found_inf(found, self.device)
            return result
        return step

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._open_step is None:
            return
        if self.scaler is None:
            # Without loss scaling, the gradients as the optimizer gets them (a loop with no
            # unscale_ call to mark the place before its clipping). A closure computes them
            # inside step(): they are read after it (gradients_ready, or the post-hook).
            self._attempt_starts()
            if not _closure_given(args, kwargs):
                self._gradients_seen(scaled=False)
        elif self._attempt is not None and not self._attempt.gradients:
            # A fused optimizer stepped by GradScaler without unscale_: its gradients still carry
            # the scale, which the optimizer's kernel takes off itself.
            self._gradients_seen(scaled=True)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._attempt is not None:
            self._attempt.stepped = True
            if not self._attempt.gradients and self.scaler is None and self._open_step is not None:
                self._gradients_seen(scaled=False)   # a closure's, with nobody to say when before

    def _attempt_starts(self) -> None:
        if self._attempt is None:
            lr = self.optimizer.param_groups[0].get("lr")
            self._attempt = _Attempt(self._scale_value,
                                     float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None)

    def _gradients_seen(self, *, scaled: bool) -> None:
        """The gradients of this update, as the optimizer will use them; and the weights before it."""
        self._attempt_starts()
        attempt = self._attempt
        if attempt.gradients:
            return
        attempt.gradients, attempt.scaled = True, scaled
        if self.probe.active:
            probed = self.step_index // self.probe_every
            self.probe.record_gradients(self._scale_value if self.scaler is not None else None,
                                        underflow=not scaled and probed % self.underflow_every == 0)
            self.probe.record_weights()

    # ---- the step's end --------------------------------------------------------------------
    def _end_of_block(self, step: MonitoredStep) -> None:
        loss = step.loss
        if loss is None:
            self._abandon_step()
            raise MonitorError("step.loss was never set: assign the loss tensor inside "
                               "`with monitor.step() as step:` (step.loss = loss)")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            self._abandon_step()
            kind = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) \
                else f"a {type(loss).__name__}"
            raise MonitorError(f"step.loss is {kind}: set it to the scalar loss tensor")
        self._pending_losses.append(loss.detach())
        if self._attempt is None:
            return   # no update in this block (accumulating): it belongs to the next one
        self._record_update()
        self._after_update()

    def _record_update(self) -> None:
        attempt, losses, scaler = self._attempt, self._pending_losses, self.scaler
        extra = [*losses]
        if scaler is not None:
            extra.append(scaler._scale if scaler._scale is not None
                         else torch.tensor(self._scale_value, device=self.device))
            if attempt.found_inf is not None:
                extra.append(attempt.found_inf)
        # The one transfer of the step: the losses, the scale and GradScaler's verdict, and the
        # per-layer figures when probed.
        if self.probe.active:
            with torch.no_grad():
                figures, host = self.probe.collect(extra)
        else:
            figures, host = None, _to_host(extra)
        n = len(losses)
        mean_loss = host[0] if n == 1 else sum(host[:n]) / n
        used_scale = attempt.scale if scaler is not None else None
        skipped = False
        if scaler is not None:
            self._scale_value = host[n]
            skipped = len(host) > n + 1 and host[n + 1] > 0
        if figures is not None and attempt.scaled and used_scale:
            figures.grad = [None if g is None else g / used_scale for g in figures.grad]
        nonfinite = None
        if not math.isfinite(mean_loss):
            nonfinite = "loss"
        elif skipped or (figures is not None and figures.grads_nonfinite):
            nonfinite = "gradients"
        self.last_skipped = skipped
        if skipped:
            self.skipped_total += 1
        elif attempt.stepped:
            self.updates_applied += 1
        first = None
        if nonfinite is not None and figures is not None:
            index = figures.first_nonfinite("act" if nonfinite == "loss" else "grad")
            first = self.probe.names[index] if index is not None else None
        result = StepResult(
            step=self.step_index, loss=mean_loss, scale=used_scale, skipped=skipped,
            skipped_total=self.skipped_total, updates_applied=self.updates_applied, dtype=self.dtype,
            micro_batches=n, nonfinite=nonfinite, first_nonfinite_layer=first, lr=attempt.lr,
            figures=figures, next_scale=self._scale(), duration=time.perf_counter() - self._step_started)
        if self.ranks:
            result = self.ranks.gather_step(result, self.probe.names, details=False)
        self.last_loss = mean_loss
        self._unpublished.append(result)
        if nonfinite is not None or time.monotonic() - self._published_at >= PUBLISH_INTERVAL:
            self._publish()

    def _publish(self) -> None:
        """Record the steps measured since the last call, with what they raise. Done a few
        steps at a time: formatting a run of records together costs a fraction of doing it
        between every two steps, when the training step has left the caches cold."""
        results, self._unpublished = self._unpublished, []
        self._published_at = time.monotonic()
        flush = self.state == "paused"
        for result in results:
            self.recorder.emit(step_record(result), flush=flush)
            if result.nonfinite is not None:
                self._nonfinite_event(result, result.first_nonfinite_layer)
            decisions = self.guard.observe(result, result.next_scale, self._bf16_ok)
            for alert in decisions.alerts:
                self.event("alert", f"{alert.message}. Likely cause: {alert.cause}. Fix: {alert.fix}",
                           step=result.step, reason=alert.reason, cause=alert.cause, fix=alert.fix)

    def _nonfinite_event(self, result: StepResult, layer: str | None) -> None:
        self.nonfinite_events += 1
        short = precision.SHORT[result.dtype]
        rank = result.per_rank.nonfinite_rank if result.per_rank is not None else None
        on = f" on rank {rank}" if rank is not None else ""
        if result.nonfinite == "loss":
            where = f"; first non-finite output: {layer}" if layer else ""
            outcome = "update skipped" if result.skipped else "the loop applied the update (no GradScaler to skip it)"
            message = f"non-finite loss ({number(result.loss, 4)}){on} in {short}{where}: {outcome}"
            fields = {"origin": layer}
        else:
            where = f"; first non-finite gradient: {layer}" if layer else ""
            if result.skipped:
                message = (f"gradients overflowed at scale {result.scale:g}{on}{where}: update skipped, "
                           f"scale now {result.next_scale:g}")
            else:
                message = (f"non-finite gradients{on} in {short}{where}: the loop applied the update "
                           "(no GradScaler to skip it)")
            fields = {"backward_origin": layer}
        if rank is not None:
            fields["rank"] = rank
        self.event("nonfinite", message, step=result.step, where=result.nonfinite, layer=layer,
                   loss=encode_float(result.loss), scale=result.scale, dtype=result.dtype, **fields)

    def _after_update(self) -> None:
        self._autocast_used_last = self._autocast_used
        self._pending_losses, self._attempt, self._step_started = [], None, None
        self.step_index += 1
        if not self._probing():
            self.probe.end()
        if self.checkpoint_every and self.step_index % self.checkpoint_every == 0:
            self.checkpointing.save(source="checkpoint_every")
        # The boundary after the update: a stop asked for during the step is seen by the loop
        # at its very next `if monitor.should_stop`, and a pause holds the loop here.
        self._boundary()

    def _abandon_step(self) -> None:
        self._pending_losses, self._attempt, self._step_started = [], None, None
        self.probe.end()

    def _failed(self, exc: BaseException) -> None:
        """An exception went through a monitored step: recorded with its traceback."""
        self._abandon_step()
        if isinstance(exc, (KeyboardInterrupt, GeneratorExit, MonitorError)):
            return
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.error = f"step {self.step_index}: {type(exc).__name__}: {exc}"
        self.exit_status = 1
        self.state = "error"
        self.event("error", self.error, during="step", traceback=tb[-20000:])

    # ---- boundaries and commands ------------------------------------------------------------
    def _probing(self) -> bool:
        return self.step_index % self.probe_every == 0

    def _boundary(self, *, hold: bool = True) -> None:
        """Between two updates: apply what was asked; while paused (and `hold`), hold here until
        resumed, single-stepped or stopped."""
        if self.ranks and not hold:
            return   # several ranks agree at the boundaries that hold, one after each update
        while True:
            for command in self._boundary_commands():
                apply_command(self._handlers, command, self._command_failed)
            if self._stop_requested.is_set():
                self._stopping()
            if not hold or self.state != "paused" or self._single_steps or self.should_stop:
                break
            self._publish()   # held: what was measured is on file before the wait
            if self.ranks:
                self.ranks.hold(self.commands)   # the next boundary is the heartbeat
            else:
                self.commands.wait(0.25)
        if hold:
            if self._single_steps:
                self._single_steps -= 1
            self._released = True

    def _boundary_commands(self) -> list[Command]:
        """The commands queued meanwhile; with several ranks, rank 0's on every rank, and a stop
        that a signal brought to any rank stops them all here."""
        if not self.ranks:
            return self.commands.drain()
        commands, stop = self.ranks.agree_commands(self.commands.drain)   # no loss check of ours carries them
        if stop is not None:
            self._checkpoint_on_stop = self._checkpoint_on_stop or stop.checkpoint
            self._stop_reason = self._stop_reason or stop.reason
            self._stop_requested.set()
        return commands

    def _stopping(self) -> None:
        if self.should_stop:
            return
        if self._stop_reason:
            self.event("stopping", f"stopping: {self._stop_reason}", reason=self._stop_reason)
        if self._checkpoint_on_stop:
            self.checkpointing.save(source=self._stop_reason or "stop")
        self.should_stop = True
        self.state = "stopped"

    def _command_failed(self, command: Command, message: str) -> None:
        self.event("error", message, during=command.action, source=command.source)

    def _set_dtype(self, command: Command) -> Outcome:
        new = precision.canonical(str(command.value))
        before = self.describe_precision()
        if self._autocast_used_last is False:
            return self._refused(command, "dtype change refused: this loop's forward doesn't run under "
                                 "monitor.autocast() (its own torch.autocast fixes the dtype); wrap the "
                                 "forward in `with monitor.autocast():` so the dashboard can switch it")
        if new == "float16" and self.scaler is None:
            fix = (f"start {self.framework} in fp16 for one" if self.framework
                   else "pass scaler= to amp_tui.monitor")
            return self._refused(command, "dtype change refused: fp16 needs a GradScaler and this loop has "
                                 f"none (its gradients would underflow); {fix}")
        reason = unsupported_reason(self.device, new)
        if reason:
            return self._refused(command, f"dtype change refused: {reason}")
        if self.scaler is not None and new != self.dtype:
            # The loop's GradScaler stays in the loop. Away from fp16 it scales by 1 (bf16 has
            # fp32's range; a scale fp16's overflows drove towards 0 must not follow), and it
            # still skips an update with inf/NaN gradients, so the skip count stays true. Back in
            # fp16, the scale fp16 had (the starting one if it had fallen below 1).
            if self.dtype == "float16":
                self._fp16_scale = self._scale_value
                self._load_scale(1.0)
            elif new == "float16":
                self._load_scale(self._fp16_scale if self._fp16_scale >= 1 else self._starting_scale)
        self.dtype = new
        after = self.describe_precision()
        note = f" (scale {after['scale']:g})" if self.scaler is not None else ""
        return self.intervention(command, before, after,
                                 f"dtype {precision.SHORT[before['dtype']]} → {precision.SHORT[new]}{note}")

    def _load_scale(self, scale: float) -> None:
        """At a boundary (no scaled loss in flight): the loop's scaler scales by `scale` from now."""
        self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": scale, "_growth_tracker": 0})
        self._scale_value = scale

    def _set_scale(self, command: Command) -> Outcome:
        if self.scaler is None:
            return self._refused(command, "scale change refused: this loop has no (enabled) GradScaler")
        before = self.describe_precision()
        in_fp16 = self.dtype == "float16"
        current = self._scale_value if in_fp16 else self._fp16_scale
        new = current / 2.0 if command.value == "half" else float(command.value)
        if not (math.isfinite(new) and new > 0):
            return self._refused(command, f"scale change refused: {command.value!r} is not a positive scale")
        if not in_fp16:   # as amp-tui train does: the scale fp16 starts from when it is next entered
            self._fp16_scale = new
            return self.intervention(command, before, self.describe_precision(),
                                     f"fp16 loss scale {current:g} → {new:g} (used when fp16 is next entered)")
        self._load_scale(new)
        return self.intervention(command, before, self.describe_precision(),
                                 f"loss scale {before['scale']:g} → {new:g}")

    def _save_checkpoint(self, *, source: str):
        return self.checkpointing.save(source=source)

    def _fp32_root(self):
        return original_module(self.model)

    def _fp32_changed(self) -> None:
        """Nothing ran ahead: the next forward takes the new policy."""

    def _resume(self, command: Command) -> Outcome:
        before = {"state": self.state}
        self._single_steps = 0
        self.state = "running"
        return self.intervention(command, before, {"state": self.state}, "resumed")

    def _single_step(self, command: Command) -> Outcome:
        if self.state != "paused":
            source = command.source
            message = ("single step works while paused (press space first)" if source == "dashboard"
                       else "step works while the loop is paused: pause it first")
            return Outcome(False, message)
        self._single_steps += 1
        return self.intervention(command, {"state": self.state}, {"state": self.state},
                                 f"single step {self.step_index}")

    def _stop(self, command: Command) -> Outcome:
        self.intervention(command, {"state": self.state}, {"state": "stopped"}, "stop requested")
        self._stop_requested.set()
        self._stopping()
        return Outcome(True, "stopping: monitor.should_stop is now True")

    def checkpoint_refused(self, source: str, message: str) -> None:
        """A checkpoint the disk refused: said (the event is recorded); the loop goes on."""
        print(f"amp-tui: {message}", file=sys.stderr, flush=True)

    # ---- the process -------------------------------------------------------------------------
    def _scale(self) -> float | None:
        return self._scale_value if self.scaler is not None else None

    def _starting_dtype(self, dtype: str | None) -> str:
        if dtype is not None:
            chosen = precision.canonical(dtype)
            if chosen == "float16" and self.scaler is None and self.framework is None:
                raise MonitorError("dtype='fp16' needs an enabled GradScaler: pass scaler=torch.amp.GradScaler(...)")
        elif self.scaler is not None:
            chosen = "float16"
        else:
            chosen = "bfloat16" if unsupported_reason(self.device, "bfloat16") is None else "float32"
        reason = unsupported_reason(self.device, chosen)
        if reason:
            raise PrecisionRefused(reason)
        return chosen

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        def on_signal(signum, _frame):
            # SIGTERM or SIGHUP (an SSH drop, `amp-tui run` passing its own on): keep the
            # progress, stop at the next step boundary; the loop reads monitor.should_stop.
            self.request_stop(checkpoint=True, reason=signal.Signals(signum).name)
        for sig in STOP_SIGNALS:
            try:
                self._previous_signals[sig] = signal.signal(sig, on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_signals.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError):
                pass
        self._previous_signals = {}

    def _close_at_exit(self) -> None:
        """The script ended without monitor.close(): end the recording anyway, before the
        interpreter finalises (no thread of ours may outlive it)."""
        self.close()


def _check_objects(model, optimizer, scaler, scheduler) -> None:
    if not isinstance(model, torch.nn.Module):
        raise MonitorError(f"amp_tui.monitor(model, ...): model is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MonitorError(f"amp_tui.monitor(model, optimizer, ...): optimizer is a {type(optimizer).__name__}, "
                           "not a torch.optim.Optimizer")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise MonitorError(f"scaler= is a {type(scaler).__name__}, not a torch.amp.GradScaler")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise MonitorError(f"scheduler= is a {type(scheduler).__name__} with no step() method")


def _tensorboard_observer(logdir: Path):
    from amp_tui.recording.extras import MissingExtra
    from amp_tui.recording.tensorboard import TensorBoardObserver
    try:
        return TensorBoardObserver(logdir)
    except MissingExtra as exc:
        raise MonitorError(f"tensorboard_dir={str(logdir)!r}: {exc}") from None
    except OSError as exc:
        raise MonitorError(f"tensorboard_dir={str(logdir)!r}: {exc.strerror or exc}") from None


def _inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper that steps it (Accelerate's AcceleratedOptimizer keeps
    it as `.optimizer`): the one whose step hooks fire and which GradScaler is handed."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def _closure_given(args: tuple, kwargs: dict) -> bool:
    return (bool(args) and args[0] is not None) or kwargs.get("closure") is not None


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise MonitorError("amp_tui.monitor(model, ...): the model has no parameters to watch")


def _to_host(tensors: list[torch.Tensor]) -> list[float]:
    """One-element tensors (a loss in any float dtype, float32 scale and found-inf) as floats.
    On an accelerator in one transfer (cat promotes them to the widest dtype among them, which
    holds each exactly); on the CPU, where reading a value is no transfer, one by one, cheaper
    than building the cat."""
    if len(tensors) == 1 or tensors[0].device.type == "cpu":
        return [t.item() for t in tensors]
    return torch.cat([t.reshape(1) for t in tensors]).tolist()


def _found_inf(per_device: dict, device: torch.device) -> torch.Tensor | None:
    """GradScaler's found-inf for one optimizer, on `device` and summed over the devices it
    came from (one, mostly)."""
    values = [v.to(device) for v in per_device.values()]
    if not values:
        return None
    return values[0] if len(values) == 1 else sum(values)


def _claim(m: Monitor) -> None:
    global _current
    with _current_lock:
        if _current is not None and not _current._closed:
            raise MonitorError(f"a monitor already watches a loop in this process (recording to "
                               f"{_current.run_dir}): close it first (monitor.close())")
        _current = m


def _release(m: Monitor) -> None:
    global _current
    with _current_lock:
        if _current is m:
            _current = None
