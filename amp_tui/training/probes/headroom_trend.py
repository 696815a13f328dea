"""The headroom forecast: for each layer, the trend of log2 max |act| and of log2 max |grad| over
the recent probed steps, and the steps left before it reaches the dtype's max.

A forecast that cries wolf is worse than none, so a trend has to be real before it says anything:
enough points over enough steps, a least-squares slope that is significantly above zero and fits
well (kept as running sums: O(1) a point; each point weighted by the steps it stands for, the gap
since the probe before it, so that the dense probes near an overflow don't outvote the sparse ones
that saw the trend begin; a trend backed by few points must fit better), a robust (Theil-Sen)
slope that agrees (made again every REFIT points of a series that passes the screen, carried on
between), with most pairs of points rising, a recent half that rises about as fast as the
older one (not much slower, not much faster), and a last quarter not much slower than the whole
(the S of early training flattens there first). The cheap screen runs on every series; the
robust checks only on the few that pass it. And an ETA is only said for what is within reach: bits left
at most REACH times what the trend rose over its window (the growth of the first hundred steps of
training is a real trend that mostly stops well short of the max).

Before a trend is proven, a few probes already give a rough slope (`RoughEta`): the probe
schedule spaces its next probes by it, so that the estimate sharpens as an overflow nears. It
never raises anything by itself.

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
MIN_POINTS = 8           # a trend needs at least this many points ...
MIN_SPAN = 48            # ... over at least this many steps (the first steps' transient is no trend)
MIN_T = 6.0              # the least-squares slope, in standard errors above zero (weighted: effective count)
MIN_R2 = 0.8             # the share of the series' variance the line explains ...
MIN_R2_FEW = 0.95        # ... and with fewer than MANY points behind it
MANY = 24
MIN_RISING = 0.75        # the share of pairs of points that rise (Theil-Sen's pairs)
STEADY = 0.7             # the two halves' slopes within this factor of each other (either way)
MIN_HALF = 3             # points in each half of the steps, else the halves are by count
LATEST_PAIRS = 6         # the last quarter is judged with at least this many pairs (4 points)
REACH = 2.0              # an ETA is said when the bits left are at most this many times the rise seen
REFIT = 8                # a trending series' robust fit is made again once this many points came ...
RETRY = 2                # ... one that failed it, after this many (sparse probes: each point counts)
ROUGH_R2 = 0.5           # a rough slope (the probe schedule's guess) fits at least this well ...
ROUGH_SPAN = 10          # ... over at least this many steps
FIGURES = ("act", "grad")


@dataclass(frozen=True)
class Trend:
    slope: float    # bits a step (of log2 of the figure): the recent half's, where it is the lower
    level: float    # log2 of the figure at the last point, on the robust line


@lru_cache(maxsize=WINDOW)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The pairs i < j of n points, as index arrays. Made once per n (read-only: shared by every
    fit)."""
    arrays = np.triu_indices(n, 1)
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


