"""`g` in a replay: type a step number to show."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static


def parse_step(text: str, total: int) -> int:
    """A whole number within 0..total-1; ValueError says what's wrong."""
    raw = text.strip()
    if total <= 0:
        raise ValueError("the recording has no steps yet")
    if not raw:
        raise ValueError(f"type a step number from 0 to {total - 1}")
    try:
        step = int(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not a whole number: type a step from 0 to {total - 1}") from None
    if not 0 <= step <= total - 1:
        raise ValueError(f"step {step} is out of range: the recording has steps 0 to {total - 1}")
    return step


class GotoDialog(ModalScreen[int | None]):
    DEFAULT_CSS = """
    GotoDialog {
        align: center middle;
    }
    GotoDialog > Vertical {
        width: 60;
        height: auto;
        border: thick $primary;
        background: $surface;
        padding: 1 2;
    }
    GotoDialog .title {
        text-style: bold;
        margin-bottom: 1;
    }
    GotoDialog #goto-error {
        color: $error;
        height: auto;
    }
    GotoDialog .hint {
        color: $text-muted;
        margin-top: 1;
    }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel", id="goto.cancel")]

    def __init__(self, total: int, position: int | None) -> None:
        super().__init__()
        self.total = total
        self.position = position

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Go to a step", classes="title")
            where = f"now at step {self.position}; " if self.position is not None else ""
            yield Static(Text(f"{where}the recording has steps 0 to {max(self.total - 1, 0)}."))
            yield Input(placeholder=f"0 … {max(self.total - 1, 0)}", id="goto-input")
            yield Static("", id="goto-error")
            yield Static("Enter goes  ·  Esc cancels", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            step = parse_step(event.value, self.total)
        except ValueError as exc:
            self.query_one("#goto-error", Static).update(Text(str(exc)))
            return
        self.dismiss(step)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_one("#goto-error", Static).update("")

    def action_cancel(self) -> None:
        self.dismiss(None)
