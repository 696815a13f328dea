"""The probe schedule's changes of mode as `probes` events, for either driver
(training/probe_schedule.py says when they happen)."""

from __future__ import annotations

from typing import Any

# The run controller (job/controller.py): named, not imported.
RunController = Any


def escalate_probes(run: RunController, reason: str, why: str) -> None:
    """Every step probed from the next one on (the adaptive schedule), said at once."""
    schedule = getattr(run.training, "probe_schedule", None)
    if schedule is not None:
        schedule.escalate(reason, why)
        announce_probe_changes(run)


def announce_probe_changes(run: RunController, *, step: int | None = None) -> None:
    """Record the schedule's changes; `step`: the first step they apply to (default: the next
    step the run starts)."""
    schedule = getattr(run.training, "probe_schedule", None)
    if schedule is None:
        return
    for change in schedule.drain():
        run.event("probes", change.message, step=step, mode=change.mode, reason=change.reason)

