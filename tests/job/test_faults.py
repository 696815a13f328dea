"""Nothing lost under faults: signals, a crash and --resume, a full disk."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from amp_tui.cli import main
from amp_tui.recording.reader import read_session
from amp_tui.recording.writer import SessionWriter

from support import SLOW_SCRIPT, FullDisk, step_count, train_run, wait_for


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_stops_at_a_step_boundary_and_keeps_everything(signum, write_script, tmp_path):
    script = write_script(SLOW_SCRIPT)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "amp_tui", "train", str(script), "--headless",
                             "--run-dir", str(run_dir), "--init-scale", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    session = run_dir / "session.jsonl"
    assert wait_for(lambda: step_count(session) >= 3), "the run never got going"
    sent = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    s = read_session(run_dir)
    assert s.end is not None and s.end["status"] == "stopped"
    stopping = [e for e in s.events if e["kind"] == "stopping"]
    assert stopping and (signal.Signals(signum).name in stopping[0]["message"] or signum == signal.SIGINT)
    saved = [e for e in s.events if e["kind"] == "checkpoint_saved"]
    if signum == signal.SIGINT:
        assert not saved  # Ctrl+C is q: stop cleanly, no extra checkpoint
    else:
        assert saved and saved[0]["source"] == signal.Signals(signum).name
        assert (run_dir / saved[0]["path"]).exists()


def test_resume_after_a_crash_continues_from_the_newest_valid_checkpoint(mlp_script, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", str(mlp_script), "--headless", "--steps", "7", "--run-dir", str(run_dir),
                 "--checkpoint-every", "3"]) == 0
    # a crash: the end record never written, a torn last line, a half-written newest checkpoint
    lines = (run_dir / "session.jsonl").read_text().splitlines()
    (run_dir / "session.jsonl").write_text("\n".join(lines[:-1]) + '\n{"type":"step","st')
    newest = run_dir / "checkpoints" / "step-0000006.safetensors"
    newest.write_bytes(newest.read_bytes()[:200])
    (run_dir / "checkpoints" / ".step-0000009.safetensors.tmp-999999-1").write_bytes(b"partial")
    capsys.readouterr()
    # --steps counts this command's iterations: 3 more after the recording's last step (6)
    assert main(["train", str(mlp_script), "--headless", "--steps", "3", "--resume", str(run_dir)]) == 0
    s = read_session(run_dir)
    resumed = [e for e in s.events if e["kind"] == "resumed"]
    assert len(resumed) == 1
    assert resumed[0]["checkpoint_step"] == 3 and resumed[0]["previous_last_step"] == 6
    assert [r["step"] for r in s.steps] == list(range(10))
    assert s.skipped_lines == 1  # the torn line, nothing else
    assert not (run_dir / "checkpoints" / ".step-0000009.safetensors.tmp-999999-1").exists()
    assert s.end["status"] == "finished"


def test_resume_without_a_valid_checkpoint_exits_2(mlp_script, tmp_path, capsys):
    run_dir = tmp_path / "run"
    main(["train", str(mlp_script), "--headless", "--steps", "2", "--run-dir", str(run_dir)])
    capsys.readouterr()
    assert main(["train", str(mlp_script), "--headless", "--resume", str(run_dir)]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err


def test_full_disk_on_the_session_stops_headless_with_an_error(mlp_script, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run = train_run(mlp_script, run_dir, steps=50, checkpoint_every=2)
    real_write = SessionWriter.write

    def failing_write(self, record):
        if record.get("type") == "step" and record["step"] >= 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, record)
    monkeypatch.setattr(SessionWriter, "write", failing_write)
    seen = []
    run.observers.append(seen.append)
    assert run.run() == 1
    errors = [r for r in seen if r.get("kind") == "error"]
    assert errors and "No space left on device" in errors[0]["message"] and errors[0]["during"] == "io"
    assert run.step < 50
    s = read_session(run_dir)
    assert [r["step"] for r in s.steps] == [0, 1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "step-0000004.safetensors").exists()


def test_full_disk_on_a_checkpoint_keeps_the_previous_one(mlp_script, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run = train_run(mlp_script, run_dir, steps=50, checkpoint_every=2)
    real_fsync = os.fsync

    def failing_fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".step-0000004"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", failing_fsync)
    good = run_dir / "checkpoints" / "step-0000002.safetensors"
    assert run.run() == 1
    s = read_session(run_dir)
    err = [e for e in s.events if e["kind"] == "error"][0]
    assert err["during"] == "save" and "No space left on device" in err["message"]
    assert good.exists() and s.end["status"] == "stopped" and s.end["step"] == 4
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000002.safetensors"]


def test_a_run_that_fits_the_disk_until_its_last_record_exits_1_and_says_so(
        mlp_script, tmp_path, monkeypatch, capsys):
    """Every step record reaches the file; the end record, the last one, does not: headless
    names the full disk and the file, counts what was lost, and exits 1 (it exited 0)."""

    import amp_tui.recording.writer as session_module
    from amp_tui.cli.headless import run_headless
    disk = FullDisk()
    monkeypatch.setattr(session_module, "os", disk)
    run_dir = tmp_path / "run"
    run = train_run(mlp_script, run_dir, steps=8, flush_interval=0.0)   # each step record on disk before the next

    def fill_after_the_last_step(record):
        if record.get("type") == "step" and record["step"] == 7:
            disk.full, disk.room = True, 10  # the end record goes in part, then ENOSPC
    run.observers.append(fill_after_the_last_step)
    capsys.readouterr()
    assert run_headless(run, []) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "No space left on device" in out and str(run.session_path) in out
    assert "the end record could not be written" in out
    assert "finished (the run, after 8 steps)" in out and "steps 8 recorded of 8" in out
    assert run.unwritten == {"end": 1}
    s = read_session(run_dir)
    assert [r["step"] for r in s.steps] == list(range(8))
    assert s.end is None and s.skipped_lines == 0      # the cut end record is cut off again
