"""End to end: `amp-tui run -- python loop.py` in a real terminal (tmux). The loop is the user's
own, with amp_tui.monitor; the dashboard appears, d, s, c and space act on it at step boundaries,
q stops it, and its output is in output.log."""

from __future__ import annotations

import shlex
import sys

from amp_tui.recording.format import SessionFormatError
from amp_tui.recording.reader import read_session

from support import OWN_LOOP_SCRIPT
from test_tmux_e2e import Terminal, pytestmark, wait_for  # noqa: F401 - skip if no tmux


def interventions(run_dir) -> list[str]:
    try:
        return [e["action"] for e in read_session(run_dir).events if e["kind"] == "intervention"]
    except (SessionFormatError, OSError):
        return []


def test_run_shows_the_dashboard_keys_act_and_q_stops_the_loop(write_script, tmp_path):
    script = write_script(OWN_LOOP_SCRIPT, "loop.py")
    run_dir, status = tmp_path / "run", tmp_path / "status"
    command = (f"cd {shlex.quote(str(tmp_path))} && {shlex.quote(sys.executable)} -m amp_tui run "
               f"--run-dir {shlex.quote(str(run_dir))} -- {shlex.quote(sys.executable)} "
               f"{shlex.quote(str(script))}; echo $? > {shlex.quote(str(status))}")
    terminal = Terminal("amp-tui-run")
    terminal.start(f"sh -c {shlex.quote(command)}")
    try:
        wait_for(terminal, lambda: "RUNNING" in terminal.screen() and "amp-tui run" in terminal.screen(),
                 "the dashboard on the running loop", timeout=90)
        for key, action in (("d", "dtype"), ("s", "scale"), ("c", "save"), ("Space", "pause")):
            count = len(interventions(run_dir))
            terminal.press(key)
            wait_for(terminal, lambda count=count: len(interventions(run_dir)) > count,
                     f"the loop to record {action}")
            assert interventions(run_dir)[-1] == action
        wait_for(terminal, lambda: "PAUSED" in terminal.screen(), "the paused badge")
        terminal.press("o")
        wait_for(terminal, lambda: "output:" in terminal.screen() and "own loop: step" in terminal.screen(),
                 "the loop's output")
        terminal.press("Escape")
        wait_for(terminal, lambda: "output:" not in terminal.screen(), "the output to close")
        terminal.press("q")
        wait_for(terminal, status.exists, "amp-tui run to exit", timeout=60)
        assert status.read_text().strip() == "0"
    finally:
        terminal.close()
    session = read_session(run_dir)
    assert session.end is not None and session.end["status"] == "stopped"
    assert interventions(run_dir) == ["dtype", "scale", "save", "pause", "stop"]
    assert [e["kind"] for e in session.events if e["kind"] == "checkpoint_saved"]
    assert "own loop: step 0" in (run_dir / "output.log").read_text()
