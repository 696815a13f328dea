"""What the `fix` command (the key `f`, `ctl RUN fix`) applies: the run's last verified fix.

It chooses from the newest non-finite event whose fix was verified on its step, and the
autopilot's interventions after it (which may have applied that fix already); and it remembers the
step whose fix it applied last, so that a second `fix` for the same event is refused, not repeated.
"""

from __future__ import annotations

from typing import Callable

from amp_tui.core.commands import Command, Outcome
from amp_tui.core.fixes import fix_to_apply, last_verified_fix


class VerifiedFixes:
    """The events `fix` chooses from, fed with every event the run records (`seen`)."""

    def __init__(self, refused: Callable[[Command, str], Outcome]):
        self._refused = refused   # records a refusal and answers it (RunController.refused)
        self._events: list[dict] = []
        self._fixed_step: int | None = None

    def seen(self, record: dict) -> None:
        kind = record.get("kind")
        if kind == "nonfinite" and last_verified_fix([record]) is not None:
            self._events = [record]
        elif kind == "intervention" and record.get("source") == "autopilot" and self._events:
            self._events.append(record)

    def choose(self, command: Command) -> Command | Outcome:
        """The command that applies the run's last verified fix, or its refusal (recorded)."""
        choice = fix_to_apply(self._events, self._fixed_step, command.source)
        if isinstance(choice, str):
            return self._refused(command, choice)
        self._fixed_step = self._events[0].get("step")
        choice.client, choice.on_done = command.client, command.on_done
        return choice

    def chosen(self, commands: list[Command]) -> list[Command]:
        """Rank 0's `fix` as the command it chose (or refused here), so that every rank applies the
        same change whatever its own events hold."""
        out = []
        for command in commands:
            if command.action != "fix":
                out.append(command)
                continue
            choice = self.choose(command)
            if isinstance(choice, Outcome):
                if command.on_done is not None:
                    command.on_done(choice)
            else:
                out.append(choice)
        return out
