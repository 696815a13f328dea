"""A headless run that pauses says how to go on, and ctl's refusals speak ctl."""

import os
import queue
import subprocess
import sys
import threading

from amp_tui.cli import main
from amp_tui.recording.reader import read_session

from support import SLOW_SCRIPT, step_count, wait_for


def read_lines_into(stream, lines: "queue.Queue[str]") -> None:
    for line in stream:
        lines.put(line)


def wait_for_line(lines: "queue.Queue[str]", needle: str, timeout: float = 60.0) -> str:
    seen = []
    while True:
        try:
            line = lines.get(timeout=timeout)   # an upper bound for a hang, not a pace
        except queue.Empty:
            raise AssertionError(f"no line with {needle!r} in:\n{''.join(seen)}") from None
        seen.append(line)
        if needle in line:
            return line


def test_a_headless_pause_prints_how_to_resume_and_ctl_continues_it(write_script, tmp_path, capsys):
    script = write_script(SLOW_SCRIPT)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "amp_tui", "train", str(script), "--headless",
                             "--run-dir", str(run_dir), "--at", "2:pause"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines_into, args=(proc.stdout, lines), daemon=True).start()
    try:
        hint = wait_for_line(lines, "paused: continue with")
        assert f"amp-tui ctl {run_dir} resume" in hint and f"amp-tui ctl {run_dir} step" in hint
        session = run_dir / "session.jsonl"
        assert step_count(session) == 2

        assert main(["ctl", str(run_dir), "step"]) == 0       # one step, then paused again
        assert wait_for(lambda: step_count(session) == 3)
        assert main(["ctl", str(run_dir), "resume"]) == 0
        assert wait_for(lambda: step_count(session) >= 5), "resume did not let the run go on"
        capsys.readouterr()

        # running: a single step is refused in ctl's own words, not the dashboard's
        assert main(["ctl", str(run_dir), "step"]) == 1
        answer = capsys.readouterr().out
        assert "press space" not in answer
        assert f"amp-tui ctl {run_dir} pause" in answer, answer
        assert main(["ctl", str(run_dir), "stop"]) == 0
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    actions = [e["action"] for e in read_session(run_dir).events if e["kind"] == "intervention"]
    assert actions == ["pause", "step", "resume", "stop"]

