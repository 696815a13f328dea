"""The command handlers that a run of amp-tui's own loop (job/run.py) and a monitor in the user's
loop (job/monitor.py) share: recording an intervention or a refusal, saving a checkpoint, a
module to fp32 and back, pausing. Each host says what differs: how it saves a checkpoint, which
model its module names are of, and what a changed fp32 policy undoes."""

from __future__ import annotations

from amp_tui.core.commands import Command, Outcome
from amp_tui.core.jsonsafe import encode_float
from amp_tui.training.local_fp32 import ModuleMatchError, match_modules


class SharedHandlers:
    """Mixed into Run and Monitor, which give it `event()`, `state`, `_single_steps`,
    `local_fp32`, `checkpointing`, `_save_checkpoint()`, `_fp32_root()` and `_fp32_changed()`."""

    def intervention(self, command: Command, before: dict, after: dict, message: str) -> Outcome:
        """Record what a command changed, in the run's words; the command's answer."""
        who = {"client": command.client} if command.client else {}
        value = encode_float(command.value) if isinstance(command.value, float) else command.value
        self.event("intervention", message, action=command.action, value=value, source=command.source,
                   before=before, after=after, **who)
        return Outcome(True, message)

    def _refused(self, command: Command, message: str) -> Outcome:
        self.event("error", message, during=command.action, source=command.source)
        return Outcome(False, message)

    def _save(self, command: Command) -> Outcome:
        info = self._save_checkpoint(source=command.source)
        if info is None:
            return Outcome(False, "checkpoint not saved (see the error event)")
        path = self.checkpointing.relative(info.path)
        return self.intervention(command, {}, {"checkpoint": path}, f"checkpoint saved: {path}")

    def _toggle_fp32(self, command: Command) -> Outcome:
        pattern = str(command.value)
        before = {"fp32_modules": self.local_fp32.names}
        try:
            already = set(match_modules(self._fp32_root(), pattern)) & set(self.local_fp32.names)
            changed = self.local_fp32.remove(pattern) if already else self.local_fp32.add(pattern)
            if changed:
                self._fp32_changed()
        except ModuleMatchError as exc:
            return self._refused(command, str(exc))
        verb = "back to autocast" if already else "now in fp32"
        return self.intervention(command, before, {"fp32_modules": self.local_fp32.names},
                                 f"{', '.join(changed) or pattern} {verb}")

    def _pause(self, command: Command) -> Outcome:
        before = {"state": self.state}
        self._single_steps = 0
        self.state = "paused"
        return self.intervention(command, before, {"state": self.state}, "paused")
