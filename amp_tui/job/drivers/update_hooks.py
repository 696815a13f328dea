"""Where the hook driver (hook_driver.py) sees an update attempt: the wrappers on the loop's
GradScaler (its unscale_, step and state dicts) and the optimizer's step hooks. They decide where
the attempt's gradients are read (right after the unscale, or before the optimizer steps without
a scaler), take GradScaler's own found-inf verdict, and hold back an update whose gradients hold
inf/NaN where nothing else would skip it."""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from amp_tui.job.drivers.loop_objects import closure_given, found_inf
from amp_tui.training.step.update_guard import (
    drop_gradients,
    gradients_of,
    mark_unscaled_nonfinite,
    nonfinite_flag,
    unscale_untrusted,
)


class UpdateAttempt:
    """What one update attempt saw, from its first hook to the step's end."""

    __slots__ = ("gradients", "scaled", "found_inf", "stepped", "scale", "lr", "checked", "held_back",
                 "through_scaler")

    def __init__(self, scale: float | None, lr: float | None):
        self.gradients = False   # the gradients were measured (or there was nothing to measure)
        self.scaled = False      # ... while they still carried the loss scale
        self.found_inf: torch.Tensor | None = None   # GradScaler's verdict, on the device
        self.stepped = False     # optimizer.step() ran
        self.checked = False     # the gradients were checked for inf/NaN before the update
        self.held_back = False   # ... held some, and amp-tui kept the update from applying them
        self.scale = scale       # the loss scale this attempt's backward used
        self.lr = lr
        self.through_scaler = False   # the loop called the GradScaler (unscale_ or step) in it


