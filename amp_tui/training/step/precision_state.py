"""The precision in force: the autocast dtype, the fp16 loss scale and where it starts.

One home for what `amp-tui train`'s engine and a monitored loop both track, with two ways of
holding the GradScaler:

- owned (`amp-tui train`): amp-tui's own scaler, made anew each time fp16 is entered (a
  disabled scaler's `state_dict()` is `{}` and can't be loaded back) and dropped on leaving it;
- borrowed (the user's loop): the loop's own scaler stays in the loop. Away from fp16 it scales
  by 1 (bf16 has fp32's range; a scale that fp16's overflows drove towards 0 must not follow)
  and still skips an update with inf/NaN gradients, so the skip count stays true, while the
  loop's view of it is the fp16 state it had. A loop with no enabled scaler gets amp-tui's
  scaling in fp16 (`BorrowedScaling` says how).

Either way the scale fp16 had is carried while away from it, and a change returns
{"before", "after"} as the recording has them (`describe()`).
"""

from __future__ import annotations

import math

import torch

from amp_tui.core import precision
from amp_tui.training.step.autocast import unsupported_reason


class PrecisionRefused(Exception):
    """A dtype or scale change that can't be applied; the run goes on unchanged."""


class PrecisionState:
    """The dtype, the live scale (a host copy: reading the scaler's forces a sync) and the fp16
    scale carried while away from fp16. Changes apply at step boundaries only."""

    def __init__(self, device: torch.device, dtype: str):
        self.device = torch.device(device)
        self.dtype = precision.canonical(dtype)
        reason = unsupported_reason(self.device, self.dtype)
        if reason:
            raise PrecisionRefused(reason)
        self.scaler: torch.amp.GradScaler | None = None   # the one that scales (None: no scaling)
        self.scale_value: float | None = None             # its scale, as last read
        self.fp16_scale: float | None = None               # where fp16 starts when next entered
        self.starting_scale: float | None = None

    @property
    def scale(self) -> float | None:
        """The loss scale in force (None: no loss scaling)."""
        return self.scale_value if self.scaler is not None else None

    @property
    def next_fp16_scale(self) -> float:
        return self.scale_value if self.dtype == "float16" and self.scaler is not None else self.fp16_scale

    def describe(self) -> dict:
        return {"dtype": self.dtype, "scale": self.scale, "init_scale": self.starting_scale,
                "fp16_scale": self.next_fp16_scale}

    def observed_scale(self, value: float) -> None:
        """The scaler's scale after its update, as read with the step's figures."""
        self.scale_value = value

    # ---- changes --------------------------------------------------------------------------
    def set_dtype(self, dtype: str) -> dict:
        new = precision.canonical(dtype)
        before = self.describe()
        if new == self.dtype:
            return {"before": before, "after": before}
        reason = unsupported_reason(self.device, new) or self._refuses(new)
        if reason:
            raise PrecisionRefused(reason)
        self._switch(self.dtype, new)
        self.dtype = new
        return {"before": before, "after": self.describe()}

    def set_scale(self, value: float | str) -> dict:
        """Set the loss scale (a number, or "half"); away from fp16, where fp16 starts again."""
        reason = self._refuses_scale()
        if reason:
            raise PrecisionRefused(reason)
        before = self.describe()
        current = self.next_fp16_scale
        new = current / 2.0 if value == "half" else float(value)
        if not (math.isfinite(new) and new > 0):
            raise PrecisionRefused(f"scale must be a positive finite number, got {value!r}")
        self._rescale(new)
        return {"before": before, "after": self.describe()}

    def clamp(self, value: float) -> None:
        """Hold the live scaler at `value` (a --min-scale guard), keeping its growth tracker."""
        if self.scaler is not None:
            self._load({**self.scaler.state_dict(), "scale": float(value)})

    def _load(self, state: dict) -> None:
        self.scaler.load_state_dict(state)
        self.scale_value = float(state["scale"])

    # ---- checkpoints ----------------------------------------------------------------------
    def scaler_state(self) -> dict | None:
        return dict(self.scaler.state_dict()) if self.scaler is not None else None

    def checkpoint_fields(self) -> dict:
        return {"init_scale": self.starting_scale, "fp16_scale": self.next_fp16_scale}

    # ---- what the two ways of holding the scaler do differently -------------------------------
    def _refuses(self, new: str) -> str | None:
        return None

    def _refuses_scale(self) -> str | None:
        return None

    def _switch(self, old: str, new: str) -> None:
        raise NotImplementedError

    def _rescale(self, new: float) -> None:
        raise NotImplementedError

    def restore_scaler(self, state: dict | None) -> None:
        raise NotImplementedError


