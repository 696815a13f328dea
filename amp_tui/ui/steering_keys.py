"""The dashboard's keys that steer a run, apart from app.py's lifecycle, drawing and replay keys."""

from __future__ import annotations

from pathlib import Path

from amp_tui.core import precision
from amp_tui.core.fixes import NO_FIX, last_verified_fix
from amp_tui.core.text import visible
from amp_tui.ui.dialogs.note_dialog import NoteDialog
from amp_tui.ui.dialogs.restore_dialog import RestoreDialog
from amp_tui.ui.dialogs.scale_dialog import ScaleDialog
from amp_tui.ui.view import current_precision, probing_every_step


class SteeringKeys:
    """The key actions that send the run a command (or, in a replay, say why they can't). Mixed into
    `AmpTuiApp`: each `action_*` is a key's action (ui/actions.py), and `send` queues its command."""

    def action_cycle_dtype(self) -> None:
        snap = self.source.snapshot()
        base = self._pending_value("dtype") or current_precision(snap).dtype or "float16"
        self.send("dtype", precision.CYCLE.get(base, "float16"))

    def action_halve_scale(self) -> None:
        self.send("scale", "half")

    def action_set_scale(self) -> None:
        prec = current_precision(self.source.snapshot())

        def chosen(value: float | None) -> None:
            if value is not None:
                self.send("scale", value)

        self.push_screen(ScaleDialog(prec.dtype, prec.scale), chosen)

    def action_save_checkpoint(self) -> None:
        self.send("save")

    def action_pick_checkpoint(self) -> None:
        try:
            found = list(self.source.checkpoints())
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable checkpoint folder
            self.notify(visible(exc), title="checkpoints", severity="error", markup=False)
            found = []
        run_dir = self.source.run_dir
        # Training on while the user picks would make the restore roll back every update made
        # meanwhile: the run is paused while the picker is open, and goes on once it closes
        # (from the checkpoint, when one was picked) only if this paused it. The status bar says
        # so; the toast left is the restore's.
        paused_here = self.source.snapshot().state == "running" and not self._paused_or_pausing() \
            and self.send("pause", quiet=True)

        def chosen(path: str | None) -> None:
            if path is not None:
                self.send("restore", path)
            if paused_here:
                self.send("resume", quiet=True)

        self.push_screen(RestoreDialog(found, Path(run_dir) if run_dir else None), chosen)

    def action_toggle_pause(self) -> None:
        if self.source.mode == "replay":   # the same key plays/pauses a recording
            if self.playback is not None:
                self.playback.toggle()
                self.refresh_view_soon()
            return
        self.send("resume" if self._paused_or_pausing() else "pause")

    def _paused_or_pausing(self) -> bool:
        """The run is paused, or will be: the last pause or resume queued decides, else its state."""
        pending = [c.action for c in self._pending if c.action in ("pause", "resume")]
        if pending:
            return pending[-1] == "pause"
        return self.source.snapshot().state == "paused"

    def action_single_step(self) -> None:
        self.send("step")

    def action_toggle_probes(self) -> None:
        pending = self._pending_value("probe")
        every = pending == "every" if pending is not None else probing_every_step(self.source.snapshot())
        self.send("probe", "auto" if every else "every")

    def action_add_note(self) -> None:
        def chosen(text: str | None) -> None:
            if text is not None:
                self.send("note", text)

        self.push_screen(NoteDialog(), chosen)

    def action_apply_fix(self) -> None:
        if self.source.mode != "replay":
            self.send("fix")   # the run chooses its last verified fix, or refuses and records why
            return
        event = last_verified_fix(self.source.snapshot().events)
        if event is None:
            self.notify(NO_FIX, title="fix", severity="warning", markup=False)
        else:
            self.notify(visible(f"a recording can't be steered: run again with {event['fix']}"),
                        title="fix", severity="warning", markup=False)

    def action_undo_autopilot(self) -> None:
        if self.source.mode == "replay":
            self.notify("a recording can't be steered: u undoes the autopilot's last decision in a live run "
                        "(or amp-tui ctl RUN undo)", title="undo autopilot", severity="warning", markup=False)
        else:
            self.send("undo")

    def action_xray(self) -> None:
        if self.source.mode == "replay":
            self.notify("a recording can't be X-rayed: the X-ray runs a step a second time, which only a "
                        "live amp-tui train can (x there, or amp-tui ctl RUN xray)", title="X-ray",
                        severity="warning", markup=False)
        else:
            self.send("xray")

    def action_fp8(self) -> None:
        if self.source.mode == "replay":
            self.notify("a recording can't be cast to fp8: the what-if runs a step a second time, which only "
                        "a live run can (8 there, or amp-tui ctl RUN fp8)", title="fp8 what-if",
                        severity="warning", markup=False)
        else:
            self.send("fp8")
