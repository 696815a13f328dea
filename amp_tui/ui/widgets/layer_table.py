"""Per-layer magnitudes and their headroom to the active dtype's largest finite value.

Sorted by least headroom by default (non-finite rows on top), so the layer about to overflow is
the first row even in a model with hundreds of layers. Click a column header to sort by it
(again to reverse), or use the command palette ("Sort layers: …").

A Line API widget rather than a DataTable: it is redrawn every few seconds while training runs on
another thread of the same process, and only the visible rows are ever formatted, so a model with
500 layers costs the same as one with 20 (a DataTable updating 2,000 cells took ~0.2 s a time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from amp_tui.core.text import visible
from amp_tui.ui.text import bits_text, magnitude, middle_ellipsis, same_text
from amp_tui.ui.view import DANGER_BITS, SORTS, WARN_BITS, LayerRow, sort_rows, summarize_layers

# Long names are cut in the middle: the tail (".q_proj", ".fc2") is what tells layers apart.
NAME_WIDTH = 40
# After the name of a module that runs in fp32 (an fp32 module, or inside one), or in fp8.
FP32_MARK = " fp32"
FP8_MARK = " fp8"
GAP = 2


@dataclass(frozen=True)
class Column:
    key: str            # also the sort key (view.SORTS)
    label: str
    width: int          # 0: sized to the content
    help: str           # what it shows, for the help screen (`?`)
    right: bool = True


# Headroom comes right after the name: on a narrow terminal it is the column that must show. The
# ETA next to it: the steps the headroom forecast gives it (blank while its figures show no trend).
COLUMNS = (
    Column("index", "#", 0, "the layer's place in the model (the order its modules were registered)"),
    Column("name", "layer", 0, "the module's name, cut in the middle when long; reverse red: the module "
           "the newest non-finite step names as the origin; fp32 after it: the module runs in fp32 "
           "(--fp32-modules, fp32=, f, the autopilot), and its headroom is to fp32's max", right=False),
    Column("headroom", "headroom", 12, "bits left before the dtype's max (see headroom bits), then the "
           "figure that sets them: act, grad or weight; a non-finite figure shows as inf act, NaN grad",
           right=False),
    Column("eta", "ETA", 6, "the forecast: steps left, at the layer's recent trend, before its activation "
           "(or its gradient times the scale) reaches the dtype's max (340, 12k); blank while its figures "
           "show no real trend"),
    Column("act", "max|act|", 8, "the largest |output| of the module at the last probed step"),
    Column("grad", "max|grad|", 9, "the largest |gradient| of its parameters, unscaled (the headroom counts "
           "it times the loss scale)"),
    Column("weight", "max|weight|", 11, "the largest |weight| of its parameters (the title says when they "
           "were read at an earlier step)"),
)
# In fp8 (shown while a row has them): what each fp8 layer's casts took at the last probed step.
FP8_COLUMNS = (
    Column("fp8", "fp8 amax in/w/go · log2 scale", 0, "an fp8 layer's amax of its input, weight and output "
           "gradient, then log2 of each cast's scale (e4m3's 448, e5m2's 57344 for the gradient, over the "
           "amax): a scale that climbs means the tensor shrinks towards fp8's underflow", right=False),
)


class LayerTable(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    LayerTable {
        height: 1fr;
        border: round $primary 50%;
        border-title-color: $text;
        border-subtitle-color: $text-muted;
        background: $surface;
        scrollbar-size-vertical: 1;
        padding: 0 0 0 1;
    }
    LayerTable:focus {
        border: round $primary;
    }
    LayerTable > .layer-table--header {
        text-style: bold;
        background: $panel;
    }
    LayerTable > .layer-table--cursor {
        background: $primary 25%;
    }
    LayerTable:focus > .layer-table--cursor {
        background: $primary 50%;
    }
    """
    COMPONENT_CLASSES = {"layer-table--header", "layer-table--cursor"}
    BINDINGS = [
        Binding("up", "cursor(-1)", "up", show=False, id="layers.up"),
        Binding("down", "cursor(1)", "down", show=False, id="layers.down"),
        Binding("pageup", "page(-1)", "page up", show=False, id="layers.page_up"),
        Binding("pagedown", "page(1)", "page down", show=False, id="layers.page_down"),
        Binding("home", "cursor(-1_000_000)", "first", show=False, id="layers.first"),
        Binding("end", "cursor(1_000_000)", "last", show=False, id="layers.last"),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sort_column = "headroom"
        self.sort_reverse = SORTS["headroom"][1]
        self._rows: list[LayerRow] = []
        self._ordered: list[LayerRow] = []
        self._names: list[str] = []          # display names (escaped, shortened), by layer index
        self._columns = COLUMNS                # and FP8_COLUMNS while a row is in fp8
        self._widths: list[int] = [c.width for c in COLUMNS]
        # The layer under the cursor once the user picked one; until then the cursor stays on the
        # top row, which is the worst layer.
        self._picked: int | None = None
        self._origin: str | None = None      # the module a non-finite event named: highlighted
        self._title: Text | None = None
        # Rendered rows by position, valid until the data, order, cursor or styles change.
        self._strips: dict[int, Strip] = {}
        self._styles: dict[str | None, Style] = {}

    def on_mount(self) -> None:
        self.border_title = "layers"
        self._update_subtitle()

    # ---- data ---------------------------------------------------------------------------------
    def show(self, rows: list[LayerRow], step: int | None, dtype_label: str,
             origin: str | None = None, note: str | None = None) -> None:
        self._origin = origin
        columns = COLUMNS + FP8_COLUMNS if any(r.fp8 is not None for r in rows) else COLUMNS
        if [(r.name, r.fp32) for r in rows] != [(r.name, r.fp32) for r in self._rows] or columns != self._columns:
            self._columns = columns
            self._names = [middle_ellipsis(visible(r.name), NAME_WIDTH) for r in rows]
            self._widths = [max(len(str(max(len(rows) - 1, 0))), 1),
                            max([len(n) + len(_mark(r)) for n, r in zip(self._names, rows)] + [len("layer")]),
                            *[c.width for c in COLUMNS[2:]],
                            *[max(len(c.label), FP8_WIDTH) for c in columns[len(COLUMNS):]]]
            if self._picked is not None and self._picked >= len(rows):
                self._picked = None
        self._rows = rows
        summary = summarize_layers(rows)
        title = Text(f"layers ({summary.total})", style="bold")
        if step is not None:
            title.append(f" step {step} · bits to {dtype_label} max", style="")
            if any(r.fp32 for r in rows) and dtype_label != "fp32":
                title.append(f" ({FP32_MARK.strip()} rows: to fp32's)", style="")
            if any(r.fp8 is not None for r in rows):
                # Their GEMMs' inputs are scaled into fp8 per tensor: the risk is underflow, not the max.
                title.append(f" ({FP8_MARK.strip()} rows: outputs in {dtype_label}, inputs scaled to fit)", style="")
        if summary.nonfinite:
            title.append(f" · {summary.nonfinite} non-finite", style="bold red")
        if summary.near:
            title.append(f" · {summary.near} under {WARN_BITS:g} bits", style="yellow")
        if note:
            title.append(f" · {note}", style="yellow")
        if not same_text(title, self._title):
            self._title = self.border_title = title
        self._reorder()

    def sort_by(self, column: str, reverse: bool | None = None) -> None:
        if reverse is None:
            reverse = (not self.sort_reverse) if column == self.sort_column else SORTS[column][1]
        self.sort_column, self.sort_reverse = column, reverse
        self._update_subtitle()
        self._reorder()

    def highlighted_layer(self) -> str | None:
        """The name of the layer under the cursor (for palette commands)."""
        position = self.cursor_position
        return self._ordered[position].name if position is not None else None

    @property
    def cursor_position(self) -> int | None:
        if not self._ordered:
            return None
        if self._picked is None:
            return 0
        return next((i for i, r in enumerate(self._ordered) if r.index == self._picked), 0)

    def row_text(self, position: int) -> Text:
        """One row as shown, as a Text (for tests; drawing uses the same pieces as segments)."""
        text = Text(no_wrap=True, end="")
        for piece, style in self._pieces(_cells(self._ordered[position], self._names, self._origin)):
            text.append(piece, style)
        return text

    def _pieces(self, cells: list[list[tuple[str, str]]]) -> list[tuple[str, str]]:
        """Cells laid out in their columns: padded, cut with an ellipsis, GAP apart."""
        out: list[tuple[str, str]] = []
        for i, (cell, column, width) in enumerate(zip(cells, self._columns, self._widths)):
            if i:
                out.append((" " * GAP, ""))
            cell = _fit(cell, width)
            pad = (" " * (width - sum(len(p) for p, _ in cell)), "")
            out.extend([pad, *cell] if column.right else [*cell, pad])
        return out

    def _reorder(self) -> None:
        self._ordered = sort_rows(self._rows, self.sort_column, self.sort_reverse)
        self.virtual_size = Size(sum(self._widths) + GAP * (len(self._columns) - 1), len(self._ordered) + 1)
        self._redraw()

    def _redraw(self) -> None:
        self._strips.clear()
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._strips.clear()
        self._styles.clear()

    def _styles_for(self, component: str | None = None) -> Style:
        """The widget's style (+ a component's), cached: computing it walks every ancestor."""
        style = self._styles.get(component)
        if style is None:
            style = self.rich_style
            if component is not None:
                style = style + self.get_component_rich_style(component)
            self._styles[component] = style
        return style

    def _update_subtitle(self) -> None:
        direction = " (reversed)" if self.sort_reverse != SORTS[self.sort_column][1] else ""
        self.border_subtitle = f"sorted: {SORTS[self.sort_column][0]}{direction}"

    # ---- drawing (Line API: only visible lines are rendered) ----------------------------------
    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        key = -1 if y == 0 else scroll_y + y - 1   # the header stays put while rows scroll
        strip = self._strips.get(key)
        if strip is None:
            strip = self._strips[key] = self._render_row(key)
        return strip.crop_extend(scroll_x, scroll_x + self.size.width, self._styles_for())

    def _render_row(self, position: int) -> Strip:
        # Segments built directly, not through Rich's layout: a row costs microseconds.
        if position == -1:
            cells = [[(c.label, "")] for c in self._columns]
            style = self._styles_for("layer-table--header")
        elif position >= len(self._ordered):
            return Strip.blank(0, self._styles_for())
        else:
            cells = _cells(self._ordered[position], self._names, self._origin)
            cursor = position == self.cursor_position
            style = self._styles_for("layer-table--cursor" if cursor else None)
        return Strip([Segment(piece, style + _style(piece_style))
                      for piece, piece_style in self._pieces(cells) if piece])

    # ---- interaction ------------------------------------------------------------------------------
    def action_cursor(self, delta: int) -> None:
        self._move_cursor(delta)

    def action_page(self, direction: int) -> None:
        self._move_cursor(direction * max(self.size.height - 2, 1))

    def _move_cursor(self, delta: int) -> None:
        position = self.cursor_position
        if position is None:
            return
        target = min(max(position + delta, 0), len(self._ordered) - 1)
        self._picked = self._ordered[target].index
        self._scroll_to_position(target)
        self._redraw()

    def _scroll_to_position(self, position: int) -> None:
        visible_rows = max(self.size.height - 1, 1)
        top = self.scroll_offset.y
        if position < top:
            self.scroll_to(y=position, animate=False)
        elif position >= top + visible_rows:
            self.scroll_to(y=position - visible_rows + 1, animate=False)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        if offset.y == 0:
            column = self._column_at(offset.x + self.scroll_offset.x)
            if column is not None:
                self.sort_by(column.key)
            return
        position = self.scroll_offset.y + offset.y - 1
        if 0 <= position < len(self._ordered):
            self._picked = self._ordered[position].index
            self._redraw()

    def _column_at(self, x: int) -> Column | None:
        left = 0
        for column, width in zip(self._columns, self._widths):
            if left <= x < left + width + GAP:
                return column
            left += width + GAP
        return None


def is_origin_row(name: str, origin: str | None) -> bool:
    """The row of the named module, or of the module that owns it / that it owns."""
    if not origin:
        return False
    return name == origin or origin.startswith(name + ".") or name.startswith(origin + ".")


def _cells(row: LayerRow, names: list[str], origin: str | None = None) -> list[list[tuple[str, str]]]:
    """The row's cells, each a list of (text, style) pieces."""
    style = _row_style(row)
    name = names[row.index] if row.index < len(names) else visible(row.name)
    mark = [(_mark(row), "bold cyan" if row.fp32 else "bold magenta")] if _mark(row) else []
    if is_origin_row(row.name, origin):
        return [[(str(row.index), "dim")], [(name, "bold reverse red"), *mark], *_cells(row, names)[2:]]
    # A non-finite figure has no headroom: show the value itself ("inf act", "NaN grad").
    bits = magnitude(getattr(row, row.limit)) if row.nonfinite and row.limit else bits_text(row.headroom)
    head = [(f"{bits:>5} ", style), (f"{row.limit or '':<6}", style or "dim")]
    figures = [[(magnitude(v), _figure_style(v, style))] for v in (row.act, row.grad, row.weight)]
    return [[(str(row.index), "dim")], [(name, style), *mark], head, [(eta_text(row.eta), style)], *figures,
            [(fp8_text(row), style)]]


def _mark(row: LayerRow) -> str:
    return FP32_MARK if row.fp32 else FP8_MARK if row.fp8 is not None else ""


FP8_WIDTH = 40   # "1.23e+03 4.56e-02 7.89e-05 · -1.5 13.3 29.8"


def fp8_text(row: LayerRow) -> str:
    """An fp8 layer's three amax, then log2 of their scales; blank for a layer not in fp8."""
    if row.fp8 is None:
        return ""
    bits = " ".join("-" if b is None else f"{b:.1f}" for b in row.fp8_scale_bits)
    return f"{' '.join(magnitude(v) for v in row.fp8)} · {bits}"


def eta_text(steps: float | None) -> str:
    """A forecast's steps left, short: "340", "12k", "3.4M"; blank without one."""
    if steps is None or not math.isfinite(steps):
        return ""
    steps = max(0, int(steps))
    if steps < 10_000:
        return str(steps)
    if steps < 1_000_000:
        return f"{steps // 1000}k"
    return f"{steps / 1e6:.2g}M"


def _fit(cell: list[tuple[str, str]], width: int) -> list[tuple[str, str]]:
    """Cut a cell to `width` characters, ending with an ellipsis when something was cut."""
    if sum(len(p) for p, _ in cell) <= width:
        return cell
    out, left = [], width - 1
    for piece, style in cell:
        if left <= 0:
            break
        out.append((piece[:left], style))
        left -= len(piece)
    out.append(("…", cell[0][1]))
    return out


_STYLES: dict[str, Style] = {}


def _style(name: str) -> Style:
    """Parsed once: Style.parse on every segment of every redraw adds up."""
    style = _STYLES.get(name)
    if style is None:
        style = _STYLES[name] = Style.parse(name) if name else Style()
    return style


def _row_style(row: LayerRow) -> str:
    if row.headroom is None:
        return ""
    if row.nonfinite:
        return "bold red"
    if row.headroom < DANGER_BITS:
        return "red"
    if row.headroom < WARN_BITS:
        return "yellow"
    return ""


def _figure_style(value: float | None, row_style: str) -> str:
    if value is not None and not math.isfinite(value):
        return "bold red reverse"
    return row_style

