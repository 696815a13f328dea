"""Which toasts are on screen: one per kind, a few at most.

A run that raises an alert every few steps, or a key pressed again and again, made a toast each
time, and the stack grew over the status bar and the events panel for as long as they lasted. A
toast of a kind already on screen replaces it, its title counting how many came in a row (the
events panel keeps every one of them). Past `MAX_TOASTS` the oldest goes; where the stack outgrows
the room the dashboard gives it (over the charts: `DashboardScreen.place_toasts`), the least
severe goes first, never the newest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from textual.app import App
from textual.css.query import NoMatches
from textual.notifications import Notification
from textual.widgets._toast import ToastRack

MAX_TOASTS = 3
SEVERITY = {"information": 0, "warning": 1, "error": 2}


@dataclass
class ToastShelf:
    """The toasts shown, by kind, oldest first. Used on the UI thread only."""

    limit: int = MAX_TOASTS
    _shown: dict[tuple, tuple[Notification, int]] = field(default_factory=dict)

    def add(self, kind: tuple, message: str, title: str, severity, timeout: float,
            markup: bool) -> tuple[Notification, list[Notification]]:
        """The notification to show, and those it takes the place of (to take off the screen)."""
        gone: list[Notification] = []
        count = 1
        earlier = self._shown.pop(kind, None)
        if earlier is not None:
            gone.append(earlier[0])
            if not earlier[0].has_expired:
                count = earlier[1] + 1
        if count > 1:
            title = f"{title} (latest of {count})" if title else f"latest of {count}"
        notification = Notification(message, title, severity, timeout, markup=markup)
        for key, (shown, _) in list(self._shown.items()):
            if shown.has_expired:
                del self._shown[key]
        while len(self._shown) >= self.limit:
            oldest = next(iter(self._shown))
            gone.append(self._shown.pop(oldest)[0])
        self._shown[kind] = (notification, count)
        return notification, gone

    def outgrows(self, heights: dict[str, int], room: int) -> bool:
        """Whether the toasts on the shelf need more rows than `room` (`heights`: the rows each
        toast on screen takes, by `box_id`). A toast on its way off the screen doesn't count."""
        shown = [n for n, _ in self._shown.values() if not n.has_expired]
        return len(shown) > 1 and sum(heights.get(box_id(n), 0) for n in shown) > room

    def give_way(self) -> Notification | None:
        """Take a toast off the shelf, the stack having outgrown its room: never the newest (what
        just happened, a key's answer), else the least severe, the oldest first; None when one or
        none is left."""
        if len(self._shown) < 2:
            return None
        older = list(self._shown)[:-1]
        kind = min(older, key=lambda k: (SEVERITY.get(self._shown[k][0].severity, 0), older.index(k)))
        return self._shown.pop(kind)[0]


def box_id(notification: Notification) -> str:
    """The id of the box Textual's rack holds the notification's toast in."""
    return ToastRack._toast_id(notification)


def take_off(app: App, notification: Notification) -> None:
    """Take a toast off every screen, once the notifications posted before it were shown (one
    notified a moment ago may not be on screen yet)."""
    app.call_later(_take_off_now, app, notification)


def _take_off_now(app: App, notification: Notification) -> None:
    # Textual forgets the notification, but its rack drops only the toast and keeps the box it
    # sat in: empty boxes would pile up and push the next toasts down, out of their room.
    app._unnotify(notification, refresh=False)   # Textual's own way to forget one notification
    box = box_id(notification)
    for screen in app.screen_stack:
        try:
            rack = screen.get_child_by_type(ToastRack)
        except NoMatches:
            continue
        for holder in list(rack.children):
            if holder.id == box:
                holder.remove()
