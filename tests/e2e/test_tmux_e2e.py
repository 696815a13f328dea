"""End to end: the real `amp-tui train demos/healthy.py` in a real terminal (tmux), driven by keys.

The app runs in a private tmux server at a fixed 120x40; keys go in with `send-keys`, the screen
comes back with `capture-pane`. Every wait polls (screen text or session file) with a deadline;
nothing relies on a fixed sleep. Skipped where tmux isn't installed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from amp_tui.recording.format import SessionFormatError
from amp_tui.recording.reader import read_session

from support import REPO

SCRIPT = REPO / "demos" / "healthy.py"
TMUX = shutil.which("tmux")

pytestmark = [pytest.mark.skipif(TMUX is None, reason="tmux is not installed"), pytest.mark.slow]


class Terminal:
    """A 120x40 terminal in a private tmux server (named after this process too: test runs side
    by side on one machine never share a server)."""

    def __init__(self, name: str):
        self.server = ["tmux", "-L", f"{name}-{os.getpid()}", "-f", os.devnull]
        self.target = f"{name}:0.0"

    def tmux(self, *args: str) -> str:
        return subprocess.run([*self.server, *args], check=True, capture_output=True,
                              text=True, timeout=10).stdout

    def start(self, command: str) -> None:
        # One tmux command line, so the options hold at once: no client ever attaches, and tmux
        # may otherwise fall back to its 80x24 default size when it recomputes window sizes.
        session = self.target.split(":")[0]
        self.tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", command, ";",
                  "set-option", "-g", "window-size", "manual", ";",
                  "set-option", "-g", "remain-on-exit", "on", ";",   # keep the summary readable
                  "resize-window", "-t", session, "-x", "120", "-y", "40")

    def press(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.target, *keys)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.target)

    def pane_dead(self) -> bool:
        return self.tmux("display-message", "-p", "-t", self.target, "#{pane_dead}").strip() == "1"

    def close(self) -> None:
        subprocess.run([*self.server, "kill-server"], capture_output=True, timeout=10)


def wait_for(terminal: Terminal, predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; the screen:\n"
                                 f"{terminal.screen()}")
        time.sleep(0.1)


def dashboard_events(run_dir: Path) -> list[dict]:
    try:
        events = read_session(run_dir).events
    except (SessionFormatError, OSError):
        return []
    return [e for e in events if e.get("source") == "dashboard"]


def actions(run_dir: Path) -> list[str]:
    """What the keys did, in order: an intervention's action, or "restore"."""
    out = []
    for event in dashboard_events(run_dir):
        if event["kind"] == "intervention":
            out.append(event["action"])
        elif event["kind"] == "checkpoint_restored":
            out.append("restore")
    return out


def start_dashboard(tmp_path, name: str) -> tuple[Terminal, Path, Path]:
    """The real `amp-tui train` on the demo in a tmux pane, running: (terminal, run dir, the file
    that gets its exit status)."""
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT.relative_to(REPO)} is not there yet")
    run_dir = tmp_path / "run"
    status = tmp_path / "status"
    command = (f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -m amp_tui train "
               f"{shlex.quote(str(SCRIPT.relative_to(REPO)))} --run-dir {shlex.quote(str(run_dir))} "
               f"--device cpu; echo $? > {shlex.quote(str(status))}")
    terminal = Terminal(name)
    terminal.start(f"sh -c {shlex.quote(command)}")
    try:
        wait_for(terminal, lambda: "RUNNING" in terminal.screen() and "layers (" in terminal.screen(),
                 "the dashboard to show a running run", timeout=90)
    except BaseException:
        terminal.close()
        raise
    return terminal, run_dir, status


def test_keys_drive_the_real_dashboard_and_q_exits_cleanly(tmp_path):
    terminal, run_dir, status = start_dashboard(tmp_path, "amp-tui-e2e")
    try:

        def key(keys: tuple[str, ...], action: str, shown: str) -> None:
            count = len(actions(run_dir))
            terminal.press(*keys)
            wait_for(terminal, lambda: len(actions(run_dir)) > count,
                     f"the session to record {action}")
            assert actions(run_dir)[-1] == action
            wait_for(terminal, lambda: shown in terminal.screen(), f"{shown!r} on screen")

        key(("d",), "dtype", "dtype fp16 → bf16")
        key(("s",), "scale", "fp16 loss scale")     # bf16 has no scaler: it halves the next fp16 scale
        key(("c",), "save", "checkpoint saved")
        # The picker pauses the run while it is open, and lets it go on once it closes.
        count = len(actions(run_dir))
        terminal.press("r")
        wait_for(terminal, lambda: "Restore a checkpoint" in terminal.screen(), "the picker")
        wait_for(terminal, lambda: actions(run_dir)[count:] == ["pause"], "the picker's pause")
        terminal.press("Enter")
        wait_for(terminal, lambda: actions(run_dir)[count:] == ["pause", "restore", "resume"],
                 "the restore, then the resume")
        wait_for(terminal, lambda: "restored" in terminal.screen(), "'restored' on screen")
        key(("Space",), "pause", "PAUSED")
        terminal.press("q")
        wait_for(terminal, status.exists, "amp-tui to exit", timeout=30)
        assert status.read_text().strip() == "0"
        wait_for(terminal, terminal.pane_dead, "the pane's command to end")
        screen = terminal.screen()
        assert "status" in screen and "stopped" in screen and "interventions" in screen
    finally:
        terminal.close()

    session = read_session(run_dir)
    assert session.end is not None and session.end["status"] == "stopped"
    events = dashboard_events(run_dir)
    by_action = {e.get("action", e["kind"]): e for e in events}
    assert by_action["dtype"]["before"]["dtype"] == "float16"
    assert by_action["dtype"]["after"]["dtype"] == "bfloat16"
    assert by_action["scale"]["value"] == "half"
    assert by_action["save"]["after"]["checkpoint"].endswith(".safetensors")
    assert by_action["checkpoint_restored"]["path"] == by_action["save"]["after"]["checkpoint"]
    assert by_action["pause"]["after"]["state"] == "paused"


def test_ctrl_c_in_the_real_dashboard_stops_cleanly_like_q(tmp_path):
    """The terminal sends Ctrl+C as a byte (the dashboard's raw mode: no SIGINT): it is q."""
    terminal, run_dir, status = start_dashboard(tmp_path, "amp-tui-e2e-ctrl-c")
    try:
        terminal.press("C-c")
        wait_for(terminal, status.exists, "amp-tui to exit", timeout=30)
        assert status.read_text().strip() == "0"
        wait_for(terminal, terminal.pane_dead, "the pane's command to end")
        screen = terminal.screen()
        assert "status" in screen and "stopped" in screen and "Traceback" not in screen
    finally:
        terminal.close()

    session = read_session(run_dir)
    assert session.end is not None and session.end["status"] == "stopped"
    assert session.end["step"] == len(session.steps) and session.skipped_lines == 0
    kinds = {e["kind"] for e in session.events}
    assert "checkpoint_saved" not in kinds and "error" not in kinds   # as q: no extra checkpoint
