"""The loss-scale forecast: when GradScaler grows the scale next, and whether that growth overflows.

GradScaler multiplies the scale by its growth factor after `growth_interval` clean steps in a
row (its growth tracker counts them). The gradients fp16 holds in the backward are the true ones
times the scale, so when the largest of them times the scale in force is already more than
fp16's max over the growth factor (half of it for the default factor of 2), the first step at the
grown scale overflows: one skipped update, and the scale falls back. That is known to the step.

Pure arithmetic on host figures; job/records/forecasts.py reads the scaler and records what this says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from amp_tui.core.precision import MAX_FINITE


@dataclass(frozen=True)
class ScaleOutlook:
    growth_step: int       # the first step that runs at the grown scale
    scale: float           # the scale in force until then
    grown: float           # the scale from growth_step on
    headroom: float        # bits between the largest gradient times `scale` and fp16's max
    overflows: bool        # the grown scale takes that gradient past fp16's max


def scale_outlook(step: int, next_scale: float, tracker: int, interval: int, factor: float,
                  max_grad: float) -> ScaleOutlook | None:
    """After step `step` (its update left `tracker` clean steps counted and `next_scale` in
    force), with `max_grad` the largest true gradient it measured. None: nothing to forecast (no
    gradient measured, or one already non-finite, or a scaler that never grows)."""
    if not (max_grad > 0 and math.isfinite(max_grad) and next_scale > 0 and factor > 1 and interval > 0):
        return None
    headroom = math.log2(MAX_FINITE["float16"] / (max_grad * next_scale))
    return ScaleOutlook(growth_step=step + max(interval - tracker, 1) + 1, scale=next_scale,
                        grown=next_scale * factor, headroom=headroom, overflows=headroom < math.log2(factor))


def largest(values) -> float | None:
    """The largest finite figure of a layer list (None: none measured)."""
    found = [abs(v) for v in values or () if v is not None and math.isfinite(v)]
    return max(found) if found else None