class UpdateHooks:
    """The hooks of one update attempt, for HookDriver: a mixin over its optimizer, scalers,
    probe and `_attempt` (hook_driver.py's attributes of the same names)."""

    def _scaler_state_dict(self, original):
        def state_dict():
            return self.precision.loop_state_dict(original)
        return state_dict

    def _scaler_load_state_dict(self, original):
        def load_state_dict(state_dict):
            self.precision.loop_load_state_dict(original, state_dict)
        return load_state_dict

    def _scaler_unscale(self, original):
        def unscale_(optimizer):
            result = original(optimizer)
            if optimizer is self.optimizer and self.scaler is not None:
                self._check_unscaled(optimizer)
            if optimizer is self.optimizer and self.in_step():
                self._attempt_starts()
                self._attempt.through_scaler = True
                self._gradients_seen(scaled=False)
            return result
        return unscale_

    def _check_unscaled(self, optimizer) -> None:
        """Below scale 1, GradScaler's check (made before the unscale) misses what the unscale
        makes: the unscaled gradients are checked again, and an inf/NaN found there skips the
        update through GradScaler's own found-inf (training/step/update_guard.py)."""
        if not unscale_untrusted(self.precision.scale_value):
            return
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        own = sum(float(v.item()) for v in found.values())
        flag = mark_unscaled_nonfinite(self.scaler, optimizer, self.device)
        if self.in_step():
            self._attempt_starts()
            self._attempt.checked = True
            self._attempt.held_back = self._attempt.held_back or (own == 0 and flag.item() > 0)

    def _scaler_step(self, original):
        def step(optimizer, *args, **kwargs):
            if optimizer is not self.optimizer or not self.in_step():
                return original(optimizer, *args, **kwargs)
            self._attempt_starts()
            self._attempt.through_scaler = True
            if self.scaler is not None and unscale_untrusted(self.precision.scale_value) \
                    and self.scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
                # A fused optimizer would unscale inside its kernel, past any check: unscaled here.
                self.loop_scaler.unscale_(optimizer)
            self._in_scaler_step = True
            try:
                result = original(optimizer, *args, **kwargs)
            finally:
                self._in_scaler_step = False
            if self.scaler is not None:
                # GradScaler's own decision, for this optimizer, whatever the kind of optimizer.
                found = self.scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {})
                self._attempt.found_inf = found_inf(found, self.device)
                self._measure_unplanned_skip(optimizer)
            return result
        return step

    def _measure_unplanned_skip(self, optimizer) -> None:
        """A step GradScaler skipped that was not planned to be probed: its gradients (never
        applied) and weights are measured now, before the loop zeroes them. A skip is seen without
        a sync of ours: GradScaler didn't call the optimizer's step. A fused optimizer is stepped
        anyway, and only its verdict, read here, says it."""
        attempt = self._attempt
        if self.probe.active or not self.unplanned_figures or attempt.found_inf is None:
            return
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if (attempt.stepped and not fused) or (fused and not attempt.found_inf.item()):
            return
        self.probe.begin()
        self.probe.record_gradients(self.precision.scale, underflow=False)
        self.probe.record_weights()

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if not self.in_step():
            return
        through_scaler = self._in_scaler_step or (self._attempt is not None and self._attempt.through_scaler)
        if self.scaler is None or not through_scaler:
            # Without loss scaling (no scaler, or an optimizer stepped without calling it), the
            # gradients as the optimizer gets them (a loop with no unscale_ call to mark the place
            # before its clipping). A closure computes them inside step(): they are read after it
            # (gradients_ready, or the post-hook).
            self._attempt_starts()
            if not closure_given(args, kwargs):
                self._gradients_seen(scaled=False)
                self._hold_back_if_nonfinite()
        elif self._attempt is not None and not self._attempt.gradients:
            # A fused optimizer stepped by GradScaler without unscale_: its gradients still carry
            # the scale, which the optimizer's kernel takes off itself.
            self._gradients_seen(scaled=True)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._attempt is not None:
            self._attempt.stepped = True
            if not self._attempt.gradients and not self._attempt.through_scaler and self.in_step():
                self._gradients_seen(scaled=False)   # a closure's, with nobody to say when before
            if (self.scaler is None or not self._attempt.through_scaler) and not self._attempt.checked \
                    and self.in_step():
                self._unchecked_closure()

    def gradients_ready(self) -> None:
        """Without a GradScaler, the gradients are read here (a framework's hook between the
        backward and the update), and an update with inf/NaN among them is held back."""
        if self.in_step() and self.scaler is None:
            self._gradients_seen(scaled=False)
            self._hold_back_if_nonfinite()

    def _hold_back_if_nonfinite(self) -> None:
        """Without a GradScaler nothing skips for the loop: gradients holding inf/NaN are taken
        away before the optimizer steps, which then leaves every parameter as it was."""
        attempt = self._attempt
        if attempt is None or attempt.checked:
            return
        attempt.checked = True
        if nonfinite_flag(gradients_of(self.optimizer), self.device).item() > 0:
            drop_gradients(self.optimizer)
            attempt.held_back = True

    def _unchecked_closure(self) -> None:
        """An optimizer stepped with a closure computes its gradients inside step(), where no
        hook sees them before the update: said once, plainly."""
        if self._closure_said or self.run is None:
            return
        self._closure_said = True
        self.run.alert("unchecked_update", "this loop steps its optimizer with a closure and no GradScaler: "
                       "amp-tui can't check its gradients for inf/NaN before the update",
                       cause="the closure computes the gradients inside optimizer.step(), after every hook "
                       "amp-tui can put before the update",
                       fix="call monitor.gradients_ready() inside the closure after the backward, or use a GradScaler")

    def _attempt_starts(self) -> None:
        if self._attempt is None:
            lr = self.optimizer.param_groups[0].get("lr")
            self._attempt = UpdateAttempt(self.precision.scale,
                                     float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None)

    def _gradients_seen(self, *, scaled: bool) -> None:
        """The gradients of this update, as the optimizer will use them; and the weights before it."""
        self._attempt_starts()
        attempt = self._attempt
        if attempt.gradients:
            return
        attempt.gradients, attempt.scaled = True, scaled
        if self.probe.active:
            underflow = self.probe_schedule.underflow_due(self.step_index, self.underflow_every)
            self.probe.record_gradients(self.precision.scale, underflow=not scaled and underflow)
            self.probe.record_weights()
