"""The two run charts: loss, and the loss scale on a log2 axis; skips and interventions marked.

Plotext draws every point it is given, and a 2,000-point plot costs ~50 ms on a small CPU: the
series is first reduced to a min/max envelope with a couple of points per braille column, which
keeps spikes visible and the cost near 10 ms. The dashboard redraws the charts only with the status
bar, and beside training less often than it (`Pacing` in dashboard.py).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from textual_plotext import PlotextPlot

from amp_tui.sources.protocol import History

SKIP_COLOR = "red"
INTERVENTION_COLOR = "orange"


class RunChart(PlotextPlot):
    """A chart of one History series; subclasses say which series and how to map it."""

    DEFAULT_CSS = """
    RunChart {
        border: round $primary 50%;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        padding: 0;
        height: 1fr;
    }
    """
    TITLE = ""
    EMPTY = "waiting for the first step"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._history: History | None = None
        self._shown = 0                        # bumps with every show()
        self._drawn_for: tuple | None = None   # (shown, size) the plot was last built for
        self._title = self.TITLE

    def on_mount(self) -> None:
        super().on_mount()
        self.border_title = self.TITLE
        self.border_subtitle = "x skipped update  │ intervention"

    def show(self, history: History) -> None:
        """Take new data; the plot itself is built at render time, for the size it has then."""
        self._history = history
        self._shown += 1
        title = self.title_for(history)
        if title != self._title:
            self._title = self.border_title = title
        self.refresh()

    def render(self):
        key = (self._shown, self.size)
        if key != self._drawn_for:
            self._drawn_for = key
            self._build(self._history)
        return super().render()

    def _build(self, history: History | None) -> None:
        plt = self.plt
        plt.clear_figure()
        if history is None:
            plt.title(self.EMPTY)
            return
        raw = self.series(history)
        points = [(s, v) for s, v in zip(history.steps, raw) if v is not None and math.isfinite(v)]
        if not points:
            plt.title(self.empty_reason(history))
            return
        transform, ticks = self.axis([v for _, v in points])
        mapped = [(s, transform(v)) for s, v in points]
        columns = max(self.size.width - 8, 10)   # minus the y-axis labels
        xs, ys = envelope(mapped, buckets=columns)
        plt.plot(xs, ys, marker="braille")
        first, last = history.steps[0], history.steps[-1]
        top = max(ys)
        marks = _thin([s for s in history.skipped_steps if first <= s <= last], first, last, columns)
        if marks:
            lookup = dict(mapped)
            plt.scatter(marks, [lookup.get(_nearest(history.steps, s), top) for s in marks],
                        marker="x", color=SKIP_COLOR)
        for step in _thin([s for s in history.intervention_steps if first <= s <= last],
                          first, last, columns):
            plt.vline(step, INTERVENTION_COLOR)
        lo, hi = min(ys), max(ys)
        if hi - lo < 1e-12:
            lo, hi = lo - 1, hi + 1
        plt.ylim(lo, hi)
        # Plotext drops one of two labels that land on the same row, and which one depends on
        # set order (hash seed): never give it more ticks than there are rows to spare.
        tick_values, tick_labels = ticks(lo, hi, max(2, (self.size.height - 3) // 2))
        if tick_values:
            plt.yticks(tick_values, tick_labels)
        plt.xlim(first, max(last, first + 1))
        x_values = integer_ticks(first, max(last, first + 1))
        plt.xticks(x_values, [str(x) for x in x_values])

    # subclass hooks
    def series(self, history: History) -> Sequence[float | None]:
        raise NotImplementedError

    def axis(self, values: list[float]) -> tuple[Callable[[float], float], Callable]:
        return (lambda v: v), linear_ticks

    def title_for(self, history: History) -> str:
        return self.TITLE

    def empty_reason(self, history: History) -> str:
        return self.EMPTY


class LossChart(RunChart):
    TITLE = "loss"

    def series(self, history: History) -> Sequence[float | None]:
        return history.loss

    def axis(self, values: list[float]):
        if _wants_log(values):
            return math.log10, power_ticks(10, "1e{}")
        return (lambda v: v), linear_ticks

    def title_for(self, history: History) -> str:
        values = [v for v in history.loss if v is not None and math.isfinite(v)]
        return "loss (log10 axis)" if values and _wants_log(values) else "loss"

    def empty_reason(self, history: History) -> str:
        return "no finite loss yet" if history.steps else self.EMPTY


class ScaleChart(RunChart):
    TITLE = "loss scale (log2 axis)"

    def series(self, history: History) -> Sequence[float | None]:
        return [v if v is not None and v > 0 else None for v in history.scale]

    def axis(self, values: list[float]):
        return math.log2, power_ticks(2, "2^{}")

    def empty_reason(self, history: History) -> str:
        if history.steps:
            return "no loss scale: GradScaler runs in fp16 only"
        return self.EMPTY


# ---- helpers (pure) ---------------------------------------------------------------------------

def _wants_log(values: list[float]) -> bool:
    """A loss that falls by orders of magnitude reads best on a log axis."""
    return min(values) > 0 and max(values) / min(values) >= 100


def envelope(points: list[tuple[int, float]], buckets: int) -> tuple[list[int], list[float]]:
    """At most ~2 points per bucket (its min and max, in step order) so spikes survive."""
    if len(points) <= 2 * buckets:
        return [p[0] for p in points], [p[1] for p in points]
    first, last = points[0][0], points[-1][0]
    width = (last - first) / buckets or 1
    xs: list[int] = []
    ys: list[float] = []
    group: list[tuple[int, float]] = []
    current = 0
    for point in points + [(None, None)]:
        index = min(int((point[0] - first) / width), buckets - 1) if point[0] is not None else -1
        if group and index != current:
            low = min(group, key=lambda p: p[1])
            high = max(group, key=lambda p: p[1])
            for p in sorted({low, high}):
                xs.append(p[0])
                ys.append(p[1])
            group = []
        current = index
        if point[0] is not None:
            group.append(point)
    return xs, ys


def _thin(steps: list[int], first: int, last: int, buckets: int) -> list[int]:
    """One marker per chart column is all the eye can see."""
    width = max((last - first) / max(buckets, 1), 1)
    seen: dict[int, int] = {}
    for s in steps:
        seen.setdefault(int((s - first) / width), s)
    return list(seen.values())


def _nearest(steps: list[int], step: int) -> int:
    import bisect
    i = bisect.bisect_left(steps, step)
    if i >= len(steps):
        return steps[-1]
    return steps[i]


def integer_ticks(lo: int, hi: int, count: int = 5) -> list[int]:
    span = hi - lo
    raw = span / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    step = max(int(step), 1)
    start = math.ceil(lo / step) * step
    return list(range(int(start), int(hi) + 1, step))


def linear_ticks(lo: float, hi: float, count: int):
    return [], []   # plotext's own linear ticks are fine


def power_ticks(base: int, label: str):
    """Ticks at whole powers of `base` on an axis that already holds log_base(values)."""
    def ticks(lo: float, hi: float, count: int = 5):
        first, last = math.ceil(lo - 1e-9), math.floor(hi + 1e-9)
        if last < first:
            return [], []
        stride = max(1, math.ceil((last - first + 1) / min(count, 5)))
        values = list(range(first, last + 1, stride))
        return values, [label.format(v) for v in values]
    return ticks