def fit_trend(xs: list[float], ys: list[float], ws: list[float] | None = None) -> Trend | None:
    """A rising trend of `ys` over `xs`, or None when the points show none worth saying.

    Beyond a good, significant fit, the rise must be steady, the recent half's slope about the
    older half's: a growth that flattens out (the first steps' transient, gradients that grow
    early in training and settle) or that is only taking off (early training's S-shaped rise,
    caught on its way up) is not extrapolated. A steady slope of log2 is a steady factor a step:
    attention logits that grow with training show one. `ws`: each point's weight, in the
    least-squares screen and in the robust fits (None: all alike)."""
    n = len(xs)
    if n < MIN_POINTS or xs[-1] - xs[0] < MIN_SPAN:
        return None
    if ws is None:
        mx, my = sum(xs) / n, sum(ys) / n
        sums = (n, sum((x - mx) ** 2 for x in xs), sum((x - mx) * (y - my) for x, y in zip(xs, ys)),
                sum((y - my) ** 2 for y in ys))
    else:
        sums = weighted_sums(xs, ys, ws)
    if not screen(*sums, points=n):
        return None
    # Theil-Sen: the median of the pairwise slopes (a pair with the same x has none), over all the
    # points and over each half of the steps; and the share of the pairs that rise. With `ws`,
    # each pair weighs the product of its points' weights (a weighted median): three probes of
    # the first steps, a step apart, then say as much as the steps they span, not as much as
    # three probes a hundred steps apart. The halves are spans of steps, not counts of points:
    # probes are denser at the start and near an overflow.
    x, y = np.array(xs, dtype=np.float64), np.array(ys, dtype=np.float64)
    i, j = _pairs(n)
    dx, dy = x[j] - x[i], y[j] - y[i]
    if not dx.all():   # some points share an x: drop their pairs (the span check leaves at least one)
        real = dx != 0
        i, j, dx, dy = i[real], j[real], dx[real], dy[real]
    w = None
    if ws is not None and len(set(ws)) > 1:
        weights = np.array(ws, dtype=np.float64)
        w = weights[i] * weights[j]
    middle, last_quarter = xs[0] + (xs[-1] - xs[0]) / 2, xs[0] + 3 * (xs[-1] - xs[0]) / 4
    older_pairs, recent_pairs, latest_pairs = x[j] < middle, x[i] >= middle, x[i] >= last_quarter
    if min(np.count_nonzero(x < middle), np.count_nonzero(x >= middle)) < MIN_HALF:
        # Too few points in one half of the steps (a lone probe long before the dense ones that
        # followed a warning): the halves by count instead.
        half = n // 2
        older_pairs, recent_pairs = j < half, i >= half
    if not (older_pairs.any() and recent_pairs.any()):
        return None   # a half with no pair of points: nothing to judge its steadiness by
    slopes = dy / dx

    def median(part=None) -> float:
        if w is None:
            return _median(slopes if part is None else slopes[part])
        return _weighted_median(slopes, w) if part is None else _weighted_median(slopes[part], w[part])

    robust = median()
    rising = (np.count_nonzero(slopes > 0) / len(slopes) if w is None
              else float(w[slopes > 0].sum() / w.sum()))
    if robust <= 0 or rising < MIN_RISING:
        return None
    older, recent = median(older_pairs), median(recent_pairs)
    if recent <= 0 or not STEADY * older <= recent <= older / STEADY:
        return None
    # The S of early training flattens in its last points before the halves show it: the last
    # quarter (where it has points enough to fit) rises about as fast as the whole.
    if np.count_nonzero(latest_pairs) >= LATEST_PAIRS and median(latest_pairs) < STEADY * robust:
        return None
    intercept = _median(y - robust * x)
    return Trend(min(robust, recent), intercept + robust * xs[-1])


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value where the cumulative weight of the sorted values reaches half the total (the mean
    of it and the next where it lands on half exactly: with equal weights, `_median`'s value).
    0.0 for none."""
    if not len(values):
        return 0.0
    order = np.argsort(values, kind="stable")
    ordered, cumulative = values[order], np.cumsum(weights[order])
    half = cumulative[-1] / 2
    k = int(np.searchsorted(cumulative, half))
    if cumulative[k] == half and k + 1 < len(ordered):
        return (float(ordered[k]) + float(ordered[k + 1])) / 2
    return float(ordered[k])


def screen(n: float, sxx: float, sxy: float, syy: float, *, points: int | None = None) -> bool:
    """The cheap least-squares test, from the centred sums of squares and products: a slope above
    zero, a good fit (MIN_R2; MIN_R2_FEW with fewer than MANY `points`), and significant (MIN_T
    standard errors). `n`: the points' count, or their effective count when weighted."""
    if sxx <= 0 or syy <= 0 or sxy <= 0 or n <= 2:
        return False
    slope = sxy / sxx
    ssr = max(syy - slope * sxy, 0.0)
    if 1 - ssr / syy < (MIN_R2 if (points if points is not None else n) >= MANY else MIN_R2_FEW):
        return False
    se = math.sqrt(ssr / (n - 2) / sxx)
    return not (se > 0 and slope / se < MIN_T)


def weighted_sums(xs, ys, ws) -> tuple[float, float, float, float]:
    """The effective count (Kish's: (Σw)² / Σw²) and the weighted centred sums of squares and
    products, scaled to that count, for `screen`."""
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    n = sw * sw / sum(w * w for w in ws)
    k = n / sw
    return (n, k * sum(w * (x - mx) ** 2 for w, x in zip(ws, xs)),
            k * sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)),
            k * sum(w * (y - my) ** 2 for w, y in zip(ws, ys)))


class _Series:
    """One figure of one layer: its recent points, each weighted by the steps since the point
    before it, with running weighted sums for the least-squares screen (O(1) a point instead of
    the whole window), and the last robust fit, made again once REFIT points have come (its O(n²)
    pairs are the costly part; a real trend moves slowly)."""

    def __init__(self) -> None:
        self.points: deque[tuple[int, float, float]] = deque(maxlen=WINDOW)   # step, y, weight
        self.origin = 0            # steps are counted from here in the sums (kept small)
        self.sums = [0.0] * 7      # w, wx, wy, wxx, wxy, wyy, ww
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
        weight = float(step - self.points[-1][0]) if self.points else 1.0
        self.points.append((step, y, weight))
        self._count(step, y, weight, 1.0)
        self.since_fit += 1

    def _count(self, step: int, y: float, w: float, sign: float) -> None:
        x = float(step - self.origin)
        for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y, w * y * y, w * w)):
            self.sums[i] += sign * v

    def centred(self) -> tuple[float, float, float, float]:
        """The effective count and the weighted centred sums, scaled to it (`screen`'s)."""
        sw, swx, swy, swxx, swxy, swyy, sww = self.sums
        if sw <= 0 or sww <= 0:
            return 0.0, 0.0, 0.0, 0.0
        n = sw * sw / sww
        k = n / sw
        return n, k * (swxx - swx * swx / sw), k * (swxy - swx * swy / sw), k * (swyy - swy * swy / sw)

    def screened(self) -> bool:
        n = len(self.points)
        if n < MIN_POINTS or self.points[-1][0] - self.points[0][0] < MIN_SPAN:
            return False
        return screen(*self.centred(), points=n)

    def rough_slope(self) -> float | None:
        """The weighted least-squares slope of a few points, before any trend is proven (the probe
        schedule's guess of how soon to look again): None below three points, over fewer than
        ROUGH_SPAN steps (the first steps' transient), or a loose fit."""
        if len(self.points) < 3 or self.points[-1][0] - self.points[0][0] < ROUGH_SPAN:
            return None
        _, sxx, sxy, syy = self.centred()
        if sxx <= 0 or syy <= 0 or sxy <= 0 or sxy * sxy / (sxx * syy) < ROUGH_R2:
            return None
        return sxy / sxx

    def current(self) -> Trend | None:
        """The trend as of the last point: the robust fit when due, else the last one carried on."""
        step = self.points[-1][0]
        if self.fitted_at is None or self.since_fit >= (REFIT if self.trend is not None else RETRY):
            self.trend = fit_trend([float(s) for s, _, _ in self.points], [y for _, y, _ in self.points],
                                   [w for _, _, w in self.points])
            self.fitted_at, self.since_fit = step, 0
        if self.trend is None:
            return None
        return Trend(self.trend.slope, self.trend.level + self.trend.slope * (step - self.fitted_at))


