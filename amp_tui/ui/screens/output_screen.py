"""The job's own output (its stdout and stderr, as `amp-tui run` keeps them in output.log), with
the newest lines at the bottom, followed while it grows."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from amp_tui.ui.text import literal

TAIL_BYTES = 64 * 1024     # what is shown at most: the end of a long output
REFRESH_S = 1.0


def output_tail(path: Path, size: int = TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            total = fh.tell()
            fh.seek(max(0, total - size))
            text = fh.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc.strerror or exc})"
    if total > size:
        text = "…" + text[text.find("\n") + 1:]   # from the first whole line
    return text or "(no output yet)"


class OutputScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    OutputScreen {
        align: center middle;
    }
    OutputScreen VerticalScroll {
        width: 95%;
        height: 90%;
        border: round $accent;
        border-title-align: left;
        padding: 0 1;
        background: $surface;
    }
    """
    BINDINGS = [Binding("escape,o,q", "close", "close", id="output.close")]

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._shown: str | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll() as scroll:
            scroll.border_title = f"output: {self.path} (Esc closes)"
            yield Static(id="output-text")

    def on_mount(self) -> None:
        self.refresh_output()
        self.set_interval(REFRESH_S, self.refresh_output)

    def refresh_output(self) -> None:
        text = output_tail(self.path)
        if text == self._shown:
            return
        self._shown = text
        self.query_one("#output-text", Static).update(literal(text, keep_newlines=True))
        self.query_one(VerticalScroll).scroll_end(animate=False)

    def action_close(self) -> None:
        self.dismiss(None)
