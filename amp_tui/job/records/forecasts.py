"""A run's two forecasts, recorded (docs/session-format.md, "Forecasts"):

- the loss scale's: at each probed fp16 step, the step of GradScaler's next growth and whether it
  overflows (training/probes/scale_forecast.py). An overflow forecast is an `alert` with reason
  `forecast_scale`, once per growth; once its step is recorded, a `forecast_checked` event says
  whether the skip came;
- each layer's headroom (training/probes/headroom_trend.py): the steps left before its figure reaches
  the dtype's max, written with the probed step (`layers.eta`), and an `alert` with reason
  `forecast_layer` once a layer's ETA falls under the horizon.

The controller tells `observe` every step as it is handed over (`record_step`), before it is
recorded: the GradScaler's growth tracker read then is this step's, whichever driver ran it.
"""

from __future__ import annotations

from amp_tui.core.forecast_words import SKIP_WITHIN, scale_forecast_text
from amp_tui.core.precision import SHORT
from amp_tui.job.run_context import RunContext
from amp_tui.training.probes.headroom_trend import HeadroomForecast, LayerEta
from amp_tui.training.probes.scale_forecast import ScaleOutlook, largest, scale_outlook
from amp_tui.training.step.engine import StepResult

DEFAULT_HORIZON = 500   # steps: a layer's ETA under this raises its alert


class RunForecasts:
    def __init__(self, run: RunContext, horizon: int = DEFAULT_HORIZON):
        self.run = run
        self.horizon = horizon
        self.layers = HeadroomForecast()
        self._names: list[str] | None = None
        self._dtype: str | None = None
        self._warned: set[int] = set()                     # layers alerted in this dtype
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
        self._check_growths(result)
        self._count_clean_steps(result)
        if result.figures is None or result.nonfinite is not None:
            return
        self._forecast_layers(result)
        self._forecast_scale(result)

    # ---- the layers ---------------------------------------------------------------------------
    def _forecast_layers(self, result: StepResult) -> None:
        f = result.figures
        etas = self.layers.observe(result.step, result.dtype, result.scale, f.act, f.grad)
        if not etas:
            return
        column: list[int | None] = [None] * len(f.act)
        for eta in etas:   # the sooner of a layer's two
            if eta.index < len(column) and column[eta.index] is None:
                column[eta.index] = eta.steps
        result.eta = column
        for eta in etas:
            # Under a loss scaler, a gradient's overflow costs one skip and the scaler backs off
            # (the scale forecast says when its growth causes one): its ETA is shown, not alerted.
            if eta.figure == "grad" and result.scale is not None:
                continue
            if eta.steps < self.horizon and eta.index not in self._warned:
                self._warned.add(eta.index)
                self._layer_alert(result, eta)

    def _name(self, index: int) -> str:
        if self._names is None:
            self._names = [str(n) for n in self.run.driver.description().get("layers") or []]
        return self._names[index] if index < len(self._names) else f"layer {index}"

    def _layer_alert(self, result: StepResult, eta: LayerEta) -> None:
        name, dtype = self._name(eta.index), SHORT.get(result.dtype, result.dtype)
        what = "max |act|" if eta.figure == "act" else "max |grad| × scale"
        message = (f"{name} reaches {dtype}'s max in about {eta.steps} steps (step ~{result.step + eta.steps:,}): "
                   f"its {what} grows {eta.slope:.3g} bits a step, {eta.headroom:.1f} bits left")
        cause = (f"the {what} of {name} grows steadily toward {dtype}'s max (attention logits that grow "
                 "with training, without qk normalisation, are the known case)")
        fix = (f"run it in fp32 before it overflows (--fp32-modules '{name}', or fp32={name} from the "
               "dashboard or ctl), switch to bf16 (d), or lower the learning rate")
        self._alert(result.step, "forecast_layer", message, cause, fix, {
            "layer": name, "figure": eta.figure, "eta": eta.steps, "at_step": result.step + eta.steps,
            "headroom": round(eta.headroom, 2), "slope": float(f"{eta.slope:.4g}")})

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
        self._scale_alert(result, outlook, scaler.get_growth_interval())

    def _scale_alert(self, result: StepResult, outlook: ScaleOutlook, interval: int) -> None:
        cause = (f"the largest gradient times the scale ({outlook.scale:g}) is within one growth of fp16's "
                 f"max: after {interval} clean steps GradScaler grows the scale to {outlook.grown:g}, "
                 "which takes it over")
        fix = ("nothing: GradScaler skips that one update and falls back to the scale before; to avoid "
               "the skip, give the GradScaler a longer growth_interval, or train in bf16 (d)")
        self._alert(result.step, "forecast_scale", scale_forecast_text(outlook.growth_step, outlook.headroom),
                    cause, fix, {"growth_step": outlook.growth_step, "scale": outlook.scale,
                                 "grown": outlook.grown, "headroom": round(outlook.headroom, 2),
                                 "growth_interval": interval})

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
            self._clean = None
        self._next_scale = result.next_scale

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

    def _alert(self, step: int, reason: str, message: str, cause: str, fix: str, forecast: dict) -> None:
        # The controller's alert, with what was forecast as one object.
        self.run.event("alert", f"{message}. Likely cause: {cause}. Fix: {fix}", step=step, reason=reason,
                       cause=cause, fix=fix, forecast=forecast)
