"""The toasts for what a run did that no key asked for, apart from app.py's drawing and keys."""

from __future__ import annotations

from functools import partial

from amp_tui.core.records import ENDED, STEERED_MODES
from amp_tui.core.text import clip, visible
from amp_tui.recording.fp8_file import read_fp8
from amp_tui.recording.xray_file import read_xray
from amp_tui.sources.protocol import Snapshot
from amp_tui.ui.dialogs.fp8_dialog import Fp8Dialog
from amp_tui.ui.dialogs.xray_dialog import XrayDialog
from amp_tui.ui.view import nonfinite_pause

NOTIFY_LIMIT = 400         # characters of a recorded text in a notification (the event log has more)


def brief(value: object) -> str:
    """A recorded text for a notification: control characters shown, cut to NOTIFY_LIMIT."""
    return clip(visible(value), NOTIFY_LIMIT)


# The what-ifs that come without a key pressed: --fp8-every's, and the one that chooses fp8's layers.
UNASKED_FP8 = ("schedule", "fp8 entry")


class Announcements:
    """One notification per notable change that the user didn't cause with a key. Mixed into
    `AmpTuiApp`, whose `refresh_view` calls `_announce` with each new snapshot."""

    def _announce(self, snap: Snapshot) -> None:
        """One notification per notable change that the user didn't cause with a key."""
        pause = nonfinite_pause(snap)
        if pause is not None and ("pause", pause.event_index) not in self._announced:
            self._announced.add(("pause", pause.event_index))
            where = f"; first non-finite layer: {brief(pause.layer)}" if pause.layer else ""
            what = "activation" if pause.where == "activations" else "loss"
            offer = f"f applies {pause.fix}, " if pause.fix and not pause.fix_applied else ""
            self.notify(f"non-finite {what} at step {pause.step}{where}. Paused: {offer}d dtype, "
                        "s halve scale, r restore", title="paused", severity="warning",
                        timeout=10, markup=False)
        for event in self._new_events(snap):
            if event.get("kind") == "alert":
                self.notify(brief(event.get("message", "")), title=f"alert at step {event.get('step')}",
                            severity="warning", timeout=12, markup=False, kind="alert")
            elif event.get("kind") == "error" and event.get("during") in ("io", "save"):
                self.notify(brief(event.get("message", "")), title="could not write",
                            severity="error", timeout=20, markup=False)
            elif event.get("kind") == "nonfinite" and event.get("fix_verified") is True \
                    and snap.mode in STEERED_MODES and ("fix", event.get("fix")) not in self._announced:
                # Once per fix: a run that keeps overflowing the same way verifies it every step.
                self._announced.add(("fix", event.get("fix")))
                self.notify(visible(f"{event.get('fix')} made step {event.get('step')} finite: f applies it"),
                            title="fix verified", severity="warning", timeout=15, markup=False)
            elif event.get("kind") == "xray" and snap.mode in STEERED_MODES:
                self._show_file(event, "X-ray", read_xray, XrayDialog)
            elif event.get("kind") == "fp8" and snap.mode in STEERED_MODES and event.get("source") in UNASKED_FP8:
                # --fp8-every, or entering fp8: a toast, not a dialog nobody asked for (8 shows the next one).
                self.notify(brief(event.get("message", "")), title="fp8 what-if", timeout=8, markup=False)
            elif event.get("kind") == "fp8_layers" and snap.mode in STEERED_MODES:
                self.notify(visible(event.get("message", "")), title="fp8", timeout=10, markup=False)
            elif event.get("kind") == "fp8" and snap.mode in STEERED_MODES:
                self._show_file(event, "fp8 what-if", read_fp8, partial(Fp8Dialog, filter_path=event.get("filter")))
            elif event.get("kind") == "paused" and event.get("reason") == "io":
                # A full disk (the previous checkpoint is intact): freeing space and resuming
                # writes the records kept meanwhile.
                self.notify("The run is paused: free some space, then space resumes.",
                            title="paused", severity="warning", timeout=20, markup=False)
        # Last: of what came at once, what ended the run is the toast that stays.
        error = snap.error
        if error is not None and ("error", error.get("step"), error.get("message")) not in self._announced:
            self._announced.add(("error", error.get("step"), error.get("message")))
            self._error_where = self._where()   # once: it lists the checkpoint folder
            self.notify(brief(error.get("message", "error")), title="the script raised",
                        severity="error", timeout=15, markup=False)
        if snap.state != self._last_state:
            if snap.state in ENDED:
                self._pending.clear()
            if snap.state == "finished" and snap.mode in STEERED_MODES:
                self.notify("the run finished: q quits", title="finished", markup=False)
            self._last_state = snap.state
            self.refresh_bindings()

    def _new_events(self, snap: Snapshot) -> list[dict]:
        """Events fed since the last call (a replay seeking back starts over)."""
        new = snap.events_seen - self._events_seen
        self._events_seen = snap.events_seen
        if new <= 0:
            return []
        return snap.events[-min(new, len(snap.events)):]

    def _where(self) -> list[tuple[str, str]]:
        """Where the user's work is kept, for the error panel."""
        lines = []
        session = self.source.session_path
        if session is not None:
            lines.append(("session", str(session)))
        try:
            found = self.source.checkpoints()
        except Exception:  # noqa: BLE001 - listing is best effort here
            found = []
        if found:
            info = found[0]
            lines.append(("last checkpoint", f"{info.path} (step {info.step})"))
        else:
            lines.append(("last checkpoint", "none saved"))
        return lines

    def _show_file(self, event: dict, title: str, read, dialog) -> None:
        """A file asked of a step came (an X-ray, an fp8 what-if: `read` reads it, `dialog(step,
        path, data)` shows it): in a dialog over the dashboard only (a dialog the user has open
        keeps the keys, and the event's message says where the file is)."""
        step, path = event.get("step"), str(event.get("path", ""))
        try:
            data = read(self.source.run_dir, path)
        except (OSError, ValueError, TypeError) as exc:
            self.notify(visible(f"{title} of step {step}: can't read {path}: {exc}"), title=title,
                        severity="error", markup=False)
            return
        if self.screen is self.dashboard:
            self.push_screen(dialog(step, path, data))
        else:
            self.notify(brief(event.get("message", "")), title=title, timeout=15, markup=False)
