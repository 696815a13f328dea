"""A step's outcome, the same for both drivers: which kind of non-finite step it was (or a skip of
GradScaler's calibration), the run's counts moved on, and its StepResult built.

GuardedTrainer (amp-tui's own loop) and the hook driver (the user's loop) find out differently
whether a step overflowed, but they classify and count it here, so a step means the same in a
recording whichever loop ran it.
"""

from __future__ import annotations

import torch

from amp_tui.training.probes.layer_probes import LayerFigures
from amp_tui.training.step.calibration import ScaleCalibration
from amp_tui.training.step.step_result import NonfiniteKind, StepResult


class StepOutcomes:
    """The counts a run's steps add up to (checkpoints save and restore them), and the step that
    comes next."""

    def __init__(self) -> None:
        self.step_index = 0
        self.updates_applied = 0
        self.skipped_total = 0
        self.calibration = ScaleCalibration()

    def classify(self, *, loss_finite: bool, skipped: bool, gradients_nonfinite: bool = False,
                 held_back: bool = False, scale: float | None) -> tuple[NonfiniteKind | None, bool]:
        """(the kind of non-finite step, or None; whether it is a calibration skip).

        `skipped`: the update was not applied (held back by amp-tui included); `held_back`: amp-tui
        kept inf/NaN gradients that GradScaler missed from applying, which no calibration explains;
        `scale`: the GradScaler scale the step's backward used (None: no GradScaler scaled it)."""
        if not loss_finite:
            kind = "loss"
        elif skipped or gradients_nonfinite or held_back:
            kind = "gradients"
        else:
            kind = None
        calibrating = self.calibration.judge(skipped=skipped, gradients_only=kind == "gradients" and not held_back,
                                             scale=scale)
        return (None if calibrating else kind), calibrating

    def close(self, *, skipped: bool, applied: bool, lr=None, **fields) -> StepResult:
        """The step's result, with the counts that take it in. The step counter moves on first:
        `ctl status`, read from another thread (the counts, then the step) while the step is
        recorded or replayed under the op tracer, never counts a step the counter has not passed."""
        step, self.step_index = self.step_index, self.step_index + 1
        if skipped:
            self.skipped_total += 1
        elif applied:
            self.updates_applied += 1
        return StepResult(step=step, skipped=skipped, skipped_total=self.skipped_total,
                          updates_applied=self.updates_applied,
                          lr=float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None, **fields)


def first_nonfinite_layer(figures: LayerFigures | None, kind: str, names: list[str]) -> str | None:
    """The first layer whose figures hold inf/NaN: its output for a non-finite loss, its gradient
    otherwise."""
    if figures is None:
        return None
    index = figures.first_nonfinite("act" if kind == "loss" else "grad")
    return names[index] if index is not None else None


class CountedSteps:
    """The counts of a driver's `outcomes`, read and set (a checkpoint's resume) as its own."""

    outcomes: StepOutcomes

    step_index = property(lambda self: self.outcomes.step_index,
                          lambda self, value: setattr(self.outcomes, "step_index", value))
    updates_applied = property(lambda self: self.outcomes.updates_applied,
                               lambda self, value: setattr(self.outcomes, "updates_applied", value))
    skipped_total = property(lambda self: self.outcomes.skipped_total,
                             lambda self, value: setattr(self.outcomes, "skipped_total", value))

    @property
    def calibration(self) -> ScaleCalibration:
        return self.outcomes.calibration
