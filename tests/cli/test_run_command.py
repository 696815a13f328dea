"""`amp-tui run -- COMMAND`, headless: the child's monitor records where amp-tui says, its output is
kept, and the exit status says what happened (no monitor, a crash at step k, a kill -9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from amp_tui.cli import main
from amp_tui.recording.reader import read_session

from support import OWN_LOOP_SCRIPT, step_count, wait_for


def run_command(tmp_path, *command: str, env=None, run_dir=None):
    run_dir = run_dir or tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "amp_tui", "run", "--headless", "--run-dir", str(run_dir),
                           "--", *command], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**os.environ, **(env or {})})
    return done, run_dir


def test_the_command_records_to_the_run_dir_and_its_output_is_kept(write_script, tmp_path):
    script = write_script(OWN_LOOP_SCRIPT, "loop.py")
    done, run_dir = run_command(tmp_path, sys.executable, str(script), env={"STEPS": "30"})
    assert done.returncode == 0, done.stderr
    session = read_session(run_dir)
    assert len(session.steps) == 30 and session.end["status"] == "finished"
    output = (run_dir / "output.log").read_text()
    assert "own loop: step 20" in output and "own loop: step 20" in done.stdout   # kept and shown
    # It ends with the summary `amp-tui train` ends with: the one `report` prints of the run.
    report = subprocess.run([sys.executable, "-m", "amp_tui", "report", str(run_dir)], capture_output=True,
                            text=True, timeout=240, cwd=tmp_path)
    assert "updates applied" in report.stdout and "run dir" in report.stdout
    assert done.stdout.endswith(report.stdout)


def test_a_command_that_never_starts_a_monitor_exits_2_and_says_so(tmp_path):
    done, run_dir = run_command(tmp_path, sys.executable, "-c", "print('no monitor here')")
    assert done.returncode == 2
    assert "exited without starting a monitor" in done.stderr and "nothing was recorded" in done.stderr
    assert "no monitor here" in (run_dir / "output.log").read_text()
    assert not (run_dir / "session.jsonl").exists()


def test_a_command_that_crashes_at_step_k_keeps_its_session_and_its_traceback(write_script, tmp_path):
    script = write_script(OWN_LOOP_SCRIPT, "loop.py")
    done, run_dir = run_command(tmp_path, sys.executable, str(script), env={"CRASH_AT": "7"})
    assert done.returncode == 1
    assert "exited with status 1" in done.stderr and "the session and the checkpoints are kept" in done.stderr
    assert "RuntimeError: bad batch 7" in (run_dir / "output.log").read_text()
    session = read_session(run_dir)
    assert [r["step"] for r in session.steps] == list(range(7))
    errors = [e for e in session.events if e["kind"] == "error"]
    assert errors and "bad batch 7" in errors[0]["message"] and "Traceback" in errors[0]["traceback"]
    assert session.end is not None and session.end["status"] == "error"


def test_a_command_killed_with_kill_9_reads_back_and_lists_as_crashed(write_script, tmp_path, capsys):
    script = write_script(OWN_LOOP_SCRIPT, "loop.py")
    run_dir = tmp_path / "runs" / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "amp_tui", "run", "--headless", "--run-dir", str(run_dir),
                             "--", sys.executable, str(script)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert wait_for(lambda: step_count(run_dir / "session.jsonl") >= 3), "the loop never got going"
        child = int(read_session(run_dir).header["pid"])
        os.kill(child, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "runs")]) == 0
    assert "crashed" in capsys.readouterr().out
    assert main(["report", str(run_dir)]) == 0
    assert "incomplete" in capsys.readouterr().out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_to_amp_tui_run_reaches_the_loop_as_a_stop_with_a_checkpoint(write_script, tmp_path, sig):
    script = write_script(OWN_LOOP_SCRIPT, "loop.py")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "amp_tui", "run", "--headless", "--run-dir", str(run_dir),
                             "--", sys.executable, str(script)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert wait_for(lambda: step_count(run_dir / "session.jsonl") >= 3), "the loop never got going"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    session = read_session(run_dir)
    assert session.end["status"] == "stopped"
    assert [e["reason"] for e in session.events if e["kind"] == "stopping"] == [sig.name]
    saved = [e for e in session.events if e["kind"] == "checkpoint_saved"]
    assert saved and saved[0]["source"] == sig.name


def test_no_command_is_a_usage_error(capsys):
    assert main(["run", "--headless"]) == 2
    assert "give the command after --" in capsys.readouterr().err
