"""The main screen: lays out the widgets and feeds them one Snapshot at a time.

The app decides *when* to look (its timer, skipping unchanged versions); this screen decides
*what* each widget shows, and how often. Every repaint costs the UI thread, which shares the GIL
and the cores with training, so figures that only tick with the steps are paced (`Pacing`): the
status bar, the layer table, and the charts. What the user caused or must see at once (the first
steps, a state change such as a pause or a stop, a queued command, a dtype or scale change, a new
non-finite origin, an intervention, restore, alert or error event, a key that moves a paused
replay) is drawn at the next tick, by the status bar, the layer table and the charts together, so
they show the same step. The charts move only with the status bar: at every one of its draws
while the run isn't training (paused, ended: nothing competes), else every `charts_s` at most.
Every widget skips its update when its content didn't change.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from textual import events
from textual.app import ComposeResult
from textual.containers import Container, Horizontal, Vertical
from textual.css.query import NoMatches
from textual.geometry import Region
from textual.screen import Screen
from textual.widgets import Footer
from textual.widgets._toast import Toast, ToastRack

from amp_tui.core.precision import AUTOCAST_OF, short_name
from amp_tui.core.records import STEERED_MODES
from amp_tui.sources.protocol import Snapshot
from amp_tui.ui.view import (
    current_precision,
    layer_rows,
    newest_notable_event,
    nonfinite_origin,
    nonfinite_pause,
    rank_summary,
    unmeasured_note,
    weights_note,
)
from amp_tui.ui.widgets.charts import LossChart, ScaleChart
from amp_tui.ui.widgets.error_panel import ErrorPanel
from amp_tui.ui.widgets.event_log import EventLog
from amp_tui.ui.widgets.layer_table import LayerTable
from amp_tui.ui.widgets.notice import PauseNotice
from amp_tui.ui.widgets.rank_table import RankTable
from amp_tui.ui.widgets.status_bar import StatusBar
from amp_tui.ui.widgets.too_small import TooSmall, too_small


@dataclass(frozen=True)
class Pacing:
    status_s: float   # step, loss, scale
    table_s: float    # a full table repaint costs ~10 ms at 120x40
    charts_s: float   # a training run's history needn't move faster (a plotext build of both
                      # charts costs 20-50 ms, more on a big terminal or a busy CPU)


# Beside a training run (in this process or another on the same machine) every repaint spared is
# time the training gets back: the step counter twice a second is still a live number.
TRAINING_PACE = Pacing(status_s=0.5, table_s=2.0, charts_s=5.0)
# A replay has nothing to compete with: keys that step or seek show their frame at once.
REPLAY_PACE = Pacing(status_s=0.0, table_s=0.5, charts_s=1.0)


class ChartRow(Horizontal):
    """The charts side by side; the toasts are placed over them."""

    def on_resize(self, event: events.Resize) -> None:
        if isinstance(self.screen, DashboardScreen):
            self.screen.place_toasts()


def toasts_over(rack: ToastRack, region: Region) -> None:
    """Stack the toasts of `rack` over `region` (the charts), from its top right, within its height."""
    rack.styles.dock = "top"
    rack.styles.align = ("right", "top")
    rack.styles.margin = (region.y, 0, 0, 0)
    rack.styles.max_height = region.height


class DashboardScreen(Screen):
    DEFAULT_CSS = """
    DashboardScreen #main {
        height: 1fr;
    }
    DashboardScreen #charts {
        height: 2fr;
        min-height: 8;
    }
    DashboardScreen #charts > RunChart {
        width: 1fr;
    }
    DashboardScreen #lower {
        height: 3fr;
    }
    DashboardScreen #left {
        width: 2fr;
    }
    DashboardScreen EventLog {
        width: 1fr;
        min-width: 30;
    }
    DashboardScreen #lower.-error LayerTable {
        display: none;
    }
    DashboardScreen.-too-small #main, DashboardScreen.-too-small StatusBar,
    DashboardScreen.-too-small Footer {
        display: none;
    }
    DashboardScreen.-too-small TooSmall {
        display: block;
    }
    DashboardScreen Toast {
        padding: 0 1;   /* they stack in the charts' room: no blank rows */
    }
    """

    def __init__(self, compact_footer: bool = False, *,
                 pace_clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(id="dashboard")
        self.compact_footer = compact_footer
        self.pace_clock = pace_clock   # what the pacing measures intervals with
        # Held, not queried: the app's timer draws through these even while a dialog is on top
        # or the app is shutting down.
        self.status_bar = StatusBar(id="status")
        self.loss_chart = LossChart(id="loss-chart")
        self.scale_chart = ScaleChart(id="scale-chart")
        self.pause_notice = PauseNotice(id="notice")
        self.layer_table = LayerTable(id="layers")
        self.rank_table = RankTable(id="ranks")   # a run of several ranks only
        self.error_panel = ErrorPanel(id="error")
        self.event_log = EventLog(id="events")
        self.too_small_message = TooSmall(id="too-small")
        self.lower_row = Horizontal(id="lower")
        self.chart_row = ChartRow(id="charts")
        self._toasts_over: Region | None = None
        self._history_key: tuple | None = None
        self._layers_key: tuple | None = None
        self._charts_at = -math.inf
        self._table_at = -math.inf
        self._status_at = -math.inf
        self._status_urgent: tuple | None = None
        self._table_urgent: tuple | None = None
        self._charts_urgent: tuple | None = None
        self._status_step: int | None = None   # the step the status bar shows

    def compose(self) -> ComposeResult:
        yield self.status_bar
        with Container(id="main"):
            with self.chart_row:
                yield self.loss_chart
                yield self.scale_chart
            yield self.pause_notice
            with self.lower_row:
                with Vertical(id="left"):
                    yield self.layer_table
                    yield self.rank_table
                    yield self.error_panel
                yield self.event_log
        yield self.too_small_message
        yield Footer(compact=self.compact_footer)

    def on_mount(self) -> None:
        self.layer_table.focus()
        self.call_after_refresh(self.place_toasts)

    def place_toasts(self) -> None:
        """Toasts stack over the charts, within their height, newest lowest: never over the status
        bar, the pause notice, the layer table or the events panel (Textual stacks them from the
        bottom right, over the events). Called whenever the charts' row moves or resizes."""
        region = self.chart_row.region
        rack = self._toast_rack()
        if rack is None or region == self._toasts_over:
            return
        self._toasts_over = region
        toasts_over(rack, region)

    def place_toasts_on(self, screen: Screen) -> None:
        """The same place on a dialog or the help over the dashboard: Textual gives every screen a
        toast rack of its own, at the bottom right, over the layer table and the events. The
        dashboard's own toasts are hidden meanwhile: the dialog's copies would land over them."""
        own = self._toast_rack()
        if own is not None:
            own.display = screen is self
        if screen is self:
            return
        try:
            rack = screen.get_child_by_type(ToastRack)
        except NoMatches:
            return
        toasts_over(rack, self.chart_row.region)

    def toast_room(self) -> int:
        """The rows the toasts have: the charts' height."""
        return self.chart_row.region.height

    def toast_heights(self) -> dict[str, int]:
        """The rows each toast on the dashboard takes, its margin included, by the id of the box
        Textual holds it in (a toast not laid out yet counts 0)."""
        rack = self._toast_rack()
        if rack is None:
            return {}
        return {holder.id: sum(t.outer_size.height + t.styles.margin.top for t in holder.query(Toast))
                for holder in rack.children if holder.id}

    def _toast_rack(self) -> ToastRack | None:
        try:
            return self.get_child_by_type(ToastRack)
        except NoMatches:   # an app without notifications (or not composed yet)
            return None

    def on_resize(self, event: events.Resize) -> None:
        small = too_small(event.size.width, event.size.height)
        self.set_class(small, "-too-small")
        if small:
            self.too_small_message.show_size(event.size.width, event.size.height)

    def show(self, snap: Snapshot, *, pending: list[str], stopping: bool, now: float,
             where: list[tuple[str, str]], playback: str | None = None) -> bool:
        """Draw `snap`; False when the charts or the table still wait for their turn."""
        prec = current_precision(snap)
        pace = TRAINING_PACE if snap.mode in STEERED_MODES else REPLAY_PACE
        tick = self.pace_clock()
        done = True
        origin = nonfinite_origin(snap)
        h = snap.history
        # What the user caused or must see: the status bar, the layer table and the charts draw
        # it at the same tick, so all show the same step; only the steady ticking of steps is paced.
        urgent = (snap.state, snap.playback_state, snap.mode, tuple(pending), stopping, playback, prec, snap.in_force,
                  snap.error is not None, origin, len(snap.layers.names), newest_notable_event(snap),
                  bool(h.steps),   # "waiting for the first step" goes everywhere at once
                  snap.position if snap.playback_state == "paused" else None)  # a key moved the replay
        if urgent != self._status_urgent or tick - self._status_at >= pace.status_s:
            self._status_urgent, self._status_at = urgent, tick
            self._status_step = h.steps[-1] if h.steps else None
            self.status_bar.show(snap, prec, pending=pending, stopping=stopping, now=now,
                                 playback=playback)
        else:
            done = False
        self.event_log.show(snap)
        self.pause_notice.show(nonfinite_pause(snap))
        self.error_panel.show(snap.error, where if snap.error else [])
        self.lower_row.set_class(snap.error is not None, "-error")
        history_key = (len(h.steps), h.steps[-1] if h.steps else None, h.stride,
                       len(h.skipped_steps), len(h.intervention_steps))
        if history_key != self._history_key:
            # The charts move with the status bar, never on their own: at once after something
            # happened, at every status draw while a run isn't training (paused, ended: nothing
            # competes), else at their pace (a replay playing through a pause included).
            with_status = self._status_at == tick and self._status_step == (h.steps[-1] if h.steps else None)
            idle = snap.state != "running" and snap.playback_state is None
            if with_status and (urgent != self._charts_urgent or idle
                                or tick - self._charts_at >= pace.charts_s):
                self._history_key, self._charts_at, self._charts_urgent = history_key, tick, urgent
                self.loss_chart.show(h)
                self.scale_chart.show(h)
            else:
                done = False
        note = " · ".join(n for n in (unmeasured_note(snap), weights_note(snap)) if n) or None
        layers_key = (snap.layers.step, len(snap.layers.names), prec, snap.in_force, origin, note, snap.ranks)
        if layers_key != self._layers_key:
            if urgent != self._table_urgent or tick - self._table_at >= pace.table_s:
                self._layers_key, self._table_at, self._table_urgent = layers_key, tick, urgent
                self.layer_table.show(layer_rows(snap.layers, prec, snap.in_force), snap.layers.step,
                                      short_name(AUTOCAST_OF.get(prec.dtype, prec.dtype)), origin, note)
                self.rank_table.show(rank_summary(snap))   # paced with the layers: both tick with probes
            else:
                done = False
        else:
            self._table_urgent = urgent   # the table is up to date: nothing to catch up on
        return done

    def sort_layers(self, column: str) -> None:
        self.layer_table.sort_by(column)
