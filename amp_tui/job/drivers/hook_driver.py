"""The hook driver: the user's own loop, seen through hooks on its own objects, under the run
controller (job/controller.py). `amp_tui.monitor` and the framework callbacks use it.

It never drives the loop:
- Gradients are read where they are true: right after GradScaler's `unscale_` (called by the user
  or by `scaler.step`), or in the optimizer's step pre-hook when there is no scaler; a fused
  optimizer stepped with still-scaled gradients has its figures divided by the scale on the host.
  So where the loop calls `zero_grad` doesn't matter, and a step GradScaler skipped (it never calls
  `optimizer.step()`) is measured like the others.
- A step is skipped when GradScaler found an inf/NaN at `scaler.step` (its own decision: right for
  fused optimizers too, which are stepped anyway). Without a scaler nothing skips: the loop
  applies every update, and a non-finite gradient is recorded as such.
- One step is one update attempt. Its micro-batches are the model's forward passes inside it
  (several in one `monitor.step()` block, as nanoGPT accumulates, or one per block when blocks
  that end without an update are folded into the next); its layer figures are the maximum over
  them.
- Everything measured stays on the device until the step's end, which brings it to the host in
  one transfer with the loss.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

import torch

from amp_tui.core import precision as dtypes
from amp_tui.job.drivers.loop_objects import (
    MonitorError,
    check_objects,
    device_of,
    example_names,
    inner_optimizer,
)
from amp_tui.job.drivers.update_hooks import UpdateAttempt, UpdateHooks
from amp_tui.job.ranks.rank_probes import RankProbes
from amp_tui.training.compiled import compiled_module_names, original_module
from amp_tui.training.local_fp32 import LocalFp32, match_modules
from amp_tui.training.probes.hidden_activation import HiddenActivationWatch
from amp_tui.training.probes.layer_probes import LayerFigures, LayerProbe
from amp_tui.training.probes.probe_options import ProbeOptions
from amp_tui.training.probes.probe_schedule import observe_step
from amp_tui.training.step.engine import StepResult, to_host
from amp_tui.training.step.forward_autocast import fixed_autocast_dtype, wrapped_in_autocast
from amp_tui.training.step.guards import Alert
from amp_tui.training.step.outcome import CountedSteps, StepOutcomes, first_nonfinite_layer
from amp_tui.training.step.precision_state import FP8_IN_OWN_LOOP, BorrowedScaling, PrecisionRefused
from amp_tui.training.trace.forward_keeper import ForwardKeeper, KeptForward
from amp_tui.training.trace.kept_step_trace import fp8_kept, trace_kept_step, xray_kept


class HookDriver(CountedSteps, UpdateHooks):
    """Hooks on the user's model, optimizer and scaler; the training state a checkpoint saves.
    `in_step()` says whether the loop is inside a monitored step (the hooks only count there)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scaler=None, scheduler=None,
                 dtype: str | None = None, probes: ProbeOptions | None = None, framework: str | None = None,
                 fp32_modules: str | list[str] | tuple[str, ...] = ()):
        check_objects(model, optimizer, scaler, scheduler)
        # A framework's callback starts the dtype it chose, recorded as it is (fp16 without a
        # GradScaler included, which the callback warns about).
        self.framework = framework
        self.model = model
        self.optimizer = inner_optimizer(optimizer)
        self.scheduler = scheduler
        self.device = device_of(model)
        self.precision = self._borrowed_scaling(dtype, scaler)
        # The scaler the loop calls (maybe disabled: bf16 and fp32 loops often keep one with
        # enabled=False; or amp-tui's, `monitor.scaler`); the precision state holds the one that scales.
        self.loop_scaler = self.precision.loop_scaler
        probes = probes or ProbeOptions()
        self.underflow_every = probes.underflow_every
        eager = original_module(model)
        self.eager_model = eager
        self.compiled_modules = compiled_module_names(model)
        self.probe = LayerProbe(eager, keep_hooks=bool(self.compiled_modules))
        self.probe_schedule = probes.schedule(self.probe.names)
        self.probe_options = probes
        # A skipped step that was not probed still gets its gradients' figures (not with several
        # ranks: they gather the planned steps only).
        self.unplanned_figures = True
        self._planned = False                   # this update was planned to be probed
        self.local_fp32 = LocalFp32(eager, self.device.type)
        self._fp32_patterns = fp32_patterns(eager, fp32_modules)   # checked now, applied by attach()
        # Each forward of a step kept (references, RNG, autocast), for a replay of the step under
        # the op tracer when it fails, or an X-ray asked for (training/trace/forward_keeper.py).
        self.keeper = ForwardKeeper(model, self.device.type, lambda: self.in_step())
        self.keeper.on_kept = self._replays_if_due
        self.replay_failing = True
        # A probed step whose loss and gradients came out finite while a layer's output held
        # inf/NaN (a saturating op after it hid it) is a non-finite step of its own, "activations".
        self.hidden_activations = True
        self._hidden = HiddenActivationWatch()
        self._xray_due: dict | None = None   # who asked for the X-ray of the next step
        self._xray: tuple[dict, dict] | None = None   # this step's X-ray, and who asked for it
        self.xray_by: dict = {}               # ... of the last step's X-ray (StepResult.xray)
        self._fp8_due: dict | None = None    # the same for the fp8 what-if (StepResult.fp8)
        self._fp8: tuple[dict, dict] | None = None
        self.fp8_by: dict = {}
        self.training = self
        self.outcomes = StepOutcomes()   # the step counter and the counts (training/step/outcome.py)
        self.last_skipped = False   # the last update was skipped (a scheduler stepped only after
                                    # applied updates reads this)
        self.autocast_used = False          # monitor.autocast() entered this step
        self.autocast_used_last = None      # ... in the last update (None: none yet)
        self.scaler_used_last = None        # the loop called its GradScaler in the last update
        self._in_scaler_step = False        # inside the loop's scaler.step()
        self._unscaled_fp16_said = False
        self.in_step = lambda: False        # set by the monitor
        self._closure_said = False   # the loop's closure steps were said to go unchecked
        self._forget_update()        # this update's attempt, losses, forwards and start: none yet
        self.update_ended = 0.0   # when the last update's measured duration ended (perf_counter)
        self._handles: list = []
        self._patched: list[str] = []
        self.run = None
        # The loop's own script: what the recording names (python -c ...: "python").
        self.script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else Path("python")

    def probe_like_every_rank(self, ranks) -> None:
        """Several ranks probe the same steps, and gather the planned ones only. The adaptive
        schedule is rank 0's, agreed at each boundary with what each rank saw of its own (its
        loss, its figures) that no collective agreed on (job/ranks/rank_probes.py)."""
        if self.probe_schedule.auto:
            self.probe_schedule.own_verdicts = True
            ranks.probes = RankProbes(self.probe_schedule, ranks.rank)
        self.unplanned_figures = False
        self.replay_failing = False   # a rank alone can't run DDP's collectives in a replay
        # This rank's figures alone would make the step non-finite on this rank only.
        self.hidden_activations = False

    @property
    def probe_every(self) -> int | str:
        return self.probe_schedule.asked

    @property
    def scaler(self):
        return self.precision.scaler

    @property
    def dtype(self) -> str:
        return self.precision.dtype

    @property
    def accumulating(self) -> bool:
        """Blocks ended without an update: the next block belongs to the same one."""
        return bool(self._losses)

    def _borrowed_scaling(self, dtype: str | None, scaler) -> BorrowedScaling:
        """A loop without an enabled GradScaler gets amp-tui's scaling in fp16 (precision_state.py);
        a framework's scaler is the framework's to make."""
        fix = f"start {self.framework} in fp16 for one" if self.framework else "pass scaler= to amp_tui.monitor"
        return BorrowedScaling(self.device, self._starting_dtype(dtype, scaler), scaler, fp16_fix=fix,
                               own=self.framework is None)

    def _starting_dtype(self, dtype: str | None, scaler) -> str:
        """By default what the loop already does: fp16 when it scales its loss with an enabled
        GradScaler, the dtype of the autocast Accelerate fixed around the forward, else fp32 (a
        loop with no autocast of its own stays in fp32 until `d`)."""
        if dtype is not None:
            if dtypes.canonical(dtype) == "float8":
                raise MonitorError(f"dtype={dtype!r}: {FP8_IN_OWN_LOOP}")
            return dtypes.canonical(dtype)
        if scaler is not None and scaler.is_enabled():
            return "float16"
        fixed = wrapped_in_autocast(self.model)   # Accelerate's prepare(): the autocast it fixed
        fixed_dtype = fixed_autocast_dtype(fixed) if fixed is not None else None
        return dtypes.canonical(str(fixed_dtype).removeprefix("torch.")) if fixed_dtype is not None else "float32"

    # ---- what the controller asks (Driver, TrainingState) --------------------------------------
    def description(self) -> dict:
        return {"script": str(self.script), "argv": sys.argv[1:], "command": [sys.executable, *sys.argv],
                **self.probe_schedule.header_fields(), "underflow_every": self.underflow_every,
                "layers": self.probe.names,
                "compile": ({"modules": list(self.compiled_modules), "act": "in_graph", "diagnosis": "none"}
                            if self.compiled_modules else None)}

    def fp32_root(self) -> torch.nn.Module:
        return self.eager_model

    def saved_extra(self) -> dict:
        return {}

    def settle(self, *, failed: bool = False, flush: bool = False) -> None:
        if self.run is not None:
            self.run.publish(flush=flush)

    def set_dtype(self, dtype: str) -> dict:
        new = dtypes.canonical(dtype)
        if self.autocast_used_last is False and new != self.dtype:
            raise PrecisionRefused("this loop's forward doesn't run under monitor.autocast() (its own "
                                   "torch.autocast fixes the dtype); wrap the forward in `with "
                                   "monitor.autocast():` so the dashboard can switch it")
        if new == "float16" != self.dtype and self.scaler_used_last is False and self.precision.made:
            raise PrecisionRefused(f"fp16 needs loss scaling and this loop steps its optimizer without a "
                                   f"GradScaler (its fp16 gradients would underflow): {UNSCALED_FIX}")
        return self.precision.set_dtype(dtype)

    def news(self, result: StepResult) -> list[Alert]:
        """Once: the last update ran in fp16 with amp-tui's GradScaler (the loop had none) and the
        loop didn't call it."""
        if self._unscaled_fp16_said or not self.precision.made or self.dtype != "float16" \
                or self.scaler_used_last is not False:
            return []
        self._unscaled_fp16_said = True
        return [Alert("unscaled_fp16", f"step {result.step} ran in fp16 and the loop stepped its optimizer "
                      "without a GradScaler", cause="fp16 gradients underflow (and overflow unchecked) "
                      "without loss scaling", fix=UNSCALED_FIX)]

    failed_step = None   # the user's loop can't be replayed with a module in fp32: its step is its own

    def describe_precision(self) -> dict:
        return self.precision.describe()

    def scaler_state(self) -> dict | None:
        return self.precision.scaler_state()

    def restore_scaler(self, state: dict | None) -> None:
        self.precision.restore_scaler(state)
        self.calibration.end()

    def checkpoint_extra(self) -> dict:
        return {**self.precision.checkpoint_fields(), "updates_applied": self.updates_applied,
                "skipped_total": self.skipped_total}

    def discard_started_step(self) -> None:
        """Nothing runs ahead in the user's loop: the next forward takes the new policy."""

    def close(self) -> None:
        self.detach()
        self.probe.detach()
        self.precision.give_back()
        for pattern in list(self.local_fp32.patterns):   # the user's modules as they were
            self.local_fp32.remove(pattern)

    # ---- hooks on the user's objects ---------------------------------------------------------
    def attach(self) -> None:
        for pattern in self._fp32_patterns:   # from the first step, as `--fp32-modules` does
            self.local_fp32.add(pattern)
        self._handles.append(self.optimizer.register_step_pre_hook(self._before_optimizer_step))
        self._handles.append(self.optimizer.register_step_post_hook(self._after_optimizer_step))
        self._handles.append(self.model.register_forward_pre_hook(self._forward_starts))
        self._handles.append(self.model.register_forward_hook(self._forward_ends))
        if self.replay_failing:   # (several ranks replay nothing here: nothing to keep)
            self.keeper.attach()
        if self.loop_scaler is not None:
            # Instance attributes over the class's methods: GradScaler.step calls self.unscale_,
            # so an unscale it does on its own is seen too. A disabled scaler is watched as well:
            # where the loop calls its unscale_ is where the gradients are read, before clipping.
            for name, wrapper in (("unscale_", self._scaler_unscale), ("step", self._scaler_step),
                                  ("state_dict", self._scaler_state_dict),
                                  ("load_state_dict", self._scaler_load_state_dict)):
                setattr(self.loop_scaler, name, wrapper(getattr(self.loop_scaler, name)))
                self._patched.append(name)

    def add_hook(self, handle) -> None:
        self._handles.append(handle)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for name in self._patched:
            self.loop_scaler.__dict__.pop(name, None)
        self._patched = []
        self.keeper.detach()

    def _forward_starts(self, *_args) -> None:
        if self.in_step():
            self._forwards += 1

    def _forward_ends(self, *_args) -> None:
        # Each micro-batch's outputs measured as its forward ends and let go (a maximum over
        # them at the step's end), not kept through the next one's.
        if self.in_step() and self.probe.active:
            self.probe.end_forward()

    # ---- an update, from its first block to its end ------------------------------------------------
    def block_starts(self) -> None:
        if self._started is None:
            self._started = time.perf_counter()
            self.autocast_used = False
            self._planned = self.probing()
            if self._planned:
                schedule = self.probe_schedule
                self.probe.begin(weights=schedule.weights_due(),
                                 ops=not self.compiled_modules and schedule.ops_due(self.dtype))

    def block_ends(self, losses: list[torch.Tensor]) -> bool:
        """A block's losses (one per micro-batch where it set one each); True when the update
        they belong to happened (or was skipped)."""
        self._losses.extend(loss.detach() for loss in losses)
        return self._attempt is not None

    def probing(self) -> bool:
        return self.probe_schedule.probing(self.step_index)

    def finish_update(self) -> StepResult:
        """The update's result, from one transfer: the losses, the scale and GradScaler's
        verdict, and the per-layer figures when probed."""
        attempt, losses = self._attempt, self._losses
        # The loss scale counts where the loop called the scaler (an optimizer stepped around
        # amp-tui's own GradScaler ran unscaled).
        scaler = self.scaler if attempt.through_scaler else None
        extra = [*losses]
        if scaler is not None:
            extra.append(scaler._scale if scaler._scale is not None
                         else torch.tensor(self.precision.scale_value, device=self.device))
            if attempt.found_inf is not None:
                extra.append(attempt.found_inf)
        if self.probe.active:
            with torch.no_grad():
                figures, host = self.probe.collect(extra)
        else:
            figures, host = None, to_host(extra)
        n = len(losses)
        mean_loss = host[0] if n == 1 else sum(host[:n]) / n
        used_scale = attempt.scale if scaler is not None else None
        skipped = False
        if scaler is not None:
            self.precision.observed_scale(host[n])
            skipped = len(host) > n + 1 and host[n + 1] > 0
        if figures is not None and attempt.scaled and used_scale:
            figures.grad = [None if g is None else g / used_scale for g in figures.grad]
        # An update amp-tui held back (inf/NaN that GradScaler missed, or no GradScaler) is a skip.
        skipped = skipped or attempt.held_back
        # GradScaler finding its scale at the start is no failure: nothing to locate or replay.
        nonfinite, calibrating = self.outcomes.classify(
            loss_finite=math.isfinite(mean_loss), skipped=skipped, held_back=attempt.held_back,
            gradients_nonfinite=figures is not None and figures.grads_nonfinite, scale=used_scale)
        self.last_skipped = skipped
        first = first_nonfinite_layer(figures, nonfinite, self.probe.names) if nonfinite else None
        if nonfinite is None and not calibrating and (first := self._hidden_activation(figures)) is not None:
            nonfinite = "activations"
        result = self.outcomes.close(
            skipped=skipped, applied=attempt.stepped, lr=attempt.lr, loss=mean_loss, scale=used_scale,
            dtype=self.dtype, micro_batches=max(self._forwards, n), nonfinite=nonfinite, first_nonfinite_layer=first,
            figures=figures, next_scale=self.precision.scale, held_back=attempt.held_back,
            calibration=calibrating, duration=(ended := time.perf_counter()) - self._started)
        self.update_ended = ended
        observe_step(self.probe_schedule, result, planned=self._planned)
        if nonfinite is not None and self.replay_failing:
            result.op_trace = self._replayed(used_scale, applied=attempt.stepped and not skipped)
        if self._xray is not None:
            (result.xray, self.xray_by), self._xray = self._xray, None
        if self._fp8 is not None:
            (result.fp8, self.fp8_by), self._fp8 = self._fp8, None
        return result

    def _hidden_activation(self, figures: LayerFigures | None) -> str | None:
        """A non-finite activation the loss never saw, when that is news, as `amp-tui train` says
        it (hidden_activation.py). An unprobed step measures no activation and can't tell."""
        return self._hidden.news(figures, self.probe.names) if self.hidden_activations else None

    # ---- the step replayed under the op tracer -------------------------------------------------
    def request_xray(self, by: dict | None = None) -> None:
        """X-ray the next step: as its first forward starts, that forward (and the backward from
        the model's own loss, when it returns one) traced op by op into `StepResult.xray`."""
        self._xray_due = by or {}

    def request_fp8(self, by: dict | None = None) -> None:
        """The fp8 what-if of the next step, from its first forward as `request_xray` has it."""
        self._fp8_due = by or {}

    def _replays_if_due(self, kept: KeptForward) -> None:
        arguments = {"dtype": self.dtype, "scale": self.precision.scale_value, "device": self.device}
        if self._xray_due is not None:
            by, self._xray_due = self._xray_due, None
            with self._replaying():
                self._xray = (xray_kept(self.model, kept, **arguments), by)
        if self._fp8_due is not None:
            by, self._fp8_due = self._fp8_due, None
            with self._replaying():
                self._fp8 = (fp8_kept(self.model, kept, **arguments), by)

    def _replayed(self, scale: float | None, *, applied: bool) -> dict:
        with self._replaying():
            return trace_kept_step(self.model, self.keeper.forwards, dtype=self.dtype, scale=scale,
                                   device=self.device, update_applied=applied)

    @contextlib.contextmanager
    def _replaying(self):
        """A replay's forwards are not the loop's: no hook of ours counts or keeps them."""
        in_step, self.in_step = self.in_step, lambda: False
        try:
            with self.probe.disarmed():
                yield
        finally:
            self.in_step = in_step

    def update_done(self) -> None:
        self.autocast_used_last = self.autocast_used
        self.scaler_used_last = self._attempt.through_scaler if self._attempt is not None else None
        self._forget_update()
        if not self.probing():
            self.probe.end()

    def abandon_update(self) -> None:
        self._forget_update()
        self.probe.end()

    def _forget_update(self) -> None:
        self._attempt: UpdateAttempt | None = None
        self._losses: list[torch.Tensor] = []   # the losses set in this update's blocks
        self._forwards = 0                      # the model's forward passes in this update
        self._started: float | None = None
        self.keeper.drop()
        self._xray = None


def fp32_patterns(model: torch.nn.Module, fp32_modules: str | list[str] | tuple[str, ...]) -> list[str]:
    """The module name patterns to run in fp32, each matching a module of `model`."""
    patterns = [fp32_modules] if isinstance(fp32_modules, str) else list(fp32_modules)
    for pattern in patterns:
        if not match_modules(model, pattern):
            raise MonitorError(f"fp32_modules={pattern!r} matches no module of the model (module names "
                               f"look like {', '.join(example_names(model))})")
    return patterns


UNSCALED_FIX = ("call amp-tui's, `scaler = monitor.scaler`, then scaler.scale(loss).backward(), "
                "scaler.step(optimizer), scaler.update() in place of loss.backward() and optimizer.step()")
