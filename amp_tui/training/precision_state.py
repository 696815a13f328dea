"""The precision in force: the autocast dtype, the fp16 loss scale and where it starts.

One home for what `amp-tui train`'s engine and a monitored loop both track, with two ways of
holding the GradScaler:

- owned (`amp-tui train`): amp-tui's own scaler, made anew each time fp16 is entered (a
  disabled scaler's `state_dict()` is `{}` and can't be loaded back) and dropped on leaving it;
- borrowed (the user's loop): the loop's own scaler stays in the loop. Away from fp16 it scales
  by 1 (bf16 has fp32's range; a scale that fp16's overflows drove towards 0 must not follow)
  and still skips an update with inf/NaN gradients, so the skip count stays true.

Either way the scale fp16 had is carried while away from it, and a change returns
{"before", "after"} as the recording has them (`describe()`).
"""

from __future__ import annotations

import math

import torch

from amp_tui.core import precision
from amp_tui.training.autocast import unsupported_reason


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


class BorrowedScaling(PrecisionState):
    """The loop's own GradScaler (maybe None or disabled: then nothing is scaled, and fp16 is
    refused with `fp16_fix` saying how to get one)."""

    def __init__(self, device: torch.device, dtype: str, scaler: torch.amp.GradScaler | None, *,
                 fp16_fix: str = "pass scaler= to amp_tui.monitor"):
        super().__init__(device, dtype)
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.fp16_fix = fp16_fix
        if self.scaler is not None:
            self.scale_value = self.starting_scale = self.fp16_scale = self.scaler.get_scale()

    def _refuses(self, new: str) -> str | None:
        if new == "float16" and self.scaler is None:
            return (f"fp16 needs a GradScaler and this loop has none (its gradients would underflow); "
                    f"{self.fp16_fix}")
        return None

    def _switch(self, old: str, new: str) -> None:
        if self.scaler is None:
            return
        if old == "float16":
            self.fp16_scale = self.scale_value
            self._load_scale(1.0)
        elif new == "float16":   # the scale fp16 had, or the starting one if it fell below 1
            self._load_scale(self.fp16_scale if self.fp16_scale >= 1 else self.starting_scale)

    def _load_scale(self, scale: float) -> None:
        """At a boundary (no scaled loss in flight): the loop's scaler scales by `scale` from now."""
        self._load({**self.scaler.state_dict(), "scale": scale, "_growth_tracker": 0})

    def _refuses_scale(self) -> str | None:
        return "this loop has no (enabled) GradScaler" if self.scaler is None else None

    def _rescale(self, new: float) -> None:
        if self.dtype == "float16":
            self._load_scale(new)
        else:
            self.fp16_scale = new

    def restore_scaler(self, state: dict | None) -> None:
        """The checkpoint's scaler state into the loop's scaler; away from fp16 its scale is kept
        for fp16's return (the scaler scales by 1 meanwhile)."""
        if state is None or self.scaler is None:
            return
        if self.dtype == "float16":
            self._load(dict(state))
        else:
            self.fp16_scale = float(state["scale"])
            self._load({**dict(state), "scale": 1.0})