class OwnedScaling(PrecisionState):
    """amp-tui's own GradScaler (`amp-tui train`): made on entering fp16, dropped on leaving.
    `init_scale` follows a scale the user sets: it is where the next fp16 entry starts."""

    def __init__(self, device: torch.device, dtype: str, init_scale: float):
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        super().__init__(device, dtype)
        self.starting_scale = self.fp16_scale = float(init_scale)
        if precision.uses_scaler(self.dtype):
            self._enter_fp16()

    def _enter_fp16(self) -> None:
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=self.fp16_scale)
        self.scale_value = self.fp16_scale

    def _switch(self, old: str, new: str) -> None:
        if self.scaler is not None:
            self.fp16_scale = self.scale_value
            self.scaler, self.scale_value = None, None
        if precision.uses_scaler(new):
            self._enter_fp16()

    def _rescale(self, new: float) -> None:
        self.starting_scale = self.fp16_scale = new
        if self.scaler is not None:
            self._load({**self.scaler.state_dict(), "scale": new, "_growth_tracker": 0})

    def restore_scaler(self, state: dict | None) -> None:
        """After the weights and optimizer: the checkpoint's scale where it belongs."""
        if state is None:
            return
        if self.scaler is not None:
            self._load(dict(state))
        else:
            self.fp16_scale = float(state["scale"])   # carried until fp16 is entered again


# The loop's model is the loop's: amp-tui converts no layer of it.
FP8_IN_OWN_LOOP = ("fp8 is switched live only under amp-tui train; in your own loop, convert the model "
                   "with torchao's convert_to_float8_training (module_filter_fn from the fp8 what-if's "
                   "filter file) and run it in bf16")

DEFAULT_INIT_SCALE = 2.0 ** 16   # GradScaler's own default, where a scaler amp-tui enables starts


