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

A loop without a GradScaler of its own writes `scaler = monitor.scaler` after making the monitor:
amp-tui's own, which scales in fp16 only (precision_state.py's BorrowedScaling). The monitor
starts in the dtype the loop already runs (fp16 with an enabled GradScaler, else fp32) and takes
`fp32_modules=` as `amp-tui train` takes `--fp32-modules`.

The monitor owns a run controller (job/controller.py) and the hook driver (job/drivers/hook_driver.py,
which says how the loop is watched): it records the same session as `amp-tui train` and serves
the same control socket, so `amp-tui attach RUN_DIR` shows the dashboard and its keys steer the
loop at step boundaries. It never drives the loop, and the user's objects are left as they were
on `close()`. `monitor.step()` blocks that end without an update (gradient accumulation) are
folded into the next, and commands apply only between updates.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from amp_tui.core import precision
from amp_tui.core.run_dirs import default_run_dir
from amp_tui.core.signals import install_handlers, restore_handlers
from amp_tui.job.controller import RunController
from amp_tui.job.drivers.hook_driver import HookDriver, MonitorError
from amp_tui.job.monitor_options import MonitorOptions
from amp_tui.job.process_slot import ProcessSlot
from amp_tui.job.ranks.distributed import Ranks
from amp_tui.job.records.probe_events import announce_probe_changes
from amp_tui.job.states import MONITOR_LOOP, IoPolicy
from amp_tui.training.step.autocast import autocast, torch_dtype
from amp_tui.training.step.forward_autocast import ForwardAutocast, wrapped_in_autocast
from amp_tui.training.step.guards import GuardConfig
from amp_tui.training.step.update_guard import scale_floor

__all__ = ["Monitor", "MonitorError", "MonitoredStep"]

RUN_DIR_VARIABLE = "AMP_TUI_RUN_DIR"   # set by `amp-tui run`: where the monitor records
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_SLOT = ProcessSlot()   # one monitor per process: it owns the control socket


class MonitoredStep:
    """What `with monitor.step() as step:` hands the loop: set `step.loss` to the loss tensor.
    Set once per micro-batch where the block runs several (gradient accumulation), each is kept:
    the step's loss is their mean. With accumulation, set it to the micro-batch's loss before the
    loop divides it by the accumulation steps for the backward (docs/user-guide.md)."""

    def __init__(self) -> None:
        self.losses: list[Any] = []   # each value set, in order (the same tensor set twice: once)

    @property
    def loss(self) -> Any:
        return self.losses[-1] if self.losses else None

    @loss.setter
    def loss(self, value: Any) -> None:
        if value is None:
            self.losses = []
        elif not self.losses or value is not self.losses[-1]:
            self.losses.append(value)


