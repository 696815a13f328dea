"""The probe schedule's changes of mode as `probes` events, for either driver
(training/probes/probe_schedule.py says when they happen)."""

from __future__ import annotations

from amp_tui.job.run_context import RunContext


def escalate_probes(run: RunContext, reason: str, why: str) -> None:
    """Every step probed from the next one on (the adaptive schedule), said at once."""
    run.driver.probe_schedule.escalate(reason, why)
    announce_probe_changes(run)


def announce_probe_changes(run: RunContext, *, step: int | None = None) -> None:
    """Record the schedule's changes; `step`: the first step they apply to (default: the next
    step the run starts)."""
    for change in run.driver.probe_schedule.drain():
        run.event("probes", change.message, step=step, mode=change.mode, reason=change.reason)

