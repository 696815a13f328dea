"""End to end: a headless job in one terminal, the dashboard attached from another (tmux).

Start `amp-tui train --headless` in one pane, `amp-tui attach RUN_DIR` in a second, press `d`,
detach with `q` (the job goes on), attach again, then stop the job with `Q`."""

from __future__ import annotations

import shlex
import sys

from amp_tui.recording.format import SessionFormatError
from amp_tui.recording.reader import read_session

from test_tmux_e2e import SCRIPT, Terminal, pytestmark, wait_for  # noqa: F401 - skip if no tmux


def interventions(run_dir):
    try:
        return [e for e in read_session(run_dir).events if e.get("kind") == "intervention"]
    except (SessionFormatError, OSError):
        return []


def steps(run_dir):
    try:
        return len(read_session(run_dir).steps)
    except (SessionFormatError, OSError):
        return 0


def test_attach_steer_detach_and_attach_again(tmp_path):
    run_dir = tmp_path / "run"
    python = shlex.quote(sys.executable)
    job = Terminal("amp-tui-attach-job")
    viewer = Terminal("amp-tui-attach-view")
    try:
        job.start(f"{python} -m amp_tui train {shlex.quote(str(SCRIPT))} --headless --dtype bf16 "
                  f"--run-dir {shlex.quote(str(run_dir))}; echo JOB_EXIT=$?")
        wait_for(job, lambda: steps(run_dir) >= 3, "the job's first steps", timeout=90)
        attach = f"{python} -m amp_tui attach {shlex.quote(str(run_dir))}; echo VIEW_EXIT=$?"

        viewer.start(attach)
        wait_for(viewer, lambda: "healthy.py" in viewer.screen() and "step" in viewer.screen(),
                 "the attached dashboard", timeout=90)
        viewer.press("d")  # bf16 -> fp32, sent over the control socket
        change = wait_for(viewer, lambda: [e for e in interventions(run_dir) if e["action"] == "dtype"],
                          "the job to apply d")[0]
        assert change["source"].startswith("ctl ") and change["after"]["dtype"] == "float32"
        viewer.press("q")  # detach: the job goes on
        wait_for(viewer, lambda: "VIEW_EXIT=0" in viewer.screen(), "the viewer to detach")
        before = steps(run_dir)
        wait_for(job, lambda: steps(run_dir) > before + 2, "the job to keep running")
        assert "JOB_EXIT" not in job.screen()

        viewer.close()
        viewer = Terminal("amp-tui-attach-view2")
        viewer.start(attach)  # attach again
        wait_for(viewer, lambda: "fp32" in viewer.screen(), "the second attach to show fp32", timeout=90)
        viewer.press("Q")  # stop the job
        wait_for(job, lambda: "JOB_EXIT=0" in job.screen(), "the job to stop cleanly", timeout=60)
        wait_for(viewer, lambda: "VIEW_EXIT=0" in viewer.screen(), "the viewer to exit")
        session = read_session(run_dir)
        assert session.end is not None and session.end["status"] == "stopped"
        assert [e["action"] for e in interventions(run_dir)] == ["dtype", "stop"]
    finally:
        job.close()
        viewer.close()
