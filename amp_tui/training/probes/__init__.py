"""What is measured of a step: the per-layer probes, their schedule, and the forecasts made from
them."""
