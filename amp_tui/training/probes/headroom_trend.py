"""The headroom forecast: for each layer, the trend of log2 max |act| and of log2 max |grad| over
the recent probed steps, and the steps left before it reaches the dtype's max.

A forecast that cries wolf is worse than none, so a trend has to be real before it says anything:
enough points over enough steps, a least-squares slope that is significantly above zero and fits
well (kept as running sums: O(1) a point), a robust (Theil-Sen) slope that agrees (made again
every REFIT points of a series that passes the screen, carried on between), with most pairs of
points rising, and a recent half that rises about as fast as the older one (not much slower, not
much faster). The cheap screen runs on every series; the robust checks only on the few that pass
it. And an
ETA is only said for what is within reach: bits left at most REACH times what the trend rose over
its window (the growth of the first hundred steps of training is a real trend that mostly stops
well short of the max).

Gradients are fitted unscaled (the true gradient): the loss scale multiplies them by a power of
two that jumps at each growth or backoff, and fitted scaled, every growth would fake a trend.
Their limit is the dtype's max divided by the scale in force now.

Arithmetic on host floats, on the CPU: both drivers' runs (job/records/forecasts.py) use it, and no tensor
is read. The robust fits' pairs are numpy float64 arrays made from those floats (the same IEEE
subtractions and divisions as Python's, so the same slopes and medians, about ten times faster
at 64 points): they run on the training thread at each probed step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from amp_tui.core.precision import MAX_FINITE

WINDOW = 64              # recent probed points per series
MIN_POINTS = 24          # a trend needs at least this many points ...
MIN_SPAN = 48            # ... over at least this many steps (the first steps' transient is no trend)
MIN_T = 6.0              # the least-squares slope, in standard errors above zero
MIN_R2 = 0.8             # the share of the series' variance the line explains
MIN_RISING = 0.75        # the share of pairs of points that rise (Theil-Sen's pairs)
STEADY = 0.7             # the two halves' slopes within this factor of each other (either way)
REACH = 2.0              # an ETA is said when the bits left are at most this many times the rise seen
REFIT = 8                # a trending series' robust fit is made again once this many points came
FIGURES = ("act", "grad")


@dataclass(frozen=True)
class Trend:
    slope: float    # bits a step (of log2 of the figure): the recent half's, where it is the lower
    level: float    # log2 of the figure at the last point, on the robust line


@lru_cache(maxsize=WINDOW)
def _pairs(n: int) -> tuple[np.ndarray, ...]:
    """The pairs i < j of n points, as index arrays, and which of them lie in the older half (both
    below n // 2) and in the recent half (both from it): the halves' fits are subsets of the whole's
    pairs, so their slopes are computed once. Made once per n (read-only: shared by every fit)."""
    i, j = np.triu_indices(n, 1)
    half = n // 2
    arrays = (i, j, j < half, i >= half)
    for a in arrays:
        a.setflags(write=False)
    return arrays


def _median(values: np.ndarray) -> float:
    """statistics.median's value, exactly: the middle one, or the mean of the two middle ones taken
    as Python floats. 0.0 for none. (A full np.sort: at these sizes, no slower than np.partition
    of the two middle ones.) Only the sign of a zero median may differ, with -0.0 and 0.0 among the
    middle values: a zero ends the fit either way."""
    m = len(values)
    if not m:
        return 0.0
    ordered = np.sort(values)
    k = m // 2
    if m % 2:
        return float(ordered[k])
    return (float(ordered[k - 1]) + float(ordered[k])) / 2


def fit_trend(xs: list[float], ys: list[float]) -> Trend | None:
    """A rising trend of `ys` over `xs`, or None when the points show none worth saying.

    Beyond a good, significant fit, the rise must be steady, the recent half's slope about the
    older half's: a growth that flattens out (the first steps' transient, gradients that grow
    early in training and settle) or that is only taking off (early training's S-shaped rise,
    caught on its way up) is not extrapolated. A steady slope of log2 is a steady factor a step:
    attention logits that grow with training show one."""
    n = len(xs)
    if n < MIN_POINTS or xs[-1] - xs[0] < MIN_SPAN:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    if not screen(n, sum((x - mx) ** 2 for x in xs), sum((x - mx) * (y - my) for x, y in zip(xs, ys)),
                  sum((y - my) ** 2 for y in ys)):
        return None
    # Theil-Sen: the median of the pairwise slopes (a pair with the same x has none), over all the
    # points and over each half; and the share of the pairs that rise.
    x, y = np.array(xs, dtype=np.float64), np.array(ys, dtype=np.float64)
    i, j, older_pairs, recent_pairs = _pairs(n)
    dx, dy = x[j] - x[i], y[j] - y[i]
    if not dx.all():   # some points share an x: drop their pairs (the span check leaves at least one)
        real = dx != 0
        dx, dy, older_pairs, recent_pairs = dx[real], dy[real], older_pairs[real], recent_pairs[real]
    slopes = dy / dx
    robust = _median(slopes)
    if robust <= 0 or np.count_nonzero(slopes > 0) / len(slopes) < MIN_RISING:
        return None
    older, recent = _median(slopes[older_pairs]), _median(slopes[recent_pairs])
    if recent <= 0 or not STEADY * older <= recent <= older / STEADY:
        return None
    intercept = _median(y - robust * x)
    return Trend(min(robust, recent), intercept + robust * xs[-1])


def screen(n: int, sxx: float, sxy: float, syy: float) -> bool:
    """The cheap least-squares test, from the centred sums of squares and products: a slope above
    zero, a good fit (MIN_R2), and significant (MIN_T standard errors)."""
    if sxx <= 0 or syy <= 0 or sxy <= 0:
        return False
    slope = sxy / sxx
    ssr = max(syy - slope * sxy, 0.0)
    if 1 - ssr / syy < MIN_R2:
        return False
    se = math.sqrt(ssr / (n - 2) / sxx)
    return not (se > 0 and slope / se < MIN_T)


class _Series:
    """One figure of one layer: its recent points, with running sums for the least-squares screen
    (O(1) a point instead of the whole window), and the last robust fit, made again once REFIT
    points have come (its O(n²) pairs are the costly part; a real trend moves slowly)."""

    def __init__(self) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self.origin = 0            # steps are counted from here in the sums (kept small)
        self.sums = [0.0] * 5      # x, y, xx, xy, yy
        self.fitted_at: int | None = None   # the step of the last robust fit
        self.since_fit = 0
        self.trend: Trend | None = None

    def add(self, step: int, y: float) -> None:
        if self.points and self.points[-1][0] >= step:
            self.__init__()   # the run went back (a restore): the old points are another past
        if not self.points:
            self.origin = step
        if len(self.points) == WINDOW:
            self._count(*self.points[0], -1.0)
        self.points.append((step, y))
        self._count(step, y, 1.0)
        self.since_fit += 1

    def _count(self, step: int, y: float, sign: float) -> None:
        x = float(step - self.origin)
        for i, v in enumerate((x, y, x * x, x * y, y * y)):
            self.sums[i] += sign * v

    def screened(self) -> bool:
        n = len(self.points)
        if n < MIN_POINTS or self.points[-1][0] - self.points[0][0] < MIN_SPAN:
            return False
        sx, sy, sxx, sxy, syy = self.sums
        return screen(n, sxx - sx * sx / n, sxy - sx * sy / n, syy - sy * sy / n)

    def current(self) -> Trend | None:
        """The trend as of the last point: the robust fit when due, else the last one carried on."""
        step = self.points[-1][0]
        if self.fitted_at is None or self.since_fit >= REFIT:
            self.trend = fit_trend([float(s) for s, _ in self.points], [y for _, y in self.points])
            self.fitted_at, self.since_fit = step, 0
        if self.trend is None:
            return None
        return Trend(self.trend.slope, self.trend.level + self.trend.slope * (step - self.fitted_at))


@dataclass(frozen=True)
class LayerEta:
    """A layer's forecast: its `figure` reaches the dtype's max in about `steps` steps."""

    index: int
    figure: str         # "act" or "grad" (times the scale)
    steps: int
    headroom: float     # bits left now
    slope: float        # bits lost a step


class HeadroomForecast:
    """Each layer's series of probed figures, and their ETAs. A dtype change starts them over
    (another dtype's range; its figures too)."""

    def __init__(self):
        self._series: dict[tuple[int, str], _Series] = {}
        self._dtype: str | None = None

    def observe(self, step: int, dtype: str, scale: float | None, act: list, grad: list) -> list[LayerEta]:
        """A probed step's figures (None: not measured); each figure with a trend, by layer."""
        if dtype != self._dtype:
            self._dtype = dtype
            self._series.clear()
        top = math.log2(MAX_FINITE.get(dtype, MAX_FINITE["float32"]))
        limits = {"act": top, "grad": top - math.log2(scale or 1.0)}
        out: list[LayerEta] = []
        for figure, values in zip(FIGURES, (act, grad)):
            for i, v in enumerate(values or ()):
                if v is None or v == 0 or not math.isfinite(v):
                    continue   # not measured, or already overflowed: nothing left to forecast
                series = self._series.get((i, figure))
                if series is None:
                    series = self._series[(i, figure)] = _Series()
                series.add(step, math.log2(abs(v)))
                if not series.screened():
                    series.fitted_at = None   # no trend now: the next one is fitted at once
                    continue
                trend = series.current()
                if trend is None:
                    continue
                points = series.points
                level = max(trend.level, points[-1][1])
                left = limits[figure] - level
                if left > REACH * trend.slope * (points[-1][0] - points[0][0]):
                    continue   # farther than the trend has gone: early training's growth often stops
                out.append(LayerEta(i, figure, max(0, math.ceil(left / trend.slope)), left, trend.slope))
        return sorted(out, key=lambda eta: (eta.index, eta.steps))
