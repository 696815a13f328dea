"""`m`: type a note, recorded in the session at the next step boundary."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from amp_tui.core.commands import NOTE_LIMIT, CommandError, note_text


class NoteDialog(ModalScreen[str | None]):
    DEFAULT_CSS = """
    NoteDialog {
        align: center middle;
    }
    NoteDialog > Vertical {
        width: 80;
        max-width: 100%;
        height: auto;
        border: thick $primary;
        background: $surface;
        padding: 1 2;
    }
    NoteDialog .title {
        text-style: bold;
        margin-bottom: 1;
    }
    NoteDialog #note-error {
        color: $error;
        height: auto;
    }
    NoteDialog .hint {
        color: $text-muted;
        margin-top: 1;
    }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel", id="note.cancel")]

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Add a note", classes="title")
            yield Static(Text("One line, kept in the session at the next step boundary: what you "
                              "changed, what you saw. Replays, reports and exports show it."))
            yield Input(placeholder="e.g. switched to the cleaned data shard", max_length=NOTE_LIMIT,
                        id="note-input")
            yield Static("", id="note-error")
            yield Static(f"Enter records  ·  Esc cancels  ·  at most {NOTE_LIMIT} characters", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            text = note_text(event.value)
        except CommandError as exc:
            self.query_one("#note-error", Static).update(Text(str(exc)))
            return
        self.dismiss(text)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_one("#note-error", Static).update("")

    def action_cancel(self) -> None:
        self.dismiss(None)
