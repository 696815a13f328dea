"""The headroom trend (training/probes/headroom_trend.py): a steady rise gives an ETA close to the truth;
noise, a trend too weak to tell from it, and a loss scale that jumps say nothing."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter

import numpy as np

from amp_tui.training.probes.headroom_trend import (
    LATEST_PAIRS,
    MIN_HALF,
    MIN_POINTS,
    MIN_RISING,
    MIN_SPAN,
    STEADY,
    WINDOW,
    HeadroomForecast,
    Trend,
    _median,
    fit_trend,
    screen,
)
from amp_tui.training.probes.scale_forecast import scale_outlook

FP16_BITS = math.log2(65504.0)


def test_a_steady_rise_gives_its_slope_and_the_steps_left():
    forecast = HeadroomForecast()
    rng = random.Random(0)
    etas = []
    for step in range(80):
        act = 2.0 ** (7 + 0.05 * step + rng.gauss(0, 0.05))   # 0.05 bits a step, a little noise
        etas = forecast.observe(step, "float16", 1024.0, [act], [1e-6])
    (eta,) = etas
    assert eta.figure == "act" and abs(eta.slope - 0.05) < 0.005
    truth = (FP16_BITS - (7 + 0.05 * 79)) / 0.05
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


# The fit as first written, in plain Python: fit_trend must give exactly what it gives.
def _reference_theil_sen(xs, ys):
    n = len(xs)
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n) if xs[j] != xs[i]]
    if not slopes:
        return 0.0, 0.0
    return statistics.median(slopes), sum(s > 0 for s in slopes) / len(slopes)


def _reference_fit(xs, ys):
    """The reference's Trend or None, and which test ended it (for the coverage of the cases)."""
    n = len(xs)
    if n < MIN_POINTS or xs[-1] - xs[0] < MIN_SPAN:
        return None, "short"
    mx, my = sum(xs) / n, sum(ys) / n
    if not screen(n, sum((x - mx) ** 2 for x in xs), sum((x - mx) * (y - my) for x, y in zip(xs, ys)),
                  sum((y - my) ** 2 for y in ys)):
        return None, "screen"
    robust, rising = _reference_theil_sen(xs, ys)
    if robust <= 0 or rising < MIN_RISING:
        return None, "robust"
    middle, last_quarter = xs[0] + (xs[-1] - xs[0]) / 2, xs[0] + 3 * (xs[-1] - xs[0]) / 4
    older_part = [(x, y) for x, y in zip(xs, ys) if x < middle]
    recent_part = [(x, y) for x, y in zip(xs, ys) if x >= middle]
    if min(len(older_part), len(recent_part)) < MIN_HALF:
        older_part, recent_part = list(zip(xs, ys))[:n // 2], list(zip(xs, ys))[n // 2:]
    if not (_has_pair(older_part) and _has_pair(recent_part)):
        return None, "steady"
    older, _ = _reference_theil_sen(*zip(*older_part))
    recent, _ = _reference_theil_sen(*zip(*recent_part))
    if recent <= 0 or not STEADY * older <= recent <= older / STEADY:
        return None, "steady"
    last = [(x, y) for x, y in zip(xs, ys) if x >= last_quarter]
    last_xs, last_ys = [x for x, _ in last], [y for _, y in last]
    pairs = sum(1 for i in range(len(last_xs)) for j in range(i + 1, len(last_xs)) if last_xs[j] != last_xs[i])
    if pairs >= LATEST_PAIRS and _reference_theil_sen(last_xs, last_ys)[0] < STEADY * robust:
        return None, "flattening"
    intercept = statistics.median(y - robust * x for x, y in zip(xs, ys))
    return Trend(min(robust, recent), intercept + robust * xs[-1]), "trend"


def _has_pair(points) -> bool:
    """Two points of a part at different steps (a slope to take)."""
    return len({x for x, _ in points}) >= 2


def _random_series(rng):
    n = rng.randint(MIN_POINTS, WINDOW)
    kind = rng.choice(("rising", "rising", "noisy", "flat", "ties", "outliers", "bend", "stairs",
                       "repeated_x"))
    x, xs = float(rng.randint(0, 500)), []
    for _ in range(n):
        xs.append(x)
        x += rng.choice((1.0, 2.0, 3.0)) if kind != "repeated_x" else rng.choice((0.0, 0.0, 2.0, 3.0, 5.0))
    slope = rng.uniform(0.0, 0.1)
    noise = {"rising": 0.02, "noisy": 0.3, "flat": 0.2}.get(kind, 0.05) * rng.uniform(0.2, 2.0)
    base = rng.uniform(-20, 10)
    ys = [base + slope * (x - xs[0]) + rng.gauss(0, noise) for x in xs]
    if kind == "flat":
        ys = [y - slope * (x - xs[0]) for x, y in zip(xs, ys)]
    elif kind == "ties":     # figures on a coarse grid: many equal slopes, many of them zero
        ys = [round(y * 4) / 4 for y in ys]
    elif kind == "stairs":   # a few coarse steps up: most pairs level (no rise), a line fits well
        unit = rng.uniform(0.5, 2.0) * slope * (xs[-1] - xs[0]) / 4
        ys = [unit * round(y / unit) if unit else y for y in ys]
    elif kind == "outliers":
        for k in rng.sample(range(n), 3):
            ys[k] += rng.choice((-3.0, 3.0))
    elif kind == "bend":     # the rise slows or speeds up half way
        half, bent = xs[n // 2], rng.choice((0.3, 0.6, 1.5, 3.0))
        ys = [y + (bent - 1) * slope * max(x - half, 0.0) for x, y in zip(xs, ys)]
    return xs, ys


def test_the_fit_is_the_plain_python_fit_bit_for_bit():
    """The same Trend (the same floats, to the bit) or None as the plain-Python Theil-Sen fit, on
    random series of every length from MIN_POINTS to WINDOW: rising, flat, noisy, on a coarse grid,
    with outliers, bending, and with points at the same step."""
    rng = random.Random(3)
    ends = Counter()
    for _ in range(3000):
        xs, ys = _random_series(rng)
        want, end = _reference_fit(xs, ys)
        got = fit_trend(xs, ys)
        ends[end] += 1
        if want is None:
            assert got is None, (xs, ys)
        else:
            assert got is not None and type(got.slope) is float and type(got.level) is float
            assert (got.slope.hex(), got.level.hex()) == (want.slope.hex(), want.level.hex()), (xs, ys)
    assert min(ends[end] for end in ("screen", "robust", "steady", "flattening", "trend")) >= 50, ends


def test_the_median_is_statistics_median():
    """Odd and even counts, ties, none (0.0, as the plain fit's pairs gave for none). Zeros are
    positive here: a -0.0 and a 0.0 among the middle values could come out either way round (a zero
    median ends the fit all the same)."""
    rng = random.Random(4)
    assert _median(np.array([], dtype=np.float64)) == 0.0
    for _ in range(2000):
        m = rng.randint(1, 600)
        values = [rng.choice((round(rng.gauss(0, 1), 1) + 0.0, rng.gauss(0, 1))) for _ in range(m)]
        got = _median(np.array(values))
        assert type(got) is float and got.hex() == float(statistics.median(values)).hex()


def test_a_dense_start_does_not_outvote_the_sparse_probes_after_it():
    """The adaptive schedule's probes: the first three steps (a transient: the figure jumps), then one
    every 25 steps on a steady rise. Weighted by the steps each point stands for, the pairs among the
    first three count for little and the rise is a trend; unweighted, the jump breaks the halves."""
    xs = [0.0, 1.0, 2.0] + [float(s) for s in range(12, 200, 25)]
    ys = [1.0, 3.0, 3.6] + [1.5 + 0.04 * x for x in xs[3:]]
    ws = [1.0] + [b - a for a, b in zip(xs, xs[1:])]
    trend = fit_trend(xs, ys, ws)
    assert trend is not None and abs(trend.slope - 0.04) < 0.004
    assert fit_trend(xs, ys) is None


def test_the_weighted_median_is_the_median_with_equal_weights():
    from amp_tui.training.probes.headroom_trend import _median, _weighted_median
    rng = random.Random(5)
    for n in range(1, 30):
        values = np.array([rng.choice((rng.gauss(0, 1), 0.5)) for _ in range(n)])
        assert _weighted_median(values, np.ones(n)) == _median(values)
    assert _weighted_median(np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0, 10.0])) == 3.0
