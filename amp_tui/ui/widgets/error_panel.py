"""The script raised: its traceback, shown literally, and where the session and checkpoint are."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from amp_tui.ui.text import literal


class ErrorPanel(VerticalScroll):
    DEFAULT_CSS = """
    ErrorPanel {
        height: 1fr;
        border: round $error;
        border-title-color: $error;
        border-title-style: bold;
        display: none;
    }
    ErrorPanel.-visible {
        display: block;
    }
    ErrorPanel > Static {
        width: 1fr;
        padding: 0 1;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.text = Static(id="error-text")
        self._shown: tuple = (None, [])

    def compose(self) -> ComposeResult:
        yield self.text

    def show(self, error: dict | None, where: list[tuple[str, str]]) -> None:
        """`where`: (label, value) lines such as the session file and the last checkpoint."""
        if (error, where) == self._shown:
            return
        self._shown = (error, where)
        self.set_class(error is not None, "-visible")
        if error is None:
            return
        self.border_title = f"the script raised at step {error.get('step', '?')}"
        self.border_subtitle = "q quits; the session and checkpoints are kept"
        self.text.update(error_text(error, where))


def error_text(error: dict, where: list[tuple[str, str]]) -> Text:
    text = literal(error.get("message", "error"), "bold red")
    text.append("\n")
    for label, value in where:
        text.append(f"{label}: ", style="dim")
        text.append_text(literal(value))
        text.append("\n")
    traceback = error.get("traceback")
    if traceback:
        text.append("\n")
        text.append_text(literal(str(traceback).rstrip(), keep_newlines=True))
    return text