class Monitor:
    """The loop's side of a run (the module docstring shows it): `step()`, `autocast()`,
    `should_stop`, `close()`, `scaler`; `begin_step`/`end_step`/`fail_step` for a framework's
    callback. The run itself, what records and steers it, is `controller` (job/controller.py)."""

    def __init__(self, model, optimizer, options: MonitorOptions | None = None, *, scaler=None, scheduler=None,
                 framework: str | None = None):
        o = options or MonitorOptions()   # checked where it was made (job/monitor_options.py)
        # A framework's callback drives this monitor (amp_tui.integrations): it opens and ends the
        # steps from its hooks.
        self.framework = framework
        self.model = model
        self.driver = driver = HookDriver(
            model, optimizer, scaler=scaler, scheduler=scheduler, dtype=o.dtype, probes=o.probes,
            framework=framework, fp32_modules=o.fp32_modules)
        self.optimizer = driver.optimizer
        self.scheduler = scheduler
        # A loop under torchrun: rank 0 records and serves the socket, every rank agrees at the
        # boundaries (job/ranks/distributed.py).
        ranks = Ranks.of_loop(model)
        run_dir = Path(o.run_dir or os.environ.get(RUN_DIR_VARIABLE) or default_run_dir(driver.script))
        if ranks:
            driver.probe_like_every_rank(ranks)
            run_dir = Path(ranks.share(str(run_dir)))
        main = not ranks or ranks.is_main
        guard = GuardConfig(fallback=o.on_nonfinite == "isolate", forecast_horizon=o.forecast_horizon,
                            min_scale=o.min_scale)
        self.controller = RunController(
            driver, device=driver.device, run_dir=run_dir, script=driver.script, ranks=ranks,
            on_nonfinite=o.on_nonfinite, guard=guard, io_policy=IoPolicy.CARRY_ON,
            checkpoint_every=o.checkpoint_every, control=o.control and main, loop=MONITOR_LOOP)
        driver.run = self.controller
        driver.in_step = lambda: self._open_step is not None
        self._open_step: MonitoredStep | None = None
        self._open_block: AbstractContextManager | None = None   # begin_step()'s, until end_step()
        self._forward_autocast: ForwardAutocast | None = None
        self._released = False   # the last boundary let the loop go on (resumed, or not paused)
        self._entry_seconds = 0.0   # amp-tui's work entering the open step's block (own time)
        self._closed = False
        self._previous_signals: dict = {}
        if o.tensorboard_dir is not None and main:   # before anything is made: a missing package
            self.controller.recorder.observers.append(_tensorboard_observer(Path(o.tensorboard_dir)))
        if (o.wandb or o.mlflow) and main:
            self.controller.recorder.observers.extend(_tracking_observers(o, run_dir))
        self._start(main, o.announce)

    def _start(self, main: bool, announce: bool) -> None:
        """Claim the process's one monitor, hook the loop, write the header, and go."""
        run, driver = self.controller, self.driver
        _SLOT.claim(self, still_open=lambda m: not m._closed, refusal=lambda m: MonitorError(
            f"a monitor already watches a loop in this process (recording to {m.run_dir}): close it "
            "first (monitor.close())"))
        try:
            driver.attach()
            if wrapped_in_autocast(self.model) is not None:
                # Accelerate's prepare() fixed the forward's autocast: put it under ours, so that
                # the dtype in force is what runs (and `d` switches it).
                self.autocast_forward(wrapped_in_autocast(self.model))
            if run.ranks:   # a rank's step time ends with its forward, before DDP's all-reduce
                driver.add_hook(self.model.register_forward_hook(run.ranks.forward_done))
            if main:
                run.run_dir.mkdir(parents=True, exist_ok=True)
            run.open_recording(run.header())
            self._raise_to_floor()
        except BaseException:
            self._let_go()
            raise
        if threading.current_thread() is threading.main_thread():
            # SIGTERM or SIGHUP (an SSH drop, `amp-tui run` passing its own on): keep the
            # progress, stop at the next step boundary; the loop reads monitor.should_stop.
            self._previous_signals = install_handlers(STOP_SIGNALS, self._on_signal)
        atexit.register(self._close_at_exit)
        run.state = "running"
        if announce and main:
            print(f"amp-tui: recording this loop to {run.run_dir} ({precision.SHORT[self.dtype]}); "
                  f"watch and steer it with: amp-tui attach {run.run_dir}", file=sys.stderr, flush=True)

    def _raise_to_floor(self) -> None:
        """A GradScaler handed over below the floor (0 included, where it applies NaN updates) is
        raised to it before the loop's first step, and that is said."""
        run = self.controller
        floor, scale = scale_floor(run.guard.config.min_scale), run.precision.scale
        if scale is None or scale >= floor:
            return
        run.precision.clamp(floor)
        run.alert("min_scale", f"the loop's GradScaler came with scale {scale:g}, below its floor {floor:g}: "
                  f"raised to {floor:g}", cause="the scale collapsed before amp-tui watched the loop (at 0 "
                  "GradScaler applies NaN updates)", fix="start the GradScaler at its init_scale (65536 by "
                  "default), or lower min_scale", step=run.step_index)

    @property
    def dtype(self) -> str:
        return self.driver.dtype

    @property
    def run_dir(self) -> Path:
        return self.controller.run_dir

    @property
    def step_index(self) -> int:
        """The index of the loop's next step."""
        return self.controller.step_index

    @property
    def should_stop(self) -> bool:
        """The run stops here: a stop command, a signal, or the run's policy (break out of the loop)."""
        return self.controller.should_stop

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler the loop calls: the one given (scaler=), or, for a loop without one,
        amp-tui's own, which scales in fp16 only (`scaler = monitor.scaler`, then
        `scaler.scale(loss).backward()`, `scaler.step(optimizer)`, `scaler.update()`). None under a
        framework's callback without a scaler."""
        return self.driver.loop_scaler

    @property
    def probe_every(self) -> int | str:
        return self.driver.probe_every

    @property
    def last_skipped(self) -> bool:
        return self.driver.last_skipped

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
        entered, apart = time.perf_counter(), self.controller.budget.apart_seconds
        if not self.driver.accumulating:      # between updates: the boundary where commands apply
            # The update before ended at a boundary already (which held the loop while paused):
            # hold here only before the first update, or for a pause asked for since.
            paused_before = self.controller.state == "paused"
            self._boundary(hold=False)
            if not self._released or (self.controller.state == "paused" and not paused_before):
                self._boundary(hold=True)
            self._released = False
        step = self._open_step = MonitoredStep()
        self.driver.block_starts()
        self._entry_seconds = time.perf_counter() - entered - (self.controller.budget.apart_seconds - apart)
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
        self.driver.autocast_used = True
        if cache_enabled is None:
            return autocast(self.controller.device.type, self.dtype)
        return torch.autocast(self.controller.device.type, dtype=torch_dtype(self.dtype),
                              enabled=precision.uses_autocast(self.dtype), cache_enabled=cache_enabled)

    def _end_of_block(self, step: MonitoredStep) -> None:
        if not step.losses:
            self.driver.abandon_update()
            raise MonitorError("step.loss was never set: assign the loss tensor inside "
                               "`with monitor.step() as step:` (step.loss = loss)")
        for loss in step.losses:
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                self.driver.abandon_update()
                kind = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) \
                    else f"a {type(loss).__name__}"
                raise MonitorError(f"step.loss is {kind}: set it to the scalar loss tensor")
        if not self.driver.block_ends(step.losses):
            return   # no update in this block (accumulating): it belongs to the next one
        result = self.driver.finish_update()
        # amp-tui's own work on the update: from where its measured duration ends (the transfer
        # of its figures is the update's) to the boundary after it, and the entry of its block.
        after, apart = self.driver.update_ended - self._entry_seconds, self.controller.budget.apart_seconds
        if self.controller.ranks:
            result = self.controller.ranks.gather_step(result, self.driver.probe.names, details=False)
        self.driver.update_done()
        # The boundary after the update: a stop asked for during the step is seen by the loop
        # at its very next `if monitor.should_stop`, and a pause holds the loop here (the time
        # held is told apart from the update's own work).
        self.controller.end_step(result, since=after, apart=apart, boundary=self._boundary)

    def _boundary(self, *, hold: bool = True) -> None:
        if self.controller.ranks and not hold:
            return   # several ranks agree at the boundaries that hold, one after each update
        self.controller.boundary(hold=hold)
        if self.controller.ranks:
            announce_probe_changes(self)   # what the boundary's words changed, from the next step on
        if hold:
            self._released = True

    def _failed(self, exc: BaseException) -> None:
        """An exception went through a monitored step: recorded with its traceback."""
        self.driver.abandon_update()
        if isinstance(exc, (KeyboardInterrupt, GeneratorExit, MonitorError)):
            return
        self.controller.fail(f"step {self.controller.step_index}: {type(exc).__name__}: {exc}", exc)

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
        elif self.controller.state != "error":
            self._failed(exc)

    def gradients_ready(self) -> None:
        """The framework's hook between the backward and the update (Lightning's
        on_before_optimizer_step): without a GradScaler, the gradients are read here. An optimizer
        stepped with a closure only has them once the closure ran inside its step(), after the
        step's pre-hook. With a GradScaler they are read at its unscale_ (or step) already."""
        self.driver.gradients_ready()

    def autocast_forward(self, module: torch.nn.Module) -> None:
        """Run `module`'s forward under `monitor.autocast()` from now on (in place of the fixed
        autocast Accelerate's prepare() wrapped it in, if any), so that `d` switches what the
        forward runs in; undone on close()."""
        if self._forward_autocast is None:
            self._forward_autocast = ForwardAutocast(module, self.autocast, lambda: self.dtype != "float32")

    # ---- the end --------------------------------------------------------------------------
    def close(self) -> None:
        """End the recording (the end record says how the loop ended) and leave the user's objects
        as they were: no hooks, no patched methods, no signal handlers of ours."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        run = self.controller
        if run.ranks:
            run.ranks.voting = False   # no boundary after the last one: stops are this rank's own
        if self._open_step is not None:
            run.error = run.error or "monitor.close() inside monitor.step(): that step is not recorded"
        if run.state not in ("error", "stopped"):
            run.state = "stopped" if run.should_stop else "finished"
        try:
            self.controller.close()
        finally:
            self._let_go()

    def _let_go(self) -> None:
        if self._forward_autocast is not None:
            self._forward_autocast.undo()
            self._forward_autocast = None
        self.driver.close()
        if self.controller.ranks:   # the loop's group stays the loop's; nothing of ours in gloo's threads
            self.controller.ranks.close()
        restore_handlers(self._previous_signals)
        self._previous_signals = {}
        _SLOT.release(self)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, GeneratorExit)) \
                and self.controller.state != "error":
            self._failed(exc)
        self.close()

    def _on_signal(self, signum, _frame) -> None:
        self.controller.request_stop(checkpoint=True, reason=signal.Signals(signum).name)

    def _close_at_exit(self) -> None:
        """The script ended without monitor.close(): end the recording anyway, before the
        interpreter finalises (no thread of ours may outlive it)."""
        self.close()


def _tracking_observers(o, run_dir: Path) -> list:
    from amp_tui.recording.extras import MissingExtra
    from amp_tui.recording.trackers import TrackerError, open_observers
    asked = ", ".join(f"{name}={getattr(o, name)!r}" for name in ("wandb", "mlflow") if getattr(o, name))
    try:
        return open_observers(wandb=o.wandb or None, mlflow=o.mlflow or None, run_dir=run_dir,
                              mlflow_run_id=o.mlflow_run_id)
    except (MissingExtra, TrackerError) as exc:
        raise MonitorError(f"{asked}: {exc}") from None


def _tensorboard_observer(logdir: Path):
    from amp_tui.recording.extras import MissingExtra
    from amp_tui.recording.tensorboard import TensorBoardObserver
    try:
        return TensorBoardObserver(logdir)
    except MissingExtra as exc:
        raise MonitorError(f"tensorboard_dir={str(logdir)!r}: {exc}") from None
    except OSError as exc:
        raise MonitorError(f"tensorboard_dir={str(logdir)!r}: {exc.strerror or exc}") from None
