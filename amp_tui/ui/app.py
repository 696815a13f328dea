"""The dashboard app and its factory (shared by the CLI and the tests; `amp-tui train`'s wiring of
a run, its source, the hang-up guard and the summary around it is amp_tui.cli.train.run_dashboard).

Threads: the training loop runs on the source's own thread. This app never calls into the loop
except through `source.send()`/`stop()`; the loop's `on_done` callbacks and the quit sequence's
waiter thread only `post_message` back. The screen is redrawn from `source.snapshot()` on a
timer (at most `refresh_rate` times a second), and only when the snapshot's version changed.
"""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
from functools import partial
from typing import Callable, Iterable

from textual.app import App, SystemCommand
from textual.notifications import Notify, SeverityLevel
from textual.screen import Screen

from amp_tui.core.commands import Action, Command, Outcome
from amp_tui.core.records import ENDED
from amp_tui.core.signals import handling_signals
from amp_tui.core.text import visible
from amp_tui.sources.protocol import Source
from amp_tui.ui.actions import BY_ACTION, KEY_ACTIONS, bindings, key_label
from amp_tui.ui.announcements import NOTIFY_LIMIT, Announcements, brief
from amp_tui.ui.dialogs.goto_dialog import GotoDialog
from amp_tui.ui.messages import InterventionDone, SourceStopped, TerminalGone
from amp_tui.ui.screens.dashboard import DashboardScreen
from amp_tui.ui.screens.help_screen import HelpScreen
from amp_tui.ui.screens.output_screen import OutputScreen
from amp_tui.ui.steering_keys import SteeringKeys
from amp_tui.ui.toasts import ToastShelf, take_off
from amp_tui.ui.view import SORTS

STOP_TIMEOUT_S = 10.0     # how long `q` waits for the current step before forcing the exit
FORCED_EXIT_DELAY_S = 1.5  # leave the "forcing the exit" message on screen this long
COMMAND_SOURCE = "dashboard"
COMMAND_TITLES: dict[Action, str] = {
    "dtype": "dtype", "scale": "loss scale", "save": "checkpoint", "restore": "restore", "pause": "pause",
    "resume": "resume", "step": "single step", "stop": "stop", "fp32": "local fp32", "note": "note",
    "probe": "probes", "xray": "X-ray", "undo": "undo autopilot", "fix": "fix",
    "fp8": "fp8 what-if"}

__all__ = ["COMMAND_SOURCE", "COMMAND_TITLES", "FORCED_EXIT_DELAY_S", "NOTIFY_LIMIT", "STOP_TIMEOUT_S", "AmpTuiApp",
           "brief", "create_app"]


