"""The X-ray of a step (x, `amp-tui ctl RUN xray`): its ops closest to their dtype's max, least
headroom first, then the dtypes autocast ran each module's ops in; scrollable, Esc closes."""

from __future__ import annotations

from collections import Counter

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from amp_tui.recording.xray_file import closest_lines, module_words
from amp_tui.ui.text import literal


def xray_text(step: int, path: str, xray: dict) -> str:
    """The dialog's text: the closest ops, then per module the ops' count by dtype."""
    scale = xray.get("scale")
    lines = [f"{xray.get('dtype')}, loss scale {scale:g}" if isinstance(scale, (int, float))
             else f"{xray.get('dtype')}, no loss scale",
             "", "Closest to their dtype's max (bits of headroom, least first):"]
    lines += [f"  {line}" for line in closest_lines(xray)] or ["  (no op had a finite nonzero output)"]
    lines += ["", "Per module, the dtypes autocast ran its ops in (ops counted by dtype):"]
    for module in xray.get("modules") or []:
        counts: Counter = Counter()
        for op in module.get("ops") or []:
            counts[op.get("dtype")] += op.get("count", 1)
        said = ", ".join(f"{dtype} ×{n}" for dtype, n in counts.most_common())
        lines.append(f"  {module_words(module.get('module'))}: {said}")
    lines += ["", f"step {step}: {path} in the run directory"]
    return "\n".join(lines)


class XrayDialog(ModalScreen[None]):
    DEFAULT_CSS = """
    XrayDialog {
        align: center middle;
    }
    XrayDialog VerticalScroll {
        width: 95%;
        height: 90%;
        border: round $accent;
        border-title-align: left;
        padding: 0 1;
        background: $surface;
    }
    """
    BINDINGS = [Binding("escape,x,q", "close", "close", id="xray.close")]

    def __init__(self, step: int, path: str, xray: dict) -> None:
        super().__init__()
        self.step, self.path, self.xray = step, path, xray

    def compose(self) -> ComposeResult:
        with VerticalScroll() as scroll:
            scroll.border_title = f"X-ray of step {self.step} (Esc closes)"
            yield Static(literal(xray_text(self.step, self.path, self.xray), keep_newlines=True), id="xray-text")

    def action_close(self) -> None:
        self.dismiss(None)
