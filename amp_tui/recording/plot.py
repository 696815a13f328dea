"""`amp-tui plot`: one figure that explains a run, drawn with matplotlib (the `[plot]` extra).

Three panels on one step axis: the loss (log y) with the skipped updates marked; the loss scale
(log2) with the interventions as labelled vertical lines and the dtype in force shaded; a layer x
step map of headroom bits against the dtype in force, non-finite cells in their own colour and
the module each non-finite step started in marked. What is drawn is computed in plot_data.py.
The figure is drawn on matplotlib's Agg canvas (no display, no pyplot state) and written as PNG
or SVG.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from amp_tui.core.precision import short_name
from amp_tui.recording.extras import require
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.plot_data import COLUMNS, MAX_LAYERS, PlotData, plot_data

FORMATS = {".png": "png", ".svg": "svg"}
SIZE_IN = (12.0, 11.0)
DPI = 100
HEADROOM_MAX_BITS = 16.0        # the colour scale's top: more headroom than this is all "plenty"
NONFINITE = "#7b1fa2"           # non-finite cells, origins' labels, non-finite loss marks
UNMEASURED = "#d9d9d9"
SKIPPED = "#d62728"
NONFINITE_MIN_PX = 2.5         # the narrowest a run of non-finite cells is drawn, in pixels
MARKER_LABELS = 30              # interventions labelled at most (the others still get their line)
DTYPE_SHADES = {"float16": "#1f77b4", "bfloat16": "#2ca02c", "float32": "#7f7f7f"}


class PlotError(Exception):
    """The output can't be written as asked (an unknown format)."""


def plot_format(path: str | Path) -> str:
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        suffix = Path(path).suffix or "a name without a suffix"
        raise PlotError(f"{path}: plot writes a .png or an .svg file, not {suffix}")
    return fmt


@dataclass
class PlotResult:
    data: PlotData                 # what was drawn
    size: tuple[int, int]          # the image's width and height in pixels
    # Where each panel ("loss", "scale", "heatmap") lies in the image: (left, top, right, bottom)
    # pixels from its top left corner.
    panels: dict[str, tuple[int, int, int, int]]


def plot(target, out: str | Path, *, columns: int = COLUMNS, max_layers: int = MAX_LAYERS) -> PlotResult:
    """Draw the recording at `target` (a run directory, a session file or a SessionIndex) into
    `out` (.png or .svg). The file appears whole or not at all."""
    fmt = plot_format(out)
    require("matplotlib", "plot", "amp-tui plot")
    index = target if isinstance(target, SessionIndex) else SessionIndex(target)
    try:
        data = plot_data(index, columns=columns, max_layers=max_layers)
    finally:
        if index is not target:
            index.close()
    figure = draw(data)
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    try:
        figure.savefig(partial, format=fmt, dpi=DPI)
        os.replace(partial, out)
    finally:
        if partial.exists():
            partial.unlink()
    width, height = (round(v) for v in figure.get_size_inches() * DPI)
    panels = {}
    for name, ax in zip(("loss", "scale", "heatmap"), figure.axes):
        box = ax.get_window_extent()
        panels[name] = (round(box.x0), round(height - box.y1), round(box.x1), round(height - box.y0))
    return PlotResult(data, (width, height), panels)


