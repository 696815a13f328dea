"""The headroom trend (training/headroom_trend.py): a steady rise gives an ETA close to the truth;
noise, a trend too weak to tell from it, and a loss scale that jumps say nothing."""

from __future__ import annotations

import math
import random

from amp_tui.training.headroom_trend import MIN_POINTS, MIN_SPAN, HeadroomForecast, fit_trend
from amp_tui.training.scale_forecast import scale_outlook

FP16_BITS = math.log2(65504.0)


def test_a_steady_rise_gives_its_slope_and_the_steps_left():
    forecast = HeadroomForecast()
    rng = random.Random(0)
    etas = []
    for step in range(80):
        act = 2.0 ** (6 + 0.05 * step + rng.gauss(0, 0.05))   # 0.05 bits a step, a little noise
        etas = forecast.observe(step, "float16", 1024.0, [act], [1e-6])
    (eta,) = etas
    assert eta.figure == "act" and abs(eta.slope - 0.05) < 0.005
    truth = (FP16_BITS - (6 + 0.05 * 79)) / 0.05
    assert abs(eta.steps - truth) < 0.15 * truth


def test_noise_says_nothing():
    rng = random.Random(1)
    for _ in range(200):
        xs = [float(s) for s in range(32)]
        ys = [10 + rng.gauss(0, 0.3) for _ in xs]
        assert fit_trend(xs, ys) is None


def test_a_drift_buried_in_noise_says_nothing():
    rng = random.Random(2)
    found = 0
    for _ in range(200):
        xs = [float(s) for s in range(32)]
        ys = [10 + 0.005 * x + rng.gauss(0, 0.3) for x in xs]
        found += fit_trend(xs, ys) is not None
    assert found == 0


def test_too_few_points_or_steps_say_nothing():
    spacing = -(-MIN_SPAN // (MIN_POINTS - 1))   # enough for MIN_POINTS points to span MIN_SPAN steps
    xs = [float(spacing * s) for s in range(MIN_POINTS - 1)]
    assert fit_trend(xs, [x * 0.1 for x in xs]) is None
    xs = [float(spacing * s) for s in range(MIN_POINTS)]
    assert fit_trend(xs, [x * 0.1 for x in xs]) is not None
    xs = [float(s) for s in range(MIN_SPAN)]   # every step, one step short
    assert fit_trend(xs, [x * 0.1 for x in xs]) is None


def test_a_rise_that_flattens_or_takes_off_says_nothing():
    """The first steps' transient (a jump, then flat), a growth that slows down (gradients that
    grow early in training and settle), and early training's S-shaped rise caught on its way up:
    each fits a line well, and none rises steadily."""
    xs = [float(s) for s in range(MIN_SPAN + 1)]
    transient = [-2.4 + 5 * (1 - math.exp(-x / 4)) for x in xs]
    settling = [8 + 2 * math.log1p(x / 4) for x in xs]
    taking_off = [-2.6 + 10 / (1 + math.exp(-(x - 45) / 8)) for x in xs]
    assert fit_trend(xs, transient) is None
    assert fit_trend(xs, settling) is None
    assert fit_trend(xs, taking_off) is None
    assert fit_trend(xs, [8 + 0.05 * x for x in xs]) is not None


def test_a_growing_loss_scale_fakes_no_gradient_trend():
    """The gradients are the same each step; the scale doubles every 5 steps. Their product
    rises by a bit each time, which a fit of the scaled figure would take for a trend."""
    forecast = HeadroomForecast()
    for step in range(40):
        scale = 2.0 ** (4 + step // 5)
        etas = forecast.observe(step, "float16", scale, [1.0], [0.01 * (1 + 0.01 * (step % 3))])
        assert etas == []


def test_a_dtype_change_or_a_restore_starts_the_series_over():
    forecast = HeadroomForecast()
    for step in range(60):
        forecast.observe(step, "float16", None, [2.0 ** (4 + 0.1 * step)], [])
    assert forecast.observe(60, "float16", None, [2.0 ** 10], [])
    assert forecast.observe(61, "float32", None, [2.0 ** 10.1], []) == []
    assert forecast.observe(62, "float16", None, [2.0 ** 10.2], []) == []   # a new series, too short
    for step in range(63, 130):
        etas = forecast.observe(step, "float16", None, [2.0 ** (4 + 0.1 * step)], [])
    assert etas
    assert forecast.observe(10, "float16", None, [2.0 ** 5], []) == []   # restored to step 10


def test_no_eta_beyond_the_reach_of_the_trend():
    """A steady rise of 0.05 bits a step, 3 bits over the window, with 120 bits left (bf16):
    a real trend, but not one to extrapolate 40 times over."""
    forecast = HeadroomForecast()
    for step in range(80):
        etas = forecast.observe(step, "bfloat16", None, [2.0 ** (4 + 0.05 * step)], [])
    assert etas == []


def test_the_scale_outlook():
    # 39,322 of 65,504 at scale 1024: 0.74 bits left, the doubled scale overflows.
    outlook = scale_outlook(step=5, next_scale=1024.0, tracker=6, interval=20, factor=2.0, max_grad=38.4)
    assert outlook.growth_step == 5 + (20 - 6) + 1 and outlook.overflows and outlook.grown == 2048.0
    assert abs(outlook.headroom - math.log2(65504 / (38.4 * 1024))) < 1e-9
    assert not scale_outlook(step=5, next_scale=16.0, tracker=6, interval=20, factor=2.0, max_grad=38.4).overflows
    assert scale_outlook(step=5, next_scale=16.0, tracker=0, interval=20, factor=2.0, max_grad=math.inf) is None