@dataclass(frozen=True)
class LayerEta:
    """A layer's forecast: its `figure` reaches the dtype's max in about `steps` steps. `index`:
    the layer's, or an op's key inside a module (op_probe.py's "aten.mul in blocks.1")."""

    index: int | str
    figure: str         # "act" or "grad" (times the scale)
    steps: int
    headroom: float     # bits left now
    slope: float        # bits lost a step
    rise: float = 0.0   # bits the trend rose over the points behind it


@dataclass(frozen=True)
class RoughEta:
    """The soonest overflow a few probes suggest, before any trend is proven: what the probe
    schedule spaces its next probes by (never an alert)."""

    index: int | str
    figure: str
    steps: int


class HeadroomForecast:
    """Each layer's series of probed figures (and of the ops inside modules), and their ETAs. A
    dtype change starts them over (another dtype's range; its figures too)."""

    def __init__(self):
        self._series: dict[tuple[int | str, str], _Series] = {}
        self._dtype: str | None = None
        self.rough: RoughEta | None = None   # as of the last observe

    def observe(self, step: int, dtype: str, scale: float | None, act: list, grad: list,
                ops: dict[str, float] | None = None, floor: float = 1.0) -> list[LayerEta]:
        """A probed step's figures (None: not measured), and the maxima of the ops inside modules
        (`ops`); each figure with a trend, by layer, then the ops'. `floor`: the lowest scale the
        run lets the scaler reach; a gradient's rough ETA counts to fp16's max at it (an overflow at
        every scale), where its ETA counts to the scale in force (one skip, and the scaler backs off)."""
        if dtype != self._dtype:
            self._dtype = dtype
            self._series.clear()
        top = math.log2(MAX_FINITE.get(dtype, MAX_FINITE["float32"]))
        limits = {"act": top, "grad": top - math.log2(scale or 1.0)}
        rough_limits = {"act": top, "grad": top - math.log2(max(floor, 1e-30)) if scale else top}
        self.rough = None
        out: list[LayerEta] = []
        figures = [(figure, enumerate(values or ())) for figure, values in zip(FIGURES, (act, grad))]
        figures.append(("act", iter((ops or {}).items())))
        for figure, values in figures:
            for i, v in values:
                if v is None or v == 0 or not math.isfinite(v):
                    continue   # not measured, or already overflowed: nothing left to forecast
                series = self._series.get((i, figure))
                if series is None:
                    series = self._series[(i, figure)] = _Series()
                series.add(step, math.log2(abs(v)))
                self._rough(series, i, figure, rough_limits[figure])
                eta = self._eta(series, i, figure, limits[figure])
                if eta is not None:
                    out.append(eta)
        return sorted(out, key=lambda eta: (isinstance(eta.index, str), str(eta.index).zfill(9), eta.steps))

    def _rough(self, series: _Series, index: int | str, figure: str, limit: float) -> None:
        slope = series.rough_slope()
        if slope is None:
            return
        steps = max(0, math.ceil((limit - series.points[-1][1]) / slope))
        if self.rough is None or steps < self.rough.steps:
            self.rough = RoughEta(index, figure, steps)

    @staticmethod
    def _eta(series: _Series, index: int | str, figure: str, limit: float) -> LayerEta | None:
        if not series.screened():
            series.fitted_at = None   # no trend now: the next one is fitted at once
            return None
        trend = series.current()
        if trend is None:
            return None
        points = series.points
        level = max(trend.level, points[-1][1])
        left = limit - level
        rise = trend.slope * (points[-1][0] - points[0][0])
        if left > REACH * rise:
            return None   # farther than the trend has gone: early training's growth often stops
        return LayerEta(index, figure, max(0, math.ceil(left / trend.slope)), left, trend.slope, rise)
