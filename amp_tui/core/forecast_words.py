"""The loss-scale forecast in words: the run's alert (job/records/forecasts.py) and the dashboard's status
bar say it the same way."""

from __future__ import annotations

# A scale forecast comes true when the grown scale skips an update within this many steps of the
# growth: the largest gradient varies from step to step, and the one that overflows the doubled
# scale may come a step or two after it (both the run and the read side judge it so).
SKIP_WITHIN = 10


def scale_forecast_text(growth_step: int, headroom: float) -> str:
    return f"next scale growth at step {growth_step:,} will overflow (head: {headroom:.1f} bits): 1 skip, harmless"
