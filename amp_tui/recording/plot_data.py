"""What `amp-tui plot` draws, computed from a recording (numpy only; the drawing is in plot.py).

The steps are read through the replay's index (its arrays give the loss, the scale, the skips and
the dtype of every step without parsing a record; the per-layer figures are parsed one probed
step at a time, see amp_tui.recording.stream), and folded into at most `columns` columns, each
keeping the extreme of its steps rather than a sample of them: the highest loss, the lowest scale,
the least headroom of each layer, a skip or a non-finite loss if any step had one. So a spike or
a single skipped step stays visible at 100,000 steps, and memory stays bounded by the columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from amp_tui.core.jsonsafe import read_float
from amp_tui.core.precision import short_name
from amp_tui.core.records import InForce, next_in_force
from amp_tui.core.text import one_line
from amp_tui.recording.figures import fp32_mask, layer_figures
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.step_lines import F_LOSS_NONE, F_NONFINITE_LOSS, F_SCALE_NONE, F_SKIPPED
from amp_tui.recording.stream import step_records

COLUMNS = 1000        # columns of the heatmap at most (a figure 12 inches wide at 100 dpi)
LINE_POINTS = 2000    # points of the loss and scale lines at most
MAX_LAYERS = 32       # layers shown; a larger model shows its worst MAX_LAYERS, with a note
LABEL_CHARS = 32


@dataclass
class Series:
    """A per-step figure folded into bins of consecutive steps: the bin's first step (`x`), its
    least and greatest finite value (NaN when it has none); `end` is where the last bin ends
    (its last step + 1: step s covers [s, s + 1) on the axis, as in the heatmap)."""

    x: np.ndarray
    low: np.ndarray
    high: np.ndarray
    end: float = 0.0

    @property
    def centres(self) -> np.ndarray:
        return (self.x + np.append(self.x[1:], self.end)) / 2


@dataclass
class Marker:
    step: int
    label: str
    kind: str                       # intervention / checkpoint_restored


@dataclass
class PlotData:
    title: str
    steps: int                      # step records
    first_step: int
    last_step: int
    loss: Series
    loss_log: bool                  # every finite loss is positive: a log axis
    scale_log2: Series              # log2 of the loss scale (NaN where no scaler runs)
    skipped_x: np.ndarray           # steps (one per bin) where an update was skipped
    skipped: int                    # skipped updates recorded
    nonfinite_loss_x: np.ndarray    # steps (one per bin) whose loss was non-finite
    dtype_spans: list[tuple[int, int, str]]   # (first step, last step + 1, dtype) in force
    markers: list[Marker]
    heat: np.ndarray                # layers shown x columns: least headroom bits (NaN unmeasured, -inf non-finite)
    heat_edges: np.ndarray          # the columns' step edges (columns + 1)
    layer_names: list[str]          # the layers shown, in model order
    layers_total: int
    origins: list[tuple[int, int]] = field(default_factory=list)   # (step, row in heat) of non-finite origins
    origin_rows: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    @property
    def folded(self) -> bool:
        return len(self.layer_names) < self.layers_total


def plot_data(index: SessionIndex, *, columns: int = COLUMNS, line_points: int = LINE_POINTS,
              max_layers: int = MAX_LAYERS) -> PlotData:
    n = index.frames
    steps = _array(index.steps, np.int64) if n else np.zeros(0, dtype=np.int64)
    flags = _array(index.flags, np.uint8) if n else np.zeros(0, dtype=np.uint8)
    loss = _array(index.loss, np.float64) if n else np.zeros(0)
    scale = _array(index.scale, np.float64) if n else np.zeros(0)
    x = np.maximum.accumulate(steps) if n else steps     # a step axis that never goes back
    finite = np.isfinite(loss)
    loss_log = bool(finite.any()) and bool((loss[finite] > 0).all())
    scale = np.where((flags & F_SCALE_NONE) != 0, np.nan, scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale_log2 = np.log2(scale)
    skipped = (flags & F_SKIPPED) != 0
    bad_loss = (~finite & ((flags & F_LOSS_NONE) == 0)) | ((flags & F_NONFINITE_LOSS) != 0)
    line_bins = _bins(n, line_points)
    names = index.layer_names
    heat, edges, probed = _heatmap(index, x, names, columns)
    origins, origin_layers = _origins(index, names)
    shown = _fold(heat, max_layers, origin_layers) if len(names) > max_layers else list(range(len(names)))
    row_of = {layer: row for row, layer in enumerate(shown)}
    data = PlotData(
        title=title(index),
        steps=n, first_step=int(x[0]) if n else 0, last_step=int(x[-1]) if n else 0,
        loss=_series(x, loss, line_bins), loss_log=loss_log,
        scale_log2=_series(x, scale_log2, line_bins),
        skipped_x=_any_at(x, skipped, line_bins), skipped=int(skipped.sum()),
        nonfinite_loss_x=_any_at(x, bad_loss, line_bins),
        dtype_spans=_dtype_spans(index, x),
        markers=_markers(index),
        heat=heat[shown], heat_edges=edges,
        layer_names=[names[i] for i in shown], layers_total=len(names),
        origins=[(step, row_of[layer]) for step, layer in origins if layer in row_of],
        origin_rows={row_of[layer] for layer in origin_layers if layer in row_of},
    )
    if data.folded:
        data.notes.append(f"{len(shown)} of {len(names)} layers shown: the ones with the least headroom"
                          + (" and every non-finite origin" if origin_layers else ""))
    if n and not probed:
        data.notes.append("no per-layer figures recorded")
    skipped_text = index.skipped_summary()
    if skipped_text:
        data.notes.append(f"reading the recording: {skipped_text}")
    return data


def _array(values, dtype) -> np.ndarray:
    return np.frombuffer(values, dtype=dtype).copy()


def _bins(n: int, bins: int) -> np.ndarray:
    """The first index of each of at most `bins` bins of consecutive items."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    count = min(n, bins)
    return np.unique((np.arange(count, dtype=np.int64) * n) // count)


def _series(x: np.ndarray, values: np.ndarray, starts: np.ndarray) -> Series:
    if not len(starts):
        empty = np.zeros(0)
        return Series(empty, empty, empty)
    finite = np.where(np.isfinite(values), values, np.nan)
    with np.errstate(invalid="ignore"):
        low = np.fmin.reduceat(finite, starts)
        high = np.fmax.reduceat(finite, starts)
    return Series(x[starts].astype(np.float64), low, high, float(x[-1]) + 1.0)


def _any_at(x: np.ndarray, flag: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The first step of every bin in which `flag` holds for some step (the step itself when the
    bins are single steps)."""
    if not len(starts) or not flag.any():
        return np.zeros(0, dtype=np.int64)
    hit = np.logical_or.reduceat(flag, starts)
    if len(starts) == len(x):
        return x[hit]
    first = np.flatnonzero(flag)
    # The first flagged step of each bin that has one.
    bin_of = np.searchsorted(starts, first, side="right") - 1
    _, keep = np.unique(bin_of, return_index=True)
    return x[first[keep]]


def _heatmap(index: SessionIndex, x: np.ndarray, names: list[str], columns: int):
    """(layers x columns least headroom, column edges, probed steps)."""
    probed = np.flatnonzero(_array(index.probed, np.uint8)) if index.frames else np.zeros(0, dtype=np.int64)
    n_layers = len(names)
    if not len(probed) or not n_layers:
        return np.full((n_layers, 0), np.nan), np.zeros(1), 0
    # Columns of consecutive probed steps; a model with very many layers gets fewer columns, so
    # the map stays a few million cells.
    count = max(1, min(len(probed), columns, max(100, 8_000_000 // n_layers)))
    starts = _bins(len(probed), count)
    count = len(starts)
    column_of = np.searchsorted(starts, np.arange(len(probed)), side="right") - 1
    heat = np.full((count, n_layers), np.nan)
    j = 0
    fp32 = Fp32Layers(index, names)
    for frame, record in step_records(index, iter(probed.tolist())):
        while probed[j] != frame:    # a frame step_records left out (its line no longer parses)
            j += 1
        figures = layer_figures(record, n_layers, fp32.at(frame))
        if figures is not None:
            c = column_of[j]
            np.fmin(heat[c], figures.headroom, out=heat[c])
    first = x[probed[starts]].astype(np.float64)
    edges = np.append(first, float(x[probed[-1]]) + 1.0)
    return heat.T.copy(), edges, len(probed)


class Fp32Layers:
    """Which layers ran in fp32 at each step record, asked in file order: core/records.py's
    reducer over the events that change it, as the frames pass them (their headroom is to
    fp32's max)."""

    def __init__(self, index: SessionIndex, names: list[str]):
        self.index, self.names, self._next = index, tuple(names), 0
        self.in_force = next_in_force(InForce(), index.header)

    def at(self, frame: int) -> np.ndarray | None:
        idx, events = self.index, self.index.state_events
        while self._next < len(events) and idx.event_frames[events[self._next]] <= frame:
            self.in_force = next_in_force(self.in_force, idx.event(events[self._next]))
            self._next += 1
        return fp32_mask(self.names, self.in_force.fp32_modules)


def _fold(heat: np.ndarray, keep: int, must: set[int]) -> list[int]:
    """The `keep` layers with the least headroom over the run (non-finite first), always with the
    non-finite origins, in model order."""
    least = (np.where(np.isnan(heat), np.inf, heat).min(axis=1) if heat.shape[1]
             else np.full(heat.shape[0], np.inf))
    order = [int(i) for i in np.argsort(least, kind="stable")]
    chosen = [i for i in order if i in must][:keep]
    for i in order:
        if len(chosen) >= keep:
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen)


def _origins(index: SessionIndex, names: list[str]) -> tuple[list[tuple[int, int]], set[int]]:
    """(step, layer) of every non-finite event's origin: the module whose output first held
    inf/NaN (the checked pass's `origin`), else the first with a non-finite gradient in backward
    order, else the event's `layer`."""
    code = index.kind_code("nonfinite")
    if code is None or not names:
        return [], set()
    position = {name: i for i, name in enumerate(names)}
    out, layers, seen = [], set(), set()
    for k in range(index.event_count):
        if index.event_kinds[k] != code:
            continue
        e = index.event(k)
        name = e.get("origin") or e.get("backward_origin") or e.get("layer")
        layer = position.get(name) if isinstance(name, str) else None
        if layer is None:
            continue
        step = int(index.event_steps[k])
        layers.add(layer)
        if (step, layer) not in seen:
            seen.add((step, layer))
            out.append((step, layer))
    return out, layers


def _dtype_spans(index: SessionIndex, x: np.ndarray) -> list[tuple[int, int, str]]:
    if not index.frames:
        return []
    codes = _array(index.dtype_codes, np.uint8)
    change = np.flatnonzero(np.diff(codes)) + 1
    starts = np.concatenate(([0], change))
    ends = np.concatenate((change, [len(codes)]))
    return [(int(x[a]), int(x[b - 1]) + 1, index.dtypes[codes[a]]) for a, b in zip(starts, ends)]


def _markers(index: SessionIndex) -> list[Marker]:
    out = []
    for k in index.marker_events:
        e = index.event(k)
        kind = index.event_kind(k)
        label = marker_label(kind, e)
        if label:
            out.append(Marker(int(index.event_steps[k]), label, kind))
    return out


def marker_label(kind: str, e: dict) -> str | None:
    """What an intervention or a restore did, in the words of `--at`: `dtype=bf16`,
    `scale=4096`, `scale=half`, `save`, `pause`, `fp32=blocks.*`, `restore step 30`."""
    if kind == "checkpoint_restored":
        step = e.get("checkpoint_step")
        return f"restore step {step}" if isinstance(step, int) and not isinstance(step, bool) else "restore"
    action = e.get("action")
    if not isinstance(action, str):
        return None
    value = e.get("value")
    if action == "dtype":
        label = f"dtype={short_name(value if isinstance(value, str) else None)}"
    elif action == "scale":
        number = read_float(value)
        label = "scale=half" if value == "half" else f"scale={number:g}" if number is not None else "scale"
    elif action == "fp32":
        label = f"fp32={value}"
    else:
        label = action
    if e.get("source") in ("fallback", "autopilot"):
        label += f" ({e['source']})"
    return one_line(label, LABEL_CHARS)


def title(index: SessionIndex) -> str:
    """script · dtypes · steps · skipped · the final state."""
    header = index.header
    script = one_line(str(header.get("script") or "?"), 80)
    dtypes = []
    for name in index.dtypes if index.dtypes else [header.get("dtype")]:
        short = short_name(name if isinstance(name, str) else None)
        if short not in dtypes:
            dtypes.append(short)
    steps = index.frames
    skipped = len(index.skipped_frames)
    return (f"{script} · {' → '.join(dtypes)} · {steps:,} step{'s' if steps != 1 else ''} · "
            f"{skipped:,} skipped · {final_state(index)}")


def final_state(index: SessionIndex) -> str:
    end = index.end
    if end is None:
        return "no end record (still running, or killed)"
    status = one_line(str(end.get("status") or "ended"), 40)
    dtype = end.get("dtype")
    scale = read_float(end.get("scale"))
    parts = [short_name(dtype if isinstance(dtype, str) else None)]
    if scale is not None and math.isfinite(scale):
        parts.append(f"scale {scale:g}")
    elif "scale" in end:
        parts.append("no scaler")
    return f"{status} ({', '.join(parts)})"