def draw(data: PlotData):
    """The figure (a matplotlib Figure on an Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE_IN, dpi=DPI)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3, 2, height_ratios=(2.0, 2.0, 5.4), width_ratios=(60, 1), hspace=0.3,
                            wspace=0.02, left=0.15, right=0.94, top=0.93, bottom=0.09)
    ax_loss = fig.add_subplot(grid[0, 0])
    ax_scale = fig.add_subplot(grid[1, 0], sharex=ax_loss)
    ax_heat = fig.add_subplot(grid[2, 0], sharex=ax_loss)
    cax = fig.add_subplot(grid[2, 1])
    fig.suptitle(data.title, fontsize=11)
    _loss_panel(ax_loss, data)
    _scale_panel(ax_scale, data)
    _heat_panel(ax_heat, cax, data)
    ax_loss.set_xlim(data.first_step, max(data.last_step + 1, data.first_step + 1))
    ax_heat.set_xlabel("step")
    for ax in (ax_loss, ax_scale):
        ax.tick_params(labelbottom=False)
    notes = list(data.notes)
    if data.steps > len(data.loss.x):
        notes.insert(0, f"{data.steps:,} steps: each point and column keeps the extreme of its steps "
                        "(highest loss, lowest scale, least headroom)")
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=8, color="#444444", va="bottom")
    return fig


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=8, framealpha=0.85)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="#666666")


def _line(ax, series, color: str, label: str, steps: bool) -> None:
    """A figure over the steps: a step line (each bin's value held over its steps) or a line
    through the bins' centres; the band between its low and high where bins hold many steps."""
    if steps:
        x = np.append(series.x, series.end)
        low, high = (np.append(v, v[-1:]) for v in (series.low, series.high))
    else:
        x, low, high = series.centres, series.low, series.high
    if len(x) and not np.allclose(low, high, equal_nan=True):
        ax.fill_between(x, low, high, step="post" if steps else None, color=color, alpha=0.25, linewidth=0)
    ax.plot(x, high, color=color, linewidth=1.0, drawstyle="steps-post" if steps else "default", label=label)


def _loss_panel(ax, data: PlotData) -> None:
    from matplotlib.transforms import blended_transform_factory

    finite_loss = np.isfinite(data.loss.high).any()
    ax.set_ylabel("loss" + ("" if data.loss_log or not finite_loss else "\n(linear: a loss ≤ 0)"))
    ax.grid(True, alpha=0.3)
    if not data.steps:
        _empty(ax, "no steps recorded yet")
        return
    if finite_loss:
        if data.loss_log:
            from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
            ax.set_yscale("log")
            finite = data.loss.high[np.isfinite(data.loss.high)]
            if np.log10(finite.max() / finite.min()) < 3:    # few decades: ticks at 1, 2, 5 of each
                ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        _line(ax, data.loss, "#1f77b4", "loss (highest of each point's steps)"
              if data.steps > len(data.loss.x) else "loss", steps=False)
    else:
        _empty(ax, "no finite loss recorded")
    edge = blended_transform_factory(ax.transData, ax.transAxes)
    if len(data.skipped_x):
        ax.vlines(data.skipped_x + 0.5, 0.0, 0.1, transform=edge, color=SKIPPED, linewidth=1.0,
                  label=f"skipped update ({data.skipped:,})")
    if len(data.nonfinite_loss_x):
        ax.plot(data.nonfinite_loss_x + 0.5, np.full(len(data.nonfinite_loss_x), 0.95), "v", transform=edge,
                color=NONFINITE, markersize=4, linestyle="none", label="non-finite loss")
    _legend(ax)


def _scale_panel(ax, data: PlotData) -> None:
    from matplotlib.transforms import blended_transform_factory

    ax.set_ylabel("log2(loss scale)")
    ax.grid(True, alpha=0.3)
    if not data.steps:
        _empty(ax, "no steps recorded yet")
        return
    span = max(data.last_step + 1 - data.first_step, 1)
    edge = blended_transform_factory(ax.transData, ax.transAxes)
    for first, end, dtype in data.dtype_spans:
        ax.axvspan(first, end, color=DTYPE_SHADES.get(dtype, "#bcbd22"), alpha=0.08, linewidth=0)
        if (end - first) / span > 0.06:
            ax.text(first + 0.01 * span, 0.04, short_name(dtype), transform=edge, fontsize=8, color="#555555")
    if np.isfinite(data.scale_log2.high).any():
        _line(ax, data.scale_log2, "#ff7f0e", "loss scale", steps=True)
    else:
        _empty(ax, "no loss scale: no GradScaler ran (bf16 or fp32)")
    lines = _marker_lines(data)
    labelled = _labelled(lines)
    for i, (step, label) in enumerate(lines):
        ax.axvline(step, color="#333333", linewidth=0.8, linestyle="--", alpha=0.7)
        if i in labelled:
            ax.text(step, 0.97, label + " ", transform=edge, rotation=90, ha="right", va="top",
                    fontsize=7, color="#222222", clip_on=True)
    if len(labelled) < len(lines):
        ax.text(1.0, 1.02, f"{len(lines) - len(labelled)} more intervention lines not labelled",
                transform=ax.transAxes, ha="right", fontsize=7, color="#555555")
    _legend(ax)


def _marker_lines(data: PlotData) -> list[tuple[int, str]]:
    """One line per step with interventions, labelled with all of them (`pause, resume`)."""
    lines: dict[int, list[str]] = {}
    for marker in data.markers:
        labels = lines.setdefault(marker.step, [])
        if marker.label not in labels:
            labels.append(marker.label)
    return [(step, ", ".join(labels)) for step, labels in sorted(lines.items())]


def _labelled(lines: list[tuple[int, str]]) -> set[int]:
    """The lines labelled: those with a precision change first (dtype, scale, restore, fp32),
    then the others, in step order, MARKER_LABELS at most."""
    first = ("dtype", "scale", "restore", "fp32")
    ranked = sorted(range(len(lines)), key=lambda i: (not any(part.startswith(first)
                                                              for part in lines[i][1].split(", ")), lines[i][0]))
    return set(ranked[:MARKER_LABELS])


def _nonfinite_cells(ax, data: PlotData) -> None:
    """The non-finite cells, in their colour, each run of them at least NONFINITE_MIN_PX wide: a
    single non-finite step among 100,000 stays visible."""
    bad = np.isneginf(data.heat)
    if not bad.any():
        return
    edges = data.heat_edges
    width_px = ax.get_position().width * ax.figure.get_figwidth() * DPI
    least = NONFINITE_MIN_PX * (edges[-1] - edges[0]) / max(width_px, 1.0)
    for row in range(bad.shape[0]):
        cols = np.flatnonzero(bad[row])
        if not len(cols):
            continue
        breaks = np.flatnonzero(np.diff(cols) > 1)
        firsts = np.concatenate(([cols[0]], cols[breaks + 1]))
        lasts = np.concatenate((cols[breaks], [cols[-1]]))
        spans = [(edges[a], max(edges[b + 1] - edges[a], least)) for a, b in zip(firsts, lasts)]
        ax.broken_barh(spans, (row, 1), facecolors=NONFINITE, linewidth=0, rasterized=True, zorder=2)


def _heat_panel(ax, cax, data: PlotData) -> None:
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = len(data.layer_names)
    heat = data.heat
    cmap = colormaps["RdYlGn"].with_extremes(bad=UNMEASURED)
    norm = Normalize(vmin=0.0, vmax=HEADROOM_MAX_BITS)
    note = f" (the {rows} worst of {data.layers_total})" if data.folded else ""
    ax.set_ylabel("layer" + note)
    if not rows or not heat.shape[1]:
        _empty(ax, "no per-layer figures recorded" if data.steps else "no steps recorded yet")
        ax.set_yticks([])
        cax.set_axis_off()
        return
    y = np.arange(rows + 1)
    finite = np.ma.masked_invalid(np.clip(heat, 0.0, None))       # -inf and NaN left to the layers below
    ax.pcolormesh(data.heat_edges, y, finite, cmap=cmap, norm=norm, shading="flat", rasterized=True)
    _nonfinite_cells(ax, data)
    ax.set_ylim(rows, 0)
    # Labels as tall as a row allows (a point is DPI/72 pixels), 8 points at most.
    row_px = ax.get_position().height * ax.figure.get_figheight() * DPI / rows
    size = max(3.0, min(8.0, 0.85 * row_px * 72 / DPI))
    ax.set_yticks(np.arange(rows) + 0.5, labels=data.layer_names, fontsize=size)
    for row, label in enumerate(ax.get_yticklabels()):
        if row in data.origin_rows:
            label.set_color(NONFINITE)
            label.set_fontweight("bold")
    handles = [Patch(color=NONFINITE, label="non-finite"), Patch(color=UNMEASURED, label="not measured")]
    if data.origins:
        edges = data.heat_edges
        cols = np.clip(np.searchsorted(edges, [s for s, _ in data.origins], side="right") - 1, 0,
                       len(edges) - 2)
        cells = sorted({(int(c), r) for c, (_, r) in zip(cols, data.origins)})
        xs = [(edges[c] + edges[c + 1]) / 2 for c, _ in cells]
        ys = [r + 0.18 for _, r in cells]     # in the top of the row: the cell's colour shows below
        ax.scatter(xs, ys, marker="v", s=14, color="black", linewidth=0, zorder=3)
        handles.append(Line2D([], [], marker="v", linestyle="none", color="black", markersize=5,
                              label="origin of a non-finite step"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles), fontsize=8,
              frameon=False, borderaxespad=0.2)
    bar = ax.figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=cax, extend="max")
    bar.set_label("headroom bits (dtype in force)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
