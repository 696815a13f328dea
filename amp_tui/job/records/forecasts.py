"""A run's two forecasts, recorded (docs/session-format.md, "Forecasts"):

- the loss scale's: at each probed fp16 step, the step of GradScaler's next growth and whether it
  overflows (training/probes/scale_forecast.py). That overflow costs one skipped update and the
  scaler backs off by itself: nothing needs doing, so it is a `forecast` event (reason
  `forecast_scale`, severity `info`), not an alert, once per growth; once its step is recorded, a
  `forecast_checked` event says whether the skip came. The step before each growth is probed
  (`probe_at`), so the gradients that show it are measured in time;
- each layer's headroom, and that of the ops inside a module's forward (training/probes/headroom_trend.py,
  op_probe.py): the steps left before its figure reaches the dtype's max, written with the probed
  step (`layers.eta`). An `alert` with reason `forecast_layer` comes once a layer's (or an op's)
  ETA falls under the horizon where the overflow needs doing something about: an activation's (no
  scaler catches a forward overflow) or a gradient's at every scale the run allows (the scale
  would have to fall under 1, or under --min-scale). A gradient that only overflows the scale in
  force costs one skip: a `forecast` event says it.

The soonest overflow a few probes suggest spaces the next probes (`limit_spacing`), before any
trend is proven.

The controller tells `observe` every step as it is handed over (`record_step`), before it is
recorded: the GradScaler's growth tracker read then is this step's, whichever driver ran it.
"""

from __future__ import annotations

import math

from amp_tui.core.forecast_words import SKIP_WITHIN, scale_forecast_text
from amp_tui.core.numfmt import scale_text
from amp_tui.core.precision import SHORT
from amp_tui.job.records.fp8_forecast import Fp8Forecast, fp8_forecast_words
from amp_tui.job.run_context import RunContext
from amp_tui.recording.forecast_outcomes import same_module
from amp_tui.training.probes.headroom_trend import HeadroomForecast, LayerEta
from amp_tui.training.probes.op_probe import split_key
from amp_tui.training.probes.scale_forecast import ScaleOutlook, largest, scale_outlook
from amp_tui.training.step.engine import StepResult

DEFAULT_HORIZON = 500   # steps: a layer's ETA under this raises its alert
# A gradient's overflow is said only within the rise its trend has shown (not REACH times it):
# gradients grow by thousands in the first hundred steps of training and settle, and at scale 1
# fp16's max is some twenty bits above a typical gradient.
GRAD_REACH = 1.0
GRAD_MIN_SPAN = 100   # steps a gradient's trend spans before it says anything (that growth lasts ~100)


def _related(a: str, b: str) -> bool:
    """One module is the other or holds it ("" is the model, which holds every one)."""
    return not a or not b or same_module(a, b)


