"""A command `amp-tui run` started, as a `Source`: the job it becomes once its loop starts a
monitor (then shown as `amp-tui attach` shows a job), and what is known of it before and after.

Until the command's monitor opens its session, the dashboard says it is waiting and shows the
command's output; if the command exits without ever starting a monitor, or crashes, the snapshot
says so and carries the end of its output (a traceback) as the error. `q` stops the job at a step
boundary and waits for the command to exit, unless the dashboard only detaches (`--detach`).
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import time
from pathlib import Path

from amp_tui.core.commands import Command
from amp_tui.job.steering import control
from amp_tui.recording.format import SessionFormatError
from amp_tui.sources.attached import AttachedSource
from amp_tui.sources.buffer import RunBuffer
from amp_tui.sources.protocol import Snapshot
from amp_tui.sources.replay import run_checkpoints

OUTPUT_NAME = "output.log"
TAIL_BYTES = 64 * 1024          # of the output, shown as an error when the command fails
STOP_POLL_S = 0.1


class LaunchedSource:
    can_steer = True
    playback = None

    def __init__(self, run_dir: Path, process: subprocess.Popen, command: list[str], *,
                 detaches: bool = False):
        self.run_dir = Path(run_dir)
        self.session_path = self.run_dir / "session.jsonl"
        self.output_path = self.run_dir / OUTPUT_NAME
        self.process = process
        self.command = list(command)
        self.detaches = detaches
        self.mode = "attached" if detaches else "launched"   # q leaves it running, or stops it
        self._attached: AttachedSource | None = None
        self._waiting = RunBuffer(self.mode)
        self._started = False

    # ---- the Source protocol ----------------------------------------------------------------
    def start(self) -> None:
        self._started = True
        self._follow_when_ready()

    def _follow_when_ready(self) -> AttachedSource | None:
        if self._attached is None and self.session_path.is_file():
            try:
                self._attached = AttachedSource(self.run_dir)
            except (OSError, SessionFormatError):
                return None   # its header isn't whole yet: next time
            if self._started:
                self._attached.start()
        return self._attached

    def snapshot(self) -> Snapshot:
        attached = self._follow_when_ready()
        snap = (dataclasses.replace(attached.snapshot(), mode=self.mode) if attached is not None
                else self._waiting.snapshot())
        exited = self.process.poll()
        command = shlex.join(self.command)
        if attached is None:
            if exited is None:
                notice = f"waiting for `{command}` to start a monitor (amp_tui.monitor); its output: o"
            else:
                notice = (f"`{command}` exited with status {exited} without starting a monitor "
                          "(amp_tui.monitor): nothing was recorded. Its output: o; q quits")
            return dataclasses.replace(snap, notice=notice, error=self._crash(exited),
                                       version=self._version(snap, exited))
        if exited is not None and exited != 0 and snap.error is None:
            # Crashed outside a monitored step (the recording has no error of its own).
            return dataclasses.replace(snap, error=self._crash(exited), state="error",
                                       version=self._version(snap, exited))
        return dataclasses.replace(snap, version=self._version(snap, exited))

    @staticmethod
    def _version(snap: Snapshot, exited: int | None) -> int:
        """The snapshot's version, and whether the command has exited: either change redraws."""
        return snap.version * 2 + (exited is not None)

    def _crash(self, status: int | None) -> dict | None:
        if status is None or status == 0:
            return None
        return {"type": "event", "step": None, "kind": "error", "during": "step",
                "message": f"`{shlex.join(self.command)}` exited with status {status}",
                "traceback": self.output_tail()}

    def output_tail(self) -> str:
        try:
            with open(self.output_path, "rb") as fh:
                fh.seek(0, 2)
                size = fh.tell()
                fh.seek(max(0, size - TAIL_BYTES))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def send(self, command: Command) -> tuple[bool, str]:
        attached = self._follow_when_ready()
        if attached is None:
            return False, f"{command.text()} not sent: the command hasn't started a monitor yet"
        return attached.send(command)

    def checkpoints(self) -> list:
        return run_checkpoints(self.run_dir)

    def held_stop(self) -> str | None:
        return None

    def stop(self, timeout: float = 10.0, *, give_up_unwritten: bool = False) -> bool:
        """Detaching: leave the job running. Otherwise stop it at its next step boundary (over its
        control socket; a command with no monitor yet gets SIGTERM) and wait until it exits."""
        if self._attached is not None:
            self._attached.stop(timeout)
        if self.detaches or self.process.poll() is not None:
            return True
        if control.job_alive(self.run_dir):
            try:
                control.send(self.run_dir, "stop", timeout=timeout)
            except control.ControlError:
                pass   # it ended meanwhile, or doesn't answer: the wait below tells
        else:
            self.process.terminate()
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(STOP_POLL_S)
        return True

    def close(self) -> None:
        """Stop following the recording (the command is left as it is)."""
        if self._attached is not None:
            self._attached.stop()

    def job_alive(self) -> bool:
        return self.process.poll() is None
