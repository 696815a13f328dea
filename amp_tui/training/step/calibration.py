"""GradScaler's calibration: the skips it makes at the start of an fp16 run to find its scale.

GradScaler starts high (65536 by default) and halves the scale on each overflow, so the first
steps of a healthy fp16 run often skip an update or a few while the scale comes down to what the
gradients allow. Those skips are how GradScaler works, not trouble: they are recorded as
calibration, not as non-finite steps, and neither replay the step op by op nor make the probes
escalate. A few in a row before the first update is applied are calibration; one more in a row is
the scale starting far too high for these gradients, and from there every skip is trouble again
(the guard's `scale_drops` alert comes at that one, training/step/guards.py). A start above GradScaler's
own default is a scale someone chose (`--init-scale`, `init_scale=`), and its overflow is theirs
to see: it is reported as any other.
"""

from __future__ import annotations

# The most skips in a row at the start taken for calibration: 65536 down to 4096. One more is the
# guard's default `alert_scale_drops` (5): a scale that falls that far says the start is wrong.
CALIBRATION_SKIPS = 4
# GradScaler's default starting scale (torch.amp.GradScaler's init_scale).
GRADSCALER_DEFAULT_SCALE = 2.0 ** 16


class ScaleCalibration:
    """Whether a step's skip is GradScaler calibrating its scale; over at the first step that is
    anything else (an update applied, a non-finite loss, an update amp-tui held back)."""

    def __init__(self, limit: int = CALIBRATION_SKIPS):
        self.limit = limit
        self.skips = 0
        self.over = False

    def judge(self, *, skipped: bool, gradients_only: bool, scale: float | None) -> bool:
        """True: this step is one of the calibration's skips. `gradients_only`: the loss was
        finite and only the scaled gradients overflowed; `scale`: the GradScaler's scale on this
        step (None: no GradScaler scaled the loss)."""
        calibrating_scale = scale is not None and 0 < scale <= GRADSCALER_DEFAULT_SCALE
        if not self.over and skipped and gradients_only and calibrating_scale and self.skips < self.limit:
            self.skips += 1
            return True
        self.over = True
        return False

    def end(self) -> None:
        """A scale that is not the starting one (a checkpoint's, a resume's): nothing to calibrate."""
        self.over = True