class RunForecasts:
    def __init__(self, run: RunContext, horizon: int = DEFAULT_HORIZON):
        self.run = run
        self.horizon = horizon
        self.layers = HeadroomForecast()
        self.fp8 = Fp8Forecast(horizon)   # the recurring fp8 what-if's crests (fp8_forecast.py)
        self._names: list[str] | None = None
        self._dtype: str | None = None
        self._warned: set[str] = set()                     # modules alerted in this dtype
        self._alerted_now: list[str] = []                  # ... at the step being observed
        self._told: set[int] = set()                       # layers whose skip was forecast in this dtype
        self._growths: dict[int, tuple[int, float, float]] = {}   # growth step -> (alerted at, scale, grown)
        self._since_growth = 0   # steps run at a grown scale without a skip, while one is judged
        # GradScaler's count of clean steps, followed on the host from each step's scales (the
        # scaler's own is a device tensor: reading it costs a sync); None: to be read once.
        self._clean: int | None = None
        self._next_scale: float | None = None

    def observe(self, result: StepResult) -> None:
        if result.dtype != self._dtype:
            self._dtype = result.dtype
            self._warned.clear()
            self._told.clear()
            self.fp8.reset()
        if result.fp8 is not None and "error" not in result.fp8:
            self._forecast_fp8(result)
        self._check_growths(result)
        self._count_clean_steps(result)
        self._probe_before_growth(result)
        if result.figures is None or result.nonfinite is not None:
            return
        self._forecast_layers(result)
        self._forecast_scale(result)

    # ---- the layers ---------------------------------------------------------------------------
    def _forecast_layers(self, result: StepResult) -> None:
        f = result.figures
        floor = self._floor()
        etas = self.layers.observe(result.step, result.dtype, result.scale, f.act, f.grad,
                                   ops=f.ops, floor=floor)
        self._space_probes()
        if not etas:
            return
        column: list[int | None] = [None] * len(f.act)
        for eta in etas:   # the sooner of a layer's two
            if isinstance(eta.index, int) and eta.index < len(column) and column[eta.index] is None:
                column[eta.index] = eta.steps
        if any(v is not None for v in column):
            result.eta = column
        # The soonest first: of a module and one inside it (a query and the scores made from it)
        # trending at once, the alert names the one that overflows first.
        self._alerted_now = []
        for eta in sorted(etas, key=lambda eta: eta.steps):
            if eta.figure == "grad" and result.scale is not None:
                self._gradient_forecast(result, eta, floor)
            elif eta.steps < self.horizon:
                self._layer_alert(result, eta)

    def _floor(self) -> float:
        """The lowest scale worth keeping: 1, or the run's min_scale where that is higher."""
        min_scale = self.run.guard.config.min_scale
        return max(1.0, min_scale or 1.0)

    def _space_probes(self) -> None:
        schedule, rough = self.run.driver.probe_schedule, self.layers.rough
        if schedule is None:
            return
        if rough is None:
            schedule.limit_spacing(None)
            return
        what = "max |act|" if rough.figure == "act" else "max |grad| at the lowest scale"
        schedule.limit_spacing(rough.steps, f"{self._name(rough.index)}'s {what} rises, "
                                            f"~{rough.steps:,} steps from the dtype's max")

    def _gradient_forecast(self, result: StepResult, eta: LayerEta, floor: float) -> None:
        """A gradient under a loss scaler: overflowing the scale in force costs one skip (a
        forecast); overflowing at every scale the run allows is an alert."""
        if eta.rise < GRAD_MIN_SPAN * eta.slope:
            return   # a trend over fewer steps than early training's growth of the gradients lasts
        left = eta.headroom + math.log2(result.scale / floor)
        steps = max(0, math.ceil(left / eta.slope))
        if steps < self.horizon and left <= GRAD_REACH * eta.rise:
            self._layer_alert(result, LayerEta(eta.index, "grad", steps, left, eta.slope, eta.rise), floor=floor)
        elif eta.steps < self.horizon and eta.headroom <= GRAD_REACH * eta.rise and eta.index not in self._told:
            self._told.add(eta.index)
            name = self._name(eta.index)
            self._forecast(result.step, "forecast_layer",
                           f"{name}'s max |grad| × scale reaches fp16's max in about {eta.steps} steps: "
                           "1 skip, harmless", cause=f"the gradients of {name} grow toward the scale in force",
                           fix="nothing: GradScaler skips that update and backs off",
                           forecast={"layer": name, "figure": "grad", "eta": eta.steps,
                                     "at_step": result.step + eta.steps, "headroom": round(eta.headroom, 2),
                                     "slope": float(f"{eta.slope:.4g}")})

    def _name(self, index: int | str) -> str:
        if isinstance(index, str):
            return index
        if self._names is None:
            self._names = [str(n) for n in self.run.driver.description().get("layers") or []]
        return self._names[index] if index < len(self._names) else f"layer {index}"

    def _layer_alert(self, result: StepResult, eta: LayerEta, floor: float | None = None) -> None:
        op, module = split_key(eta.index) if isinstance(eta.index, str) else (None, self._name(eta.index))
        if module in self._warned or any(_related(module, other) for other in self._alerted_now):
            return
        self._warned.add(module)
        self._alerted_now.append(module)
        name, dtype = (eta.index if op else module), SHORT.get(result.dtype, result.dtype)
        what = ("max |act|" if eta.figure == "act" else
                f"max |grad| × the lowest scale ({scale_text(floor)})" if floor else "max |grad| × scale")
        message = (f"{name} reaches {dtype}'s max in about {eta.steps} steps (step ~{result.step + eta.steps:,}): "
                   f"its {what} grows {eta.slope:.3g} bits a step, {eta.headroom:.1f} bits left")
        if op:
            cause = (f"a value computed inside {module or 'the model'}'s forward ({op}) grows steadily toward "
                     f"{dtype}'s max: attention scores (q @ k.T) that grow with training are the known case")
        elif eta.figure == "act":
            cause = (f"the {what} of {name} grows steadily toward {dtype}'s max (attention logits that grow "
                     "with training, without qk normalisation, are the known case)")
        else:
            cause = (f"the gradients of {name} grow until they overflow {dtype} at every loss scale the run "
                     "allows: the scaler would back off under it, and every update would be skipped")
        fix = (f"run it in fp32 before it overflows (--fp32-modules '{module}', or fp32={module} from the "
               "dashboard or ctl), switch to bf16 (d), or lower the learning rate") if module else \
              "switch to bf16 (d), or lower the learning rate"
        forecast = {"layer": module, "figure": eta.figure, "eta": eta.steps, "at_step": result.step + eta.steps,
                    "headroom": round(eta.headroom, 2), "slope": float(f"{eta.slope:.4g}")}
        if op:
            forecast["op"] = op
        self._alert(result.step, "forecast_layer", message, cause, fix, forecast)

    def _forecast_fp8(self, result: StepResult) -> None:
        in_fp8 = result.dtype == "float8"
        for said in self.fp8.observe(result.step, result.fp8):
            message, cause, fix = fp8_forecast_words(said, in_fp8=in_fp8)
            forecast = {"layer": said["module"], "figure": "crest", **said}
            if in_fp8:
                self._alert(result.step, "forecast_fp8", message, cause, fix, forecast)
            else:
                self._forecast(result.step, "forecast_fp8", message, cause=cause, fix=fix, forecast=forecast)

    # ---- the loss scale -------------------------------------------------------------------------
    def _forecast_scale(self, result: StepResult) -> None:
        scaler = self.run.precision.scaler
        # GradScaler's count of clean steps has no public reader: a scaler without it is not forecast.
        tracker = getattr(scaler, "_get_growth_tracker", None)
        if tracker is None or result.next_scale is None or result.dtype != "float16":
            return
        grad = largest(result.figures.grad)
        if grad is None:
            return
        if self._clean is None:
            if self.run.precision.scale != result.next_scale:
                return   # the scaler has moved on since this step (a result handed over late)
            self._clean = tracker()
        outlook = scale_outlook(result.step, result.next_scale, self._clean,
                                scaler.get_growth_interval(), scaler.get_growth_factor(), grad)
        # Below zero bits the next step overflows at the scale already in force: the growth that
        # brought it there was the one to forecast (a forecast made before it, or none).
        if outlook is None or not outlook.overflows or outlook.headroom < 0 or outlook.growth_step in self._growths:
            return
        self._growths[outlook.growth_step] = (result.step, outlook.scale, outlook.grown)
        self._scale_forecast(result, outlook, scaler.get_growth_interval())

    def _scale_forecast(self, result: StepResult, outlook: ScaleOutlook, interval: int) -> None:
        cause = (f"the largest gradient times the scale ({scale_text(outlook.scale)}) is within one growth of "
                 f"fp16's max: after {interval} clean steps GradScaler grows the scale to "
                 f"{scale_text(outlook.grown)}, which takes it over")
        fix = ("nothing: GradScaler skips that one update and falls back to the scale before; to avoid "
               "the skip, give the GradScaler a longer growth_interval, or train in bf16 (d)")
        self._forecast(result.step, "forecast_scale", scale_forecast_text(outlook.growth_step, outlook.headroom),
                       cause=cause, fix=fix, forecast={
                           "growth_step": outlook.growth_step, "scale": outlook.scale, "grown": outlook.grown,
                           "headroom": round(outlook.headroom, 2), "growth_interval": interval})

    def _probe_before_growth(self, result: StepResult) -> None:
        """The step before GradScaler's next growth is probed: its gradients, times the grown
        scale, say whether the growth overflows (known to the step: once per growth_interval)."""
        schedule = self.run.driver.probe_schedule
        if schedule is None or self._clean is None or result.dtype != "float16" or result.next_scale is None:
            return
        interval = self.run.precision.scaler.get_growth_interval()
        growth_step = result.step + max(interval - self._clean, 1) + 1
        if growth_step - 2 > result.step:
            schedule.probe_at(growth_step - 2, f"its gradients times the grown scale say whether the growth "
                                               f"at step {growth_step:,} overflows")

    def _count_clean_steps(self, result: StepResult) -> None:
        """GradScaler's update: a step that changes the scale (a growth, a backoff) starts the
        count again, any other adds one. A scale the previous step did not leave (a command, a
        restore, a dtype change) makes the count unknown: it is read from the scaler again."""
        if result.scale is None or result.next_scale is None:
            self._clean = self._next_scale = None
            return
        if self._clean is not None and result.scale == self._next_scale:
            self._clean = 0 if result.next_scale != result.scale else self._clean + 1
        else:
            self._clean = self._tracker_now(result)
        self._next_scale = result.next_scale

    def _tracker_now(self, result: StepResult) -> int | None:
        """GradScaler's count read from the scaler (one device read, once per unknown count), where
        the scaler is still where this step left it; None: not readable, or an fp16 scaler absent."""
        if result.dtype != "float16":
            return None
        tracker = getattr(self.run.precision.scaler, "_get_growth_tracker", None)
        if tracker is None or self.run.precision.scale != result.next_scale:
            return None
        return int(tracker())

    def _check_growths(self, result: StepResult) -> None:
        """Each forecast growth once its step is here: did the grown scale skip an update within
        SKIP_WITHIN steps? Or once the scale changed before it (a skip, a command: the growth it
        forecast won't come)."""
        for growth_step in sorted(self._growths):
            alerted_at, scale, grown = self._growths[growth_step]
            if result.step < growth_step:
                before = result.step < growth_step - 1   # the step before the growth grows it
                if result.scale == scale and not (before and result.next_scale != scale):
                    continue
                del self._growths[growth_step]
                self._checked(alerted_at, growth_step, False, f"the scale changed at step {result.step:,}, "
                              f"before the growth: it comes later, if at all", result.step)
                continue
            at_grown = result.scale == grown
            waiting = result.step < growth_step + SKIP_WITHIN and result.step == growth_step + self._since_growth
            if at_grown and not result.skipped and waiting:
                self._since_growth += 1
                continue   # at the grown scale: a skip within SKIP_WITHIN steps is the growth's
            del self._growths[growth_step]
            self._since_growth = 0
            came = at_grown and result.skipped and waiting
            later = f" at step {result.step:,}" if result.step != growth_step else ""
            if came:
                said = f"the scale growth to {grown:g} at step {growth_step:,} overflowed{later}: 1 update skipped"
            elif not waiting:
                said = (f"the scale grew to {grown:g} at step {growth_step:,} and ran {SKIP_WITHIN} steps without "
                        "an overflow" if at_grown and result.step == growth_step + SKIP_WITHIN
                        else f"the run went elsewhere at step {result.step:,} (a restore, a resume)")
            elif result.step == growth_step:
                said = f"step {result.step:,} ran at scale {result.scale:g}, not {grown:g}: the scale did not grow then"
            else:
                said = f"the scale changed at step {result.step:,}, {SKIP_WITHIN} steps not yet run at {grown:g}"
            self._checked(alerted_at, growth_step, came, said, result.step)

    def _checked(self, alerted_at: int, growth_step: int, came: bool, said: str, step: int) -> None:
        self.run.event("forecast_checked", f"scale forecast of step {alerted_at:,} "
                       f"{'came true' if came else 'did not come true'}: {said}",
                       step=step, reason="forecast_scale", forecast_step=alerted_at,
                       growth_step=growth_step, came_true=came)

    def _forecast(self, step: int, reason: str, message: str, *, cause: str, fix: str, forecast: dict) -> None:
        """A forecast that needs nothing done: a `forecast` event the status bar, the event log and
        `report` show, never an alert."""
        self.run.event("forecast", f"{message}. Likely cause: {cause}. Fix: {fix}", step=step, reason=reason,
                       severity="info", cause=cause, fix=fix, forecast=forecast)

    def _alert(self, step: int, reason: str, message: str, cause: str, fix: str, forecast: dict) -> None:
        # The controller's alert, with what was forecast as one object.
        self.run.event("alert", f"{message}. Likely cause: {cause}. Fix: {fix}", step=step, reason=reason,
                       cause=cause, fix=fix, forecast=forecast)
