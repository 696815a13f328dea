"""What a recorded step raises: its non-finite or calibration event, the guards' alerts and
moves, and --on-nonfinite's pause or stop. Apart from the controller so that what answers trouble
reads as one piece, whichever driver ran the step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from amp_tui.core.jsonsafe import encode_float
from amp_tui.job.records.run_records import FORWARD_KINDS, calibration_message, nonfinite_fields, nonfinite_message
from amp_tui.job.states import EXIT_NONFINITE_STOP, PauseReason

if TYPE_CHECKING:
    from amp_tui.job.run_context import RunContext
    from amp_tui.training.step.step_result import StepResult


class TroubleResponse:
    """The run's answer to each recorded step (see the module docstring). `bf16_ok`: the device
    computes bfloat16, so the guards may advise it."""

    def __init__(self, run: RunContext, *, bf16_ok: bool):
        self.run = run
        self.bf16_ok = bf16_ok

    def after_step(self, result: StepResult) -> None:
        run = self.run
        if result.nonfinite:
            self._on_nonfinite(result)
        elif result.calibration:
            run.event("calibration", calibration_message(result), step=result.step,
                      scale=encode_float(result.scale), next_scale=encode_float(result.next_scale))
        decisions = run.guard.observe(result, result.next_scale, self.bf16_ok)
        if decisions.clamp_scale is not None:
            run.precision.clamp(decisions.clamp_scale)
        for alert in decisions.alerts:
            run.alert(alert.reason, alert.message, cause=alert.cause, fix=alert.fix, step=result.step)
        if decisions.floor_reached:
            self.act_on_trouble("the loss scale reaching its floor", result.step)
        run.autopilot.after_step(result, decisions.move)   # the ladder's move, and --on-nonfinite isolate

    def _on_nonfinite(self, result: StepResult) -> None:
        run = self.run
        run.nonfinite_events += 1
        run.event("nonfinite", nonfinite_message(result, run.fix_words), step=result.step,
                  **nonfinite_fields(result))
        if (said := FORWARD_KINDS.get(result.nonfinite)) is not None:
            self.act_on_trouble(said, result.step)

    def act_on_trouble(self, said: str, step: int) -> None:
        """--on-nonfinite pause and stop, after `said` at `step`; the other policies go on (the
        guard decides; isolate: job/steering/autopilot.py)."""
        run = self.run
        if run.on_nonfinite == "pause" and run.state == "running":
            run.single_steps = 0
            run.pause_reason = PauseReason.NONFINITE
            run.set_state("paused")
            run.event("paused", f"paused after {said} at step {step} "
                                "(--on-nonfinite pause): change the dtype, cut the scale or restore",
                      reason="nonfinite")
        elif run.on_nonfinite == "stop":
            run.exit_status = EXIT_NONFINITE_STOP
            run.stop_requested.set()
            run.event("stopping", f"stopping after {said} at step {step} "
                                  "(--on-nonfinite stop)", reason="nonfinite")
