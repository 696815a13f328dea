"""`S`: ask for an exact loss scale (or the init_scale for the next fp16 stretch)."""

from __future__ import annotations

import math
import re

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from amp_tui.core.precision import short_name
from amp_tui.ui.text import scale_text

_POWER = re.compile(r"^\s*2\s*(?:\^|\*\*)\s*(-?\d+(?:\.\d+)?)\s*$")


def parse_scale(text: str) -> float:
    """'4096', '1e4', '2^12' or '2**12' -> a positive finite float; ValueError says what's wrong."""
    raw = text.strip()
    if not raw:
        raise ValueError("type a number, e.g. 4096 or 2^12")
    power = _POWER.match(raw)
    try:
        value = 2.0 ** float(power.group(1)) if power else float(raw)
    except (ValueError, OverflowError):
        raise ValueError(f"{raw!r} is not a number: type e.g. 4096 or 2^12") from None
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{raw!r} is not finite: the scale must be a finite number")
    if value <= 0:
        raise ValueError(f"{raw!r} is not positive: the scale must be greater than 0")
    return value


class ScaleDialog(ModalScreen[float | None]):
    DEFAULT_CSS = """
    ScaleDialog {
        align: center middle;
    }
    ScaleDialog > Vertical {
        width: 70;
        height: auto;
        border: thick $primary;
        background: $surface;
        padding: 1 2;
    }
    ScaleDialog .title {
        text-style: bold;
        margin-bottom: 1;
    }
    ScaleDialog #scale-error {
        color: $error;
        height: auto;
    }
    ScaleDialog .hint {
        color: $text-muted;
        margin-top: 1;
    }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel", id="scale.cancel")]

    def __init__(self, dtype: str | None, scale: float | None) -> None:
        super().__init__()
        self.dtype = dtype
        self.scale = scale

    def compose(self) -> ComposeResult:
        with Vertical():
            if self.dtype == "float16":
                yield Label("Set the loss scale", classes="title")
                yield Static(Text(f"GradScaler's scale is now {scale_text(self.scale)}. "
                                  "The new value applies at the next step boundary."))
            else:
                yield Label("Set init_scale", classes="title")
                yield Static(Text(f"The run is in {short_name(self.dtype)}, which needs no loss "
                                  "scaling: the value becomes the init_scale used when fp16 is "
                                  "next entered."))
            yield Input(placeholder="e.g. 4096 or 2^12", id="scale-input")
            yield Static("", id="scale-error")
            yield Static("Enter sets  ·  Esc cancels", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            value = parse_scale(event.value)
        except ValueError as exc:
            self.query_one("#scale-error", Static).update(Text(str(exc)))
            return
        self.dismiss(value)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_one("#scale-error", Static).update("")

    def action_cancel(self) -> None:
        self.dismiss(None)
