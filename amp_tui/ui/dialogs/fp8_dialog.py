"""The fp8 what-if of a step (8, `amp-tui ctl RUN fp8`): a line per Linear layer with its verdict
and the figures behind it, sortable (s, or a click on a heading), and where the filter for torchao
was written. Esc closes."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from amp_tui.recording.fp8_file import SUMMARY_COLUMNS, fp8_message, layer_summaries, summary_cell
from amp_tui.ui.text import literal


def _sort_key(key: str):
    def value(cell) -> tuple:
        # Missing figures last; numbers by value, words by text.
        if cell is None:
            return (2, 0.0, "")
        return (0, float(cell), "") if isinstance(cell, (int, float)) else (1, 0.0, str(cell))
    return value


class Fp8Dialog(ModalScreen[None]):
    DEFAULT_CSS = """
    Fp8Dialog {
        align: center middle;
    }
    Fp8Dialog Vertical {
        width: 95%;
        height: 90%;
        border: round $accent;
        border-title-align: left;
        padding: 0 1;
        background: $surface;
    }
    Fp8Dialog DataTable {
        height: 1fr;
    }
    """
    BINDINGS = [Binding("escape,8,q", "close", "close", id="fp8.close"),
                Binding("s", "sort_next", "sort", id="fp8.sort")]

    def __init__(self, step: int, path: str, whatif: dict, filter_path: str | None = None) -> None:
        super().__init__()
        self.step, self.path, self.filter_path, self.whatif = step, path, filter_path, whatif
        self.summaries = layer_summaries(whatif)
        self.sort_column = 1   # the verdict: the layers kept in bf16 first
        self.descending = False

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = f"fp8 what-if of step {self.step} (s sorts, Esc closes)"
            head = [fp8_message(self.step, self.whatif), f"file: {self.path}"]
            if self.filter_path:
                head.append(f"filter for torchao's convert_to_float8_training: {self.filter_path}")
            yield Static(literal("\n".join(head), keep_newlines=True), id="fp8-head")
            yield DataTable(id="fp8-table", zebra_stripes=True, cursor_type="row")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for key, heading in SUMMARY_COLUMNS:
            table.add_column(heading, key=key)
        for line in self.summaries:
            table.add_row(*(summary_cell(key, line[key]) for key, _ in SUMMARY_COLUMNS), key=line["module"])
        self._sort()

    def _sort(self) -> None:
        key = SUMMARY_COLUMNS[self.sort_column][0]
        by_module = {line["module"]: line[key] for line in self.summaries}
        order = sorted(by_module, key=lambda m: _sort_key(key)(by_module[m]), reverse=self.descending)
        table = self.query_one(DataTable)
        rank = {m: i for i, m in enumerate(order)}
        table.sort("module", key=lambda module: rank[module])

    def action_sort_next(self) -> None:
        self.sort_column = (self.sort_column + 1) % len(SUMMARY_COLUMNS)
        self.descending = False
        self._sort()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        index = [key for key, _ in SUMMARY_COLUMNS].index(str(event.column_key.value))
        self.descending = not self.descending if index == self.sort_column else False
        self.sort_column = index
        self._sort()

    def action_close(self) -> None:
        self.dismiss(None)
