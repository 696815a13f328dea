"""The loss-scale forecast in words: the run's alert (job/forecasts.py) and the dashboard's status
bar say it the same way."""

from __future__ import annotations


def scale_forecast_text(growth_step: int, headroom: float) -> str:
    return f"next scale growth at step {growth_step:,} will overflow (head: {headroom:.1f} bits): 1 skip, harmless"
