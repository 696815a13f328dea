"""Guards on top of GradScaler: a minimum scale, alerts that name the likely cause and the fix,
and the fallback ladder fp16 -> bf16 -> fp32 (fp8 -> bf16 -> fp32).

The guard only decides; the run applies its decisions at the step boundary and records them, so
every automatic move is an ordinary `intervention` event that says why.

Its advice is a rule of thumb until the op replay (step_trace.py) has verified a fix on a step of
this dtype: from then on the alerts give that fix, the one the non-finite events name, in the
words of the way of running (`words`, core/fixes.py's `fix_in_words`).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Callable

from amp_tui.core import precision
from amp_tui.training.step.engine import StepResult
from amp_tui.training.step.update_guard import scale_floor


@dataclass
class GuardConfig:
    min_scale: float | None = None       # never let the scale fall below this (None: update_guard.SCALE_FLOOR)
    alert_scale_drops: int = 5            # alert when the scale falls this many times in a row
    alert_skip_share: float = 0.25        # alert when this share of a window's updates is skipped
    alert_window: int = 100
    fallback: bool = False                # --on-nonfinite fallback
    fallback_after: int = 3               # consecutive non-finite steps before moving down the ladder
    storm_share: float = 0.5              # ... or this share of skipped updates
    storm_window: int = 20                # ... over this many steps in the current dtype
    rollback: bool = False                # restore the newest good checkpoint before moving
    isolate_widen: int = 2                # --on-nonfinite isolate: enclosing modules tried before the ladder
    forecast_horizon: int = 500           # a layer's forecast alert: its ETA under this many steps


@dataclass
class Alert:
    reason: str       # scale_below_one / scale_drops / skip_share / min_scale / ...
    message: str
    cause: str
    fix: str


@dataclass
class LadderMove:
    to_dtype: str
    reason: str
    rollback_before: int | None  # restore the newest checkpoint saved at or before this step


@dataclass
class Decisions:
    alerts: list[Alert] = field(default_factory=list)
    clamp_scale: float | None = None
    floor_reached: bool = False   # the scale just reached its floor: the run's policy acts on it
    move: LadderMove | None = None


def next_rung(dtype: str, bf16_ok: bool) -> str | None:
    if dtype == "float16":
        return "bfloat16" if bf16_ok else "float32"
    if dtype == "float8":   # its layers back to bf16, the weights as fp8 trained them
        return "bfloat16"
    if dtype == "bfloat16":
        return "float32"
    return None


GROWTH = 2.0  # "growing": each of the last LOSS_RUN losses above GROWTH times the trend's floor
LOSS_RUN = 3


class LossTrend:
    """Whether the loss of one dtype keeps growing.

    The floor is the lowest "highest of LOSS_RUN finite losses in a row" seen so far; the loss
    grows when each of the last LOSS_RUN finite losses is above GROWTH times that floor. Batch
    noise moves single losses both ways and never lifts a whole run of them that far; a
    diverging model does within a few steps. Skipped updates leave the weights as they were, so
    a loss scale that overflows holds the loss level: growth comes from the updates applied.
    """

    def __init__(self):
        self._recent: collections.deque[float] = collections.deque(maxlen=LOSS_RUN)
        self.floor = math.inf
        self.last: float | None = None

    def add(self, loss: float) -> None:
        if not math.isfinite(loss):
            return
        self.last = loss
        self._recent.append(abs(loss))
        if len(self._recent) == LOSS_RUN:
            self.floor = min(self.floor, max(self._recent))

    @property
    def known(self) -> bool:
        """Enough losses to tell growth from noise."""
        return self.floor < math.inf

    @property
    def growing(self) -> bool:
        return self.known and len(self._recent) == LOSS_RUN and min(self._recent) > GROWTH * self.floor


class PrecisionGuard:
    def __init__(self, config: GuardConfig, words: Callable[[str], str] = str):
        """`words`: a fix flag (`--dtype bf16`) as the way of running takes it."""
        self.config = config
        self.words = words
        self._verified: tuple[str, int] | None = None   # the newest verified fix in this dtype, its step
        self._trends: dict[str, LossTrend] = {}   # by dtype, kept across dtype changes
        self._drops = 0
        self._bad_streak = 0
        self._window: collections.deque[bool] = collections.deque(maxlen=max(1, config.alert_window))
        self._window_skips = 0   # how many of _window are True (kept as it moves, not summed each step)
        # (step, skipped) over the storm window: where a storm began matters for --rollback
        self._storm: collections.deque[tuple[int, bool]] = collections.deque(maxlen=max(1, config.storm_window))
        self._raised: set[str] = set()
        self._dtype: str | None = None
        self._streak_scale: float | None = None  # the scale when the current run of drops began
        self._now_scale: float | None = None
        self._last_layer: str | None = None
        self._clamped_last = False
        self._ladder_exhausted = False

    def observe(self, result: StepResult, new_scale: float | None, bf16_ok: bool) -> Decisions:
        out = Decisions()
        self._tally(result)
        if new_scale is not None and result.scale is not None:
            self._watch_scale(result, new_scale, out)
        self._watch_skip_share(result, out)
        if self.config.fallback and not self._ladder_exhausted:
            self._climb_down(result, bf16_ok, out)
        return out

    def _tally(self, result: StepResult) -> None:
        """The step counted in the windows and streaks the guards read."""
        if result.dtype != self._dtype:  # a new dtype starts with a clean slate
            self._dtype = result.dtype
            self._drops, self._bad_streak = 0, 0
            self._window.clear()
            self._window_skips = 0
            self._storm.clear()
            self._raised.clear()
            self._verified = None   # a fix verified in another dtype says nothing of this one
        trace = result.op_trace or {}
        if trace.get("fix_verified") and isinstance(trace.get("fix"), str):
            self._verified = (trace["fix"], result.step)
        bad = result.nonfinite is not None
        self._trends.setdefault(result.dtype, LossTrend()).add(result.loss)
        if result.first_nonfinite_layer:
            self._last_layer = result.first_nonfinite_layer
        # GradScaler's calibration skips at the start are how it finds its scale, not a share of
        # trouble; they still count as drops of the scale (a 5th in a row is no calibration).
        troubled = bool(result.skipped) and not result.calibration
        if len(self._window) == self._window.maxlen:
            self._window_skips -= self._window[0]
        self._window.append(troubled)
        self._window_skips += self._window[-1]
        self._storm.append((result.step, troubled))
        self._bad_streak = self._bad_streak + 1 if bad else 0

    def _watch_scale(self, result: StepResult, new_scale: float, out: Decisions) -> None:
        """The scale's floor and its alerts: below 1, and falling too many times in a row."""
        cfg = self.config
        dropped = new_scale < result.scale
        if dropped and self._drops == 0:
            self._streak_scale = result.scale
        self._drops = self._drops + 1 if dropped else 0
        self._now_scale = new_scale
        floor = scale_floor(cfg.min_scale)
        if new_scale < floor:
            # GradScaler would go on halving, to 0 in the end, where it applies NaN updates
            # (training/step/update_guard.py): held at the floor, the updates skip until they fit.
            out.clamp_scale = floor
            if not self._clamped_last:
                out.floor_reached = True
                out.alerts.append(self._alert(
                    "min_scale", f"the loss scale reached its floor ({floor:g}, {self._floor_words()}): "
                    f"it would have fallen to {new_scale:g}; held at {floor:g}, the updates skipped "
                    "until the gradients fit", result))
            self._clamped_last = True
        else:
            self._clamped_last = False
        effective = out.clamp_scale or new_scale
        if effective < 1 and "scale_below_one" not in self._raised:
            self._raised.add("scale_below_one")
            out.alerts.append(self._alert(
                "scale_below_one", f"the loss scale fell below 1 ({effective:g})", result))
        if self._drops >= cfg.alert_scale_drops and "scale_drops" not in self._raised:
            self._raised.add("scale_drops")
            out.alerts.append(self._alert(
                "scale_drops", f"the loss scale fell {self._drops} times in a row", result))
        if self._drops == 0:
            self._raised.discard("scale_drops")

    def _watch_skip_share(self, result: StepResult, out: Decisions) -> None:
        """The share of skipped updates in the alert window."""
        cfg = self.config
        share = self._window_skips / len(self._window)
        if (len(self._window) >= min(cfg.alert_window, 10) and share > cfg.alert_skip_share
                and "skip_share" not in self._raised):
            self._raised.add("skip_share")
            out.alerts.append(self._alert(
                "skip_share", f"{share:.0%} of the last {len(self._window)} updates were skipped "
                f"(alert above {cfg.alert_skip_share:.0%})", result))
        elif share <= cfg.alert_skip_share / 2:
            self._raised.discard("skip_share")

    def _climb_down(self, result: StepResult, bf16_ok: bool, out: Decisions) -> None:
        """The fallback ladder: a move down once the floor, a streak or a storm says so."""
        cfg = self.config
        skipped_steps = [step for step, skipped in self._storm if skipped]
        why, since = None, None
        if out.floor_reached:
            why = f"the loss scale reached its floor in {precision.SHORT[result.dtype]}"
            since = skipped_steps[0] if skipped_steps else result.step
        elif self._bad_streak >= cfg.fallback_after:
            why = f"{self._bad_streak} non-finite steps in a row in {precision.SHORT[result.dtype]}"
            since = result.step - self._bad_streak + 1
        elif (len(self._storm) >= cfg.storm_window
              and len(skipped_steps) / len(self._storm) >= cfg.storm_share):
            why = (f"skip storm: {len(skipped_steps)} of the last {len(self._storm)} updates skipped "
                   f"in {precision.SHORT[result.dtype]}")
            since = skipped_steps[0]
        if why:
            target = next_rung(result.dtype, bf16_ok)
            if target is None:
                self._ladder_exhausted = True
                out.alerts.append(Alert(
                    "ladder_exhausted", f"{why}, and fp32 is the last rung",
                    "fp32 fails too: this is not a precision problem",
                    "look at the learning rate, the data and the loss; restore a checkpoint (r)"))
            else:
                out.move = LadderMove(target, why, since if cfg.rollback else None)

    def _floor_words(self) -> str:
        return "its min_scale" if self.config.min_scale is not None else "amp-tui's default"

    def _alert(self, reason: str, message: str, result: StepResult) -> Alert:
        cause, fix = self.likely_cause(result)
        return Alert(reason, message, cause, self._deferred(fix, result.dtype))

    def _deferred(self, advice: str, dtype: str) -> str:
        """The guard's advice gives way to the fix the op replay verified, which the non-finite
        events name; except where the loss grows in every dtype: a fix that makes one step
        finite does not make the training converge, and the advice says so."""
        if self._verified is None:
            return advice
        fix, step = self._verified
        verified = f"{self.words(fix)} (verified on step {step})"
        if self._divergence(dtype) is not None:
            return f"{advice} (the fix verified on step {step}, {self.words(fix)}, only made that step finite)"
        return verified

    def likely_cause(self, result: StepResult) -> tuple[str, str]:
        """What usually causes this under AMP, applied to what this run shows: a loss growing in
        every dtype diverges; an fp16 overflow of a large loss times a large scale; a scale below 1
        from a model trained in bf16; a layer whose values leave fp16's range."""
        layer = self._last_layer
        diverging = self._divergence(result.dtype)
        if diverging is not None:
            return diverging
        if result.scale is None:
            return self._cause_without_scaler(result.dtype, layer)
        if result.nonfinite in ("loss", "activations") and layer:
            return (f"an activation overflows fp16's 65504 in {layer}",
                    f"switch to bf16 (d), or run that layer in fp32: {self.words(f'--fp32-modules {layer!r}')}")
        if (self._now_scale is not None and self._now_scale < 1) or "scale_below_one" in self._raised:
            # Halving all the way below 1 with a finite loss: fp16 lacks the range, not the scale.
            return ("gradients need more range than fp16 has, typical of a model trained in bf16 "
                    "being fine-tuned in fp16",
                    f"switch to bf16 (d, or {self.words('--dtype bf16')}): fine-tune a bf16-trained model in bf16")
        scale = max(result.scale or 0.0, self._streak_scale or 0.0)
        loss = abs(result.loss) if result.loss == result.loss else 0.0
        if scale >= 1024 and loss * scale > 65504 and result.nonfinite != "loss":
            now = self._now_scale or scale
            start = 2.0 ** math.floor(math.log2(now)) if now >= 1 else 1.0
            return (f"a large loss ({loss:.3g}) times a large loss scale ({scale:g}) overflows the "
                    "fp16 backward pass",
                    f"lower the scale (s, S), or start lower next time: {self.words(f'--init-scale {start:g}')} "
                    "or less")
        if layer:
            return (f"values overflow fp16 around {layer}",
                    f"switch to bf16 (d), or {self.words(f'--fp32-modules {layer!r}')}")
        return ("values leave fp16's range (max 65504)", "lower the scale (s) or switch to bf16 (d)")

    def _divergence(self, dtype: str) -> tuple[str, str] | None:
        """The loss grows in this dtype and in every other one the run has trained in long enough:
        the training diverges, and neither the loss scale nor the dtype is to blame."""
        trend = self._trends.get(dtype)
        if trend is None or not trend.growing:
            return None
        known = {d: t for d, t in self._trends.items() if t.known}
        if any(not t.growing for t in known.values()):
            return None   # another dtype trains fine: this one's range is the problem
        names = " and ".join(precision.SHORT[d] for d in precision.SHORT if d in known)
        check = "" if "float32" in known else "; fp32 (d) confirms it"
        return (f"the loss keeps growing in {names} ({trend.floor:.3g} → {trend.last:.3g}): the "
                "training diverges, which no loss scale or dtype fixes",
                f"lower the learning rate or clip the gradients (max_grad_norm); check the data and "
                f"the loss; restore a checkpoint (r){check}")

    @staticmethod
    def _cause_without_scaler(dtype: str, layer: str | None) -> tuple[str, str]:
        """bf16 and fp32 have no loss scale to blame, and fp32's range is the widest there is."""
        where = f" around {layer}" if layer else ""
        if dtype == "float32":
            return (f"values become non-finite in fp32{where}: this is not a precision problem",
                    "look at the learning rate, the data and the loss; restore a checkpoint (r)")
        if dtype == "float8":
            return (f"values become non-finite in fp8{where}: its casts scale each tensor by its amax, "
                    "so an inf/NaN already in a tensor spreads through the whole cast",
                    "back to bf16 (d): if it fails there too, look at the learning rate, the data and the loss")
        return (f"values become non-finite in {precision.SHORT[dtype]}{where}, which has fp32's range: "
                "rarely a precision problem",
                "try fp32 (d): if it fails there too, look at the learning rate, the data and the loss")
