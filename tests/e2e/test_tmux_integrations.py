"""End to end: `amp-tui run -- python train_hf.py` in a real terminal (tmux). The script is a plain
Hugging Face Trainer with AmpTuiCallback; the dashboard appears on it, c saves a checkpoint at a
step boundary, and q stops the Trainer, which ends its loop with its own end hooks."""

from __future__ import annotations

import shlex
import sys

from amp_tui.recording.reader import read_session

from frameworks import HF_SCRIPT
from test_tmux_e2e import Terminal, pytestmark, wait_for  # noqa: F401 - skip if no tmux
from test_tmux_run import interventions


def test_run_on_a_trainer_script_shows_the_dashboard_c_saves_and_q_stops_it(write_script, tmp_path):
    script = write_script(HF_SCRIPT, "train_hf.py")
    run_dir, status = tmp_path / "run", tmp_path / "status"
    command = (f"cd {shlex.quote(str(tmp_path))} && {shlex.quote(sys.executable)} -m amp_tui run "
               f"--run-dir {shlex.quote(str(run_dir))} -- {shlex.quote(sys.executable)} "
               f"{shlex.quote(str(script))}; echo $? > {shlex.quote(str(status))}")
    terminal = Terminal("amp-tui-hf")
    terminal.start(f"sh -c {shlex.quote(command)}")
    try:
        wait_for(terminal, lambda: "RUNNING" in terminal.screen() and "amp-tui run" in terminal.screen(),
                 "the dashboard on the running Trainer", timeout=120)
        terminal.press("c")
        wait_for(terminal, lambda: interventions(run_dir)[-1:] == ["save"], "the Trainer to record the save")
        terminal.press("q")
        wait_for(terminal, status.exists, "amp-tui run to exit", timeout=90)
        assert status.read_text().strip() == "0"
    finally:
        terminal.close()
    session = read_session(run_dir)
    assert interventions(run_dir) == ["save", "stop"]
    saved = [e for e in session.events if e["kind"] == "checkpoint_saved"]
    assert saved and (run_dir / saved[0]["path"]).exists()
    assert session.end["status"] == "stopped"
    # the Trainer ended its loop itself: train() returned and the script went on to its last line
    assert f"hf script: trained {len(session.steps)} steps" in (run_dir / "output.log").read_text()
