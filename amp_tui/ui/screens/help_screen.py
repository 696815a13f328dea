"""`?`: the keys (from the registry) and how to read the dashboard."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from amp_tui.ui.actions import KEY_ACTIONS, key_label
from amp_tui.ui.view import DANGER_BITS, WARN_BITS
from amp_tui.ui.widgets.layer_table import COLUMNS

READING = (
    ("headroom bits", "log2(largest finite value of the dtype / max |figure|): doublings left before "
                      "overflow. fp16 tops out at 65504, bf16 and fp32 near 3.4e38. Gradients count "
                      "multiplied by the loss scale, as the fp16 backward pass holds them."),
    ("colours", f"red: non-finite or under {DANGER_BITS:g} bit of headroom; yellow: under "
                f"{WARN_BITS:g} bits."),
    ("x on a chart", "a skipped update (GradScaler found inf/NaN gradients and halved the scale)."),
    ("vertical line", "an intervention: yours, a scheduled --at, or a restore."),
    ("sorting", "click a layer column header, or use the command palette (ctrl+p): 'Sort layers'."),
)


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
    }
    HelpScreen > VerticalScroll {
        width: 96;
        max-width: 100%;
        height: auto;
        max-height: 100%;
        border: thick $primary;
        background: $surface;
        padding: 0 1;
    }
    """
    BINDINGS = [
        Binding("escape,question_mark,q", "close", "close", id="help.close"),
    ]

    def __init__(self, mode: str | bool = "live") -> None:
        super().__init__()
        self.mode = mode if isinstance(mode, str) else ("live" if mode else "replay")

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(help_text(mode=self.mode))

    def action_close(self) -> None:
        self.dismiss(None)


def help_text(live: bool = True, mode: str | None = None) -> Table:
    """The keys that work in `mode` (default: "live" if `live` else "replay"), then how to read the
    screen, every column of the layer table included."""
    mode = mode or ("live" if live else "replay")
    keys = Table(box=None, show_header=False, pad_edge=False, expand=True)
    keys.add_column(style="bold", width=14)
    keys.add_column(ratio=1)
    keys.add_row(Text("amp-tui keys", style="bold underline"), "")
    for action in KEY_ACTIONS:
        if mode in action.modes:
            keys.add_row(Text(key_label(action)), Text(action.text(mode)[2]))
    keys.add_row("ctrl+p", Text("command palette: every action above, plus sorting the layers"))
    keys.add_row("", "")
    keys.add_row(Text("reading it", style="bold underline"), "")
    for what, meaning in READING:
        keys.add_row(Text(what), Text(meaning))
    keys.add_row("", "")
    keys.add_row(Text("layer table", style="bold underline"), "")
    for column in COLUMNS:
        keys.add_row(Text(column.label), Text(column.help))
    keys.add_row("", "")
    keys.add_row("", Text("Esc, ? or q closes this help", style="dim"))
    return keys
