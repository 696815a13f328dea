"""Attach the dashboard to a job running elsewhere (a headless `amp-tui train`, another terminal).

What is shown comes from following the job's recording (session.jsonl), so interventions made by
any client (ctl from a shell, another attached dashboard) appear in the event log. Commands go to
the job over its control socket (see amp_tui.job.steering.control), which is owner-only. Detaching (`stop()`)
closes only the follower: the job keeps running.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from amp_tui.core.commands import Command, Outcome
from amp_tui.job.steering import control
from amp_tui.sources.replay import ReplaySnapshot, ReplaySource, run_checkpoints

FOLLOW_SPEED = ReplaySource.SPEEDS[-1]   # catch up with the job as fast as playback goes


class AttachedSource:
    """A `Source` for a running job: figures from the recording, commands over the socket."""

    mode = "attached"
    can_steer = True
    detaches = True   # q leaves the job running
    playback = None   # it follows the job: no seeking

    def __init__(self, run_dir: str | Path, *, refresh_interval: float = 0.25):
        self.run_dir = Path(run_dir)
        self.replay = ReplaySource(self.run_dir, follow=True, speed=FOLLOW_SPEED,
                                   refresh_interval=refresh_interval)
        self.session_path = self.replay.session_path
        self._threads: list[threading.Thread] = []

    @property
    def output_path(self) -> Path | None:
        """The job's output where amp-tui kept it: `amp-tui run`'s output.log, `train --detach`'s
        job.log."""
        for name in ("output.log", "job.log"):
            if (self.run_dir / name).is_file():
                return self.run_dir / name
        return None

    # ---- the Source protocol ----------------------------------------------------------------
    def start(self) -> None:
        self.replay.start()   # follow: at the end, playing (new records are shown as they land)

    def stop(self, timeout: float = 10.0, *, give_up_unwritten: bool = False) -> bool:
        """Detach: close the follower; the job keeps running."""
        self.replay.stop(timeout)
        return True

    def snapshot(self) -> ReplaySnapshot:
        snap = self.replay.snapshot()
        planned = snap.header.get("steps")
        # The recording is followed, not played back: the snapshot is a run's.
        return dataclasses.replace(snap, mode=self.mode, playback_state=None,
                                   total_steps=planned if isinstance(planned, int) else None)

    def send(self, command: Command) -> tuple[bool, str]:
        if not control.job_alive(self.run_dir):
            return False, f"{command.text()} not sent: no job is running in {self.run_dir}"
        thread = threading.Thread(target=self._deliver, args=(command,), daemon=True,
                                  name="amp-tui-attach-send")
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return True, "sent to the job"

    def _deliver(self, command: Command) -> None:
        # control.send blocks until the job applied (or refused) it at its next step boundary.
        try:
            answer = control.send(self.run_dir, command.text())
            outcome = Outcome(bool(answer.get("ok")), str(answer.get("message", "")))
        except control.ControlError as exc:
            outcome = Outcome(False, str(exc))
        except (OSError, ValueError) as exc:
            outcome = Outcome(False, f"{command.text()}: the job's answer was lost ({exc})")
        if command.on_done is not None:
            command.on_done(outcome)

    def held_stop(self) -> str | None:
        return None   # nothing here is recorded: a stop is never held

    def checkpoints(self) -> list:
        return run_checkpoints(self.run_dir)

    def job_alive(self) -> bool:
        return control.job_alive(self.run_dir)


def check_attachable(run_dir: Path) -> str | None:
    """Why `run_dir` can't be attached to (one line), or None."""
    try:
        control.check_socket_permissions(control.socket_path(run_dir))
    except control.ControlError as exc:
        return str(exc)
    if not control.job_alive(run_dir):
        return f"no job is running in {run_dir} (its control socket doesn't answer)"
    if not (Path(run_dir) / "session.jsonl").is_file():
        return f"no session.jsonl in {run_dir}"
    return None