class BorrowedScaling(PrecisionState):
    """The loop's own GradScaler, which the loop calls (`loop_scaler`):

    - enabled (the loop scales its loss): borrowed. Away from fp16 it scales by 1 and still skips
      an update with inf/NaN gradients; meanwhile the loop's view of it (`loop_state_dict`,
      `loop_load_state_dict`, which the driver puts in place of its `state_dict` and
      `load_state_dict`) is the fp16 state it had, so a checkpoint the loop saves holds what it
      would have had. Back in fp16 the scaler takes that state up again (scale and growth
      tracker; the starting scale if the scale had fallen below 1).
    - disabled, or none at all (`own`): amp-tui owns the scaling. In fp16 the scaler scales (a
      disabled one of the loop's, enabled in place; or, for a loop without one, a GradScaler
      amp-tui made, which the loop calls: `monitor.scaler`); away from fp16 it is disabled, its fp16
      state carried. `own=False` (a framework's loop, whose scaler is the framework's): fp16 is
      refused without a scaler, `fp16_fix` saying how to get one.
    """

    def __init__(self, device: torch.device, dtype: str, scaler: torch.amp.GradScaler | None, *,
                 fp16_fix: str = "pass scaler= to amp_tui.monitor", own: bool = True):
        super().__init__(device, dtype)
        self.fp16_fix = fp16_fix
        self.owned: torch.amp.GradScaler | None = None   # the scaler amp-tui enables in fp16
        self.made = False              # ... which amp-tui made (the loop had none)
        self._kept: dict | None = None   # the loop's fp16 state while away from fp16
        if scaler is not None and scaler.is_enabled():
            self.scaler = scaler
            self.scale_value = self.starting_scale = self.fp16_scale = scaler.get_scale()
            if self.dtype != "float16":
                self._step_away()
        elif own:
            self.made = scaler is None
            self.owned = scaler if scaler is not None else torch.amp.GradScaler(self.device.type, enabled=False)
            self.starting_scale = self.fp16_scale = DEFAULT_INIT_SCALE
            if self.dtype == "float16":
                self._enable_owned()
        self.loop_scaler = scaler if scaler is not None else self.owned   # the one the loop calls

    @property
    def scale(self) -> float | None:
        """The loss scale in force; None away from fp16 (nothing is scaled there)."""
        return self.scale_value if self.scaler is not None and self.dtype == "float16" else None

    def observed_scale(self, value: float) -> None:
        self.scale_value = value
        if self.scaler is not None and self.dtype != "float16" and value != 1.0:
            # A skip (or growth) away from fp16 moved it: it stays at 1 there.
            self._load({**self._live_state(), "scale": 1.0, "_growth_tracker": 0})

    def _refuses(self, new: str) -> str | None:
        if new == "float8":
            return FP8_IN_OWN_LOOP
        if new == "float16" and self.scaler is None and self.owned is None:
            return (f"fp16 needs a GradScaler and this loop has none (its gradients would underflow); "
                    f"{self.fp16_fix}")
        return None

    # ---- the scaler's state, bypassing what the driver put in place of its methods ------------
    def _live_state(self) -> dict:
        return dict(type(self.scaler).state_dict(self.scaler))

    def _load(self, state: dict) -> None:
        type(self.scaler).load_state_dict(self.scaler, state)
        self.scale_value = float(state["scale"])

    def _step_away(self) -> None:
        """Leave fp16 (or start away from it) with the loop's enabled scaler: its state kept, and
        the scaler scaling by 1."""
        self._kept = self._live_state()
        self.fp16_scale = float(self._kept["scale"])
        self._load({**self._kept, "scale": 1.0, "_growth_tracker": 0})

    def _fp16_state(self) -> dict | None:
        """The state fp16 takes up: the one kept, with the starting scale if it had fallen below 1."""
        state = self._kept
        if state is None:
            return None
        if self.fp16_scale < 1:
            return {**state, "scale": self.starting_scale, "_growth_tracker": 0}
        return {**state, "scale": self.fp16_scale}

    def _enable_owned(self) -> None:
        scaler = self.owned
        # GradScaler's own making, enabled (a scaler made disabled has none of its state).
        torch.amp.GradScaler.__init__(scaler, self.device.type, init_scale=self.fp16_scale)
        self.scaler = scaler
        self.scale_value = self.fp16_scale
        if (state := self._fp16_state()) is not None:
            self._load(state)
        self._kept = None

    def _switch(self, old: str, new: str) -> None:
        if self.owned is not None:
            if old == "float16":
                self._kept = self._live_state()
                self.fp16_scale = self.scale_value
                self.owned._enabled = False   # as the loop made it (or as amp-tui did)
                self.scaler, self.scale_value = None, None
            elif new == "float16":
                self._enable_owned()
            return
        if self.scaler is None:
            return
        if old == "float16":
            self._step_away()
        elif new == "float16":
            self._load(self._fp16_state())
            self._kept = None

    def _load_scale(self, scale: float) -> None:
        """At a boundary (no scaled loss in flight): the loop's scaler scales by `scale` from now."""
        self._load({**self._live_state(), "scale": scale, "_growth_tracker": 0})

    def _refuses_scale(self) -> str | None:
        return "this loop has no (enabled) GradScaler" if self.scaler is None and self.owned is None else None

    def _rescale(self, new: float) -> None:
        if self.dtype == "float16":
            self._load_scale(new)
        else:
            self.fp16_scale = new
            if self._kept is not None:
                self._kept = {**self._kept, "scale": new, "_growth_tracker": 0}

    # ---- checkpoints: amp-tui's, and the loop's own --------------------------------------------
    def scaler_state(self) -> dict | None:
        """What amp-tui's checkpoint keeps: the fp16 state (the one kept, away from fp16)."""
        if self._kept is not None:
            return dict(self._kept)
        return self._live_state() if self.scaler is not None else None

    def restore_scaler(self, state: dict | None) -> None:
        """The checkpoint's scaler state into the loop's scaler; away from fp16 it is kept for
        fp16's return (the scaler scales by 1 meanwhile, or is disabled when amp-tui owns it)."""
        if not state or (self.scaler is None and self.owned is None):
            return
        if self.dtype == "float16":
            self._load(dict(state))
        else:
            self._kept = dict(state)
            self.fp16_scale = float(state["scale"])

    def loop_state_dict(self, original) -> dict:
        """The loop's `scaler.state_dict()`: away from fp16, the state fp16 had (what the loop would
        have had without amp-tui's switch)."""
        if self._kept is not None and self.owned is None:
            return dict(self._kept)
        return original()

    def loop_load_state_dict(self, original, state: dict) -> None:
        """The loop's `scaler.load_state_dict(state)`: away from fp16, the state fp16 takes up."""
        if self._kept is not None and self.owned is None:
            self._kept = dict(state)
            self.fp16_scale = float(state["scale"])
            return
        original(state)
        if self.scaler is not None and state:
            self.scale_value = float(state["scale"])

    def give_back(self) -> None:
        """The monitor lets go: the loop's scaler as the loop would have it (its fp16 state back
        after a stay away from fp16; a scaler the loop made disabled, disabled again)."""
        if self.owned is not None:
            if not self.made:
                self.owned._enabled = False
            return
        if self._kept is not None and self.scaler is not None:
            self._load(self._kept)
            self._kept = None
