"""Shown instead of the dashboard when the terminal is below the size the layout needs."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

MIN_WIDTH = 80
MIN_HEIGHT = 24


def too_small(width: int, height: int) -> bool:
    return width < MIN_WIDTH or height < MIN_HEIGHT


class TooSmall(Static):
    DEFAULT_CSS = """
    TooSmall {
        width: 1fr;
        height: 1fr;
        content-align: center middle;
        text-align: center;
        display: none;
    }
    """

    def show_size(self, width: int, height: int) -> None:
        text = Text()
        text.append("amp-tui needs more room\n", style="bold")
        text.append(f"at least {MIN_WIDTH}×{MIN_HEIGHT}; this terminal is {width}×{height}\n")
        text.append("enlarge the window, or press q to stop the run and quit", style="dim")
        self.update(text)
