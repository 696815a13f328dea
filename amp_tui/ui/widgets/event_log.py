"""The event timeline: skips, non-finite losses, interventions, checkpoints, errors, by step."""

from __future__ import annotations

import collections

from rich.table import Table
from rich.text import Text
from textual import events
from textual.widgets import RichLog

from amp_tui.core.records import note_text
from amp_tui.core.text import clip
from amp_tui.sources.protocol import EVENT_LIMIT, Snapshot
from amp_tui.ui.text import literal
from amp_tui.ui.view import event_label

MESSAGE_LIMIT = 2000   # characters of a message drawn: a message may be megabytes (a hostile file)


class EventLog(RichLog):
    DEFAULT_CSS = """
    EventLog {
        height: 1fr;
        border: round $primary 50%;
        border-title-color: $text;
        background: $surface;
        scrollbar-size-vertical: 1;
        overflow-x: hidden;
    }
    EventLog:focus {
        border: round $primary;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(max_lines=EVENT_LIMIT * 4, min_width=20, wrap=True, markup=False,
                         highlight=False, **kwargs)
        self._seen = 0
        self._shown: collections.deque[dict] = collections.deque(maxlen=EVENT_LIMIT)
        self._width = 0

    def on_mount(self) -> None:
        self.border_title = "events"
        # Stay at the newest event when the log's height changes too (a banner above it comes
        # and goes), not only when a line is written; scrolling up releases it.
        self.anchor()

    def show(self, snap: Snapshot) -> None:
        """Append the events this log hasn't shown yet (a replay that seeks back starts over)."""
        if snap.events_seen < self._seen:
            self._shown.clear()
            self.clear()
            self._seen = 0
        new = snap.events_seen - self._seen
        if new <= 0:
            return
        for event in snap.events[-min(new, len(snap.events)):]:
            self._shown.append(event)
            self.write(event_line(event))
        self._seen = snap.events_seen
        self.border_title = f"events ({snap.events_seen})"

    def on_resize(self, event: events.Resize) -> None:
        # Lines are wrapped when written: re-wrap them all at the new width.
        if event.size.width != self._width and self._shown:
            self.clear()
            for shown in self._shown:
                self.write(event_line(shown))
        self._width = event.size.width


def event_line(event: dict) -> Table:
    """step · kind · message, with a long message wrapping inside its own column."""
    label, style = event_label(event)
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(width=6, justify="right", style="dim")
    grid.add_column(width=9, no_wrap=True)
    grid.add_column(ratio=1, overflow="fold")
    # A note's label says what it is: its text alone follows, as typed.
    text = note_text(event) if event.get("kind") == "note" else str(event.get("message", ""))
    message = clip(text, MESSAGE_LIMIT)
    grid.add_row(Text(str(event.get("step", "?"))), Text(label, style=style), literal(message))
    return grid