# Plain mixins, not Textual classes: the CSS type and BINDINGS stay this class's and App's.
class AmpTuiApp(Announcements, SteeringKeys, App[int]):
    TITLE = "amp-tui"
    BINDINGS = bindings()
    NOTIFICATION_TIMEOUT = 6

    def __init__(self, source: Source, *, refresh_rate: float = 20.0,
                 clock: Callable[[], float] = time.time, warnings: Iterable[str] = (),
                 stop_timeout: float = STOP_TIMEOUT_S,
                 pace_clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not (math.isfinite(refresh_rate) and refresh_rate > 0):
            raise ValueError(f"refresh rate must be a positive number of refreshes per second, "
                             f"got {refresh_rate!r}")
        self.source = source
        self.refresh_rate = refresh_rate
        self.clock = clock
        self.warnings = list(warnings)
        self.stop_timeout = stop_timeout
        # a replay has twelve keys: the compact footer fits them in 120 columns
        self.dashboard = DashboardScreen(compact_footer=source.mode == "replay", pace_clock=pace_clock)
        self.forced_exit = False        # the run did not stop in time; run_dashboard must not wait
        self._interrupted = False       # SIGINT came before the app's loop ran
        self.stopping = False
        # The last stop was held (the disk refuses the run's last records): q again gives them up.
        self._give_up_on_quit = False
        self._version: int | None = None
        self._second: int | None = None
        self._heavy_pending = False
        self._pending: list[Command] = []
        self._announced: set[tuple] = set()
        self._last_state: str | None = None
        self._events_seen = 0
        self._toast_shelf = ToastShelf()
        self._quiet: set[int] = set()   # ids of the commands whose answer needs no toast
        self._error_where: list[tuple[str, str]] = []
        self._stop_job: Command | None = None   # attached: Q sent this; exit once it's done
        self.playback = source.playback   # a recording's controls; None for a run
        self.keys_mode = source.mode   # which keys exist and what they say
        # BINDINGS are the live keys; this mode's keys (replay's, attached's Q) are added here,
        # one binding per key; a key that does something else in this mode gets its texts.
        for binding in bindings(self.keys_mode):
            self._bindings.key_to_bindings[binding.key] = [binding]

    # ---- lifecycle ----------------------------------------------------------------------------
    def run(self, *args, **kwargs):
        """SIGINT sent to the process (`kill -INT`; the terminal's own Ctrl+C is a key) is what
        Ctrl+C does. Left to asyncio it would cancel the app's task wherever it stands, and a
        shutdown cancelled halfway could leave the process hanging."""
        with handling_signals((signal.SIGINT,), self._on_sigint):
            return super().run(*args, **kwargs)

    def _on_sigint(self, _signum, _frame) -> None:
        # A signal handler runs on the main thread between two bytecodes, maybe inside the event
        # loop's own code: only hand the key's action to the loop, waking it.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._interrupted = True   # before the loop runs: on_mount acts on it
            return
        loop.call_soon_threadsafe(self.call_later, self.action_interrupt)

    def get_default_screen(self) -> Screen:
        return self.dashboard

    def on_mount(self) -> None:
        for warning in self.warnings:
            self.notify(visible(warning), title="script warning", severity="warning",
                        timeout=12, markup=False)
        # A dialog gets a toast rack of its own once composed: it goes where the dashboard's is.
        self.screen_change_signal.subscribe(
            self, lambda screen: self.call_after_refresh(self.dashboard.place_toasts_on, screen))
        self.source.start()
        self.call_after_refresh(self.refresh_view)   # the first frame, once the screen is composed
        if self._interrupted:
            self.call_later(self.action_interrupt)
        self.set_interval(1.0 / self.refresh_rate, self.refresh_view, name="refresh")

    def on_terminal_gone(self, message: TerminalGone) -> None:
        # The run is being stopped by HangupGuard's thread; nobody is watching: leave now.
        self.exit()

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True, kind: str | None = None) -> None:
        """Textual's notify, a few toasts at most: one of the same kind (`kind`, else the title)
        and severity as a toast on screen takes its place, its title counting them."""
        notification, gone = self._toast_shelf.add(
            (kind or title, severity), message, title, severity,
            self.NOTIFICATION_TIMEOUT if timeout is None else timeout, markup)
        for earlier in gone:
            take_off(self, earlier)
        self.post_message(Notify(notification))

    # ---- drawing --------------------------------------------------------------------------------
    def refresh_view(self) -> None:
        if not self.dashboard.is_mounted:
            return
        if self._toast_shelf.outgrows(self.dashboard.toast_heights(), self.dashboard.toast_room()):
            dropped = self._toast_shelf.give_way()
            if dropped is not None:
                take_off(self, dropped)
        snap = self.source.snapshot()
        now = self.clock()
        changed = snap.version != self._version
        # Unchanged: only the "no step for N s" indicator may need a tick, once a second.
        if not changed and not self._heavy_pending and int(now) == self._second:
            return
        self._version, self._second = snap.version, int(now)
        if changed:
            self._announce(snap)
        drawn = self.dashboard.show(snap, pending=[c.text() for c in self._pending],
                                    stopping=self.stopping, now=now, where=self._error_where,
                                    playback=self._playback_text())
        self._heavy_pending = not drawn   # charts/table skipped for pacing: look again next tick

    def _playback_text(self) -> str | None:
        """A replay's "paused · 16 steps/s" / "playing 16 steps/s" for the status bar."""
        if self.playback is None:
            return None
        text = self.playback.playback_text()
        if not self.playback.playing:
            text += f" · {self.playback.speed:g} steps/s"
        return text

    # ---- commands (the keys that steer the run: steering_keys.py) -------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        key_action = BY_ACTION.get(action)
        if key_action is None:
            return True
        if key_action.priority and not key_action.always and self.screen is not self.dashboard:
            return False   # a dialog's input keeps its own arrows, home/end, + and -
        return self.available(key_action)

    def available(self, key_action) -> bool | None:
        """True: the key works now; None: shown dimmed (the run ended); False: hidden."""
        mode = self.keys_mode
        if not key_action.bound_in(mode):
            return False
        if key_action.action == "show_output":
            return self.source.output_path is not None
        if key_action.always:
            return True
        if mode == "replay":
            return self.playback is not None
        return self.can_steer()

    def can_steer(self) -> bool | None:
        """True for a live run or a job we're attached to; None (keys shown dimmed) once it
        ended; False (keys hidden) for a recording, which can't be steered."""
        if not self.source.can_steer:
            return False
        return None if self._last_state in ENDED else True

    def send(self, action: Action, value=None, *, quiet: bool = False) -> bool:
        """Queue a command for the run; False (and said so) when the source refused it. `quiet`:
        no toast for its answer unless it failed (the picker's own pause and resume)."""
        command = Command(action, value, COMMAND_SOURCE)
        command.on_done = partial(self._command_done, command)
        ok, message = self.source.send(command)
        if not ok:
            self.notify(visible(message), title=COMMAND_TITLES.get(action, ""), severity="warning",
                        markup=False)
            return False
        if quiet:
            self._quiet.add(id(command))
        self._pending.append(command)
        self.refresh_view_soon()
        return True

    def _command_done(self, command: Command, outcome: Outcome) -> None:
        # Called on the training thread: hand over to the UI thread.
        self.post_message(InterventionDone(command, outcome))

    def on_intervention_done(self, message: InterventionDone) -> None:
        if message.command in self._pending:
            self._pending.remove(message.command)
        outcome = message.outcome
        if message.command is self._stop_job:
            if outcome.ok:
                self.stopping = True
                threading.Thread(target=self._wait_for_stop, name="amp-tui-stop", daemon=True).start()
                return
            self._stop_job = None
        quiet = id(message.command) in self._quiet
        self._quiet.discard(id(message.command))
        if not (quiet and outcome.ok):
            self.notify(visible(outcome.message), title=COMMAND_TITLES.get(message.command.action, ""),
                        severity="information" if outcome.ok else "error", markup=False)
        self.refresh_view_soon()

    def refresh_view_soon(self) -> None:
        self._second = None
        self.call_later(self.refresh_view)

    def _pending_value(self, action: Action):
        for command in reversed(self._pending):
            if command.action == action:
                return command.value
        return None

    def action_show_output(self) -> None:
        if self.source.output_path is not None:
            self.push_screen(OutputScreen(self.source.output_path))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.keys_mode))

    # ---- replay playback ------------------------------------------------------------------------
    def _playback_done(self) -> None:
        self.refresh_view_soon()

    def action_replay_faster(self) -> None:
        self.playback.faster()
        self._playback_done()

    def action_replay_slower(self) -> None:
        self.playback.slower()
        self._playback_done()

    def action_replay_step(self, n: int) -> None:
        self.playback.step_by(int(n))
        self._playback_done()

    def action_replay_event(self, direction: int) -> None:
        found = self.playback.next_event() if int(direction) > 0 else self.playback.previous_event()
        if found is None:
            self.notify("no event " + ("after" if int(direction) > 0 else "before") + " this step",
                        title="events", markup=False)
        self._playback_done()

    def action_replay_home(self) -> None:
        self.playback.home()
        self._playback_done()

    def action_replay_end(self) -> None:
        self.playback.end()
        self._playback_done()

    def action_replay_goto(self) -> None:
        def chosen(step: int | None) -> None:
            if step is not None:
                self.playback.seek(step)
                self._playback_done()

        self.push_screen(GotoDialog(self.playback.total_steps, self.playback.position), chosen)

    def action_sort_layers(self, column: str) -> None:
        self.dashboard.sort_layers(column)

    # ---- quitting -------------------------------------------------------------------------------
    async def action_quit(self) -> None:
        if self.stopping:
            self.notify("forcing the exit now", severity="warning", markup=False)
            self.forced_exit = True
            self.exit()
            return
        self.stopping = True
        if self.keys_mode == "attached":
            self.notify(f"detaching: the job keeps running (amp-tui attach "
                        f"{self.source.run_dir} comes back; Q stops it)",
                        title="detach", markup=False)
        elif self.keys_mode == "launched":
            self.notify("stopping the job at its next step boundary, then waiting for it to exit… "
                        "(q again forces the exit)", title="quit", markup=False)
        elif self._give_up_on_quit:
            self.notify("writing the last records once more; quitting without them if the disk "
                        "still refuses them…", title="quit", severity="warning", markup=False)
        elif self.source.mode == "live":
            self.notify("stopping at the next step boundary… (q again forces the exit)",
                        title="quit", markup=False)
        self.refresh_view_soon()
        # A plain daemon thread, not a Textual thread worker: workers run in asyncio's default
        # executor, which the event loop joins at exit, so a hung step would hang the exit too.
        threading.Thread(target=self._wait_for_stop, name="amp-tui-stop", daemon=True).start()

    async def action_interrupt(self) -> None:
        """Ctrl+C: what q does, whichever screen is up (a dialog closes with the app)."""
        await self.action_quit()

    def action_stop_job(self) -> None:
        """Attached: send `stop` to the job, leave once it was applied."""
        if self._stop_job is not None:
            return
        command = Command("stop", None, COMMAND_SOURCE)
        command.on_done = partial(self._command_done, command)
        ok, message = self.source.send(command)
        if not ok:
            self.notify(visible(message), title="stop the job", severity="warning", markup=False)
            return
        self._stop_job = command
        self._pending.append(command)
        self.notify("stopping the job at its next step boundary…", title="stop the job",
                    markup=False)
        self.refresh_view_soon()

    def _wait_for_stop(self) -> None:
        stopped = self.source.stop(self.stop_timeout, give_up_unwritten=self._give_up_on_quit)
        self.post_message(SourceStopped(stopped, self.stop_timeout))

    def on_source_stopped(self, message: SourceStopped) -> None:
        if message.stopped:
            self.exit()
            return
        held = self.source.held_stop()
        if held is not None:
            # Quitting now would lose records: say how many, and let a second q confirm.
            self.stopping = False
            self._give_up_on_quit = True
            self.notify(f"{visible(held)}. Press q again to quit without them.",
                        title="records not written", severity="error", timeout=30, markup=False)
            self.refresh_view_soon()
            return
        self.forced_exit = True
        self.notify(f"the current step did not finish within {message.timeout:g} s: "
                    "forcing the exit (the session is flushed up to the last finished step)",
                    title="quit", severity="error", timeout=FORCED_EXIT_DELAY_S + 5, markup=False)
        self.set_timer(FORCED_EXIT_DELAY_S, self.exit)

    # ---- command palette ------------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for command in super().get_system_commands(screen):
            if command.title != "Quit":   # ours replaces it (clean stop first)
                yield command
        for a in KEY_ACTIONS:
            if a.shown_in(self.keys_mode) and self.available(a):
                _, title, help_line = a.text(self.keys_mode)
                yield SystemCommand(f"{title}  [{key_label(a)}]", help_line,
                                    partial(self.run_action, a.action))
        layer = self.dashboard.layer_table.highlighted_layer() if self.dashboard.is_mounted else None
        if layer is not None and self.can_steer():
            yield SystemCommand(f"Toggle fp32 for layer {visible(layer)}",
                                "run the highlighted layer with autocast off (again: back to autocast)",
                                partial(self.send, "fp32", layer))
        for column, (label, _) in SORTS.items():
            yield SystemCommand(f"Sort layers: {label}", f"order the layer table by {column}",
                                partial(self.action_sort_layers, column))


def create_app(source: Source, *, refresh_rate: float = 20.0, clock: Callable[[], float] = time.time,
               warnings: Iterable[str] = (), stop_timeout: float = STOP_TIMEOUT_S,
               pace_clock: Callable[[], float] = time.monotonic) -> AmpTuiApp:
    """The dashboard for `source` (a LiveSource, a replay, or a test double). `clock` gives the
    wall time shown ("no step for N s"); `pace_clock` the intervals the pacing counts."""
    return AmpTuiApp(source, refresh_rate=refresh_rate, clock=clock, warnings=warnings,
                     stop_timeout=stop_timeout, pace_clock=pace_clock)

