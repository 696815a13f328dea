"""A banner for a run that paused itself after a non-finite loss: which step, which layer (the op's
module where the op replay found it, as the events say), the verified fix, and the keys that
help (`f` first when there is a fix to apply; once it is in force, resuming)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from amp_tui.core.precision import short_name
from amp_tui.ui.text import literal
from amp_tui.ui.view import NonfinitePause

HELPFUL_KEYS = (("d", "switch dtype"), ("s", "halve scale"), ("r", "restore"), ("space", "resume"),
                ("n", "one step"))
# Once the fix is in force, going on is what helps next.
RESUME_KEYS = (("space", "resume"), ("n", "one step"))


class PauseNotice(Static):
    DEFAULT_CSS = """
    PauseNotice {
        height: auto;
        padding: 0 1;
        background: $warning 25%;
        border-left: thick $warning;
        display: none;
    }
    PauseNotice.-visible {
        display: block;
    }
    """

    _shown: NonfinitePause | None = None

    def show(self, pause: NonfinitePause | None) -> None:
        if pause == self._shown:
            return
        self._shown = pause
        self.set_class(pause is not None, "-visible")
        if pause is not None:
            self.update(notice_text(pause))


def notice_text(pause: NonfinitePause) -> Text:
    text = Text()
    said = "non-finite activation (the loss finite)" if pause.where == "activations" else f"{pause.loss} loss"
    text.append(f"Paused: {said} at step {pause.step}", style="bold")
    if pause.dtype:
        text.append(f" in {short_name(pause.dtype)}")
    if pause.layer:
        text.append("; first non-finite layer: ")
        text.append_text(literal(pause.layer, "bold"))
    if pause.fix:
        text.append("; fix applied: " if pause.fix_applied else "; verified fix: ")
        text.append_text(literal(pause.fix, "bold"))
    text.append("\n")
    if pause.fix and pause.fix_applied:
        keys = RESUME_KEYS + HELPFUL_KEYS[:3]
    else:
        keys = ((("f", "apply the fix"),) if pause.fix else ()) + HELPFUL_KEYS
    for i, (key, what) in enumerate(keys):
        if i:
            text.append(" · ", style="dim")
        text.append(key, style="bold reverse")
        text.append(f" {what}")
    return text
