"""The control channel: ctl from a shell, several clients, owner-only permissions, stale sockets."""

import os
import signal
import socket
import stat
import subprocess
import sys
import threading

import pytest

from amp_tui.cli import main
from amp_tui.job.steering.control import ControlError, check_socket_permissions, send, socket_path
from amp_tui.recording.reader import read_session

from support import SLOW_SCRIPT, wait_for


def test_every_command_over_ctl_is_applied_and_recorded(live_run, capsys):
    run_dir = str(live_run.run_dir)
    for command in ("dtype=bf16", "scale=half", "scale=1024", "save", "restore=latest", "pause", "step",
                    "resume", "fp32=0"):
        assert main(["ctl", run_dir, command]) == 0, command
    out = capsys.readouterr().out
    assert "dtype fp16 → bf16" in out and "checkpoint saved" in out
    assert main(["ctl", run_dir, "status", "--json"]) == 0
    assert '"state": "running"' in capsys.readouterr().out
    assert main(["ctl", run_dir, "dtype=int8"]) == 1
    assert "unknown dtype" in capsys.readouterr().out
    assert main(["ctl", run_dir, "stop"]) == 0
    assert wait_for(lambda: live_run.state == "stopped", 30)
    events = [e for e in read_session(live_run.run_dir).events if e["kind"] == "intervention"]
    assert [e["action"] for e in events] == ["dtype", "scale", "scale", "save", "pause", "step", "resume",
                                             "fp32", "stop"]
    for e in events:
        assert e["source"].startswith("ctl pid=") and e["client"]["uid"] == os.getuid()
    restored = [e for e in read_session(live_run.run_dir).events if e["kind"] == "checkpoint_restored"]
    assert restored and restored[0]["source"].startswith("ctl")


def test_refused_command_exits_non_zero(live_run, capsys):
    assert main(["ctl", str(live_run.run_dir), "restore=/nonexistent.safetensors"]) == 1
    assert "does not exist" in capsys.readouterr().out


def test_two_clients_at_once(live_run):
    answers = []
    threads = [threading.Thread(target=lambda c=c: answers.append(send(live_run.run_dir, c)))
               for c in ("scale=half", "scale=half")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [a["ok"] for a in answers] == [True, True]
    scales = [e for e in read_session(live_run.run_dir).events if e.get("action") == "scale"]
    assert len(scales) == 2 and scales[1]["before"]["scale"] == scales[0]["after"]["scale"]


def test_socket_is_owner_only(live_run):
    path = socket_path(live_run.run_dir)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(live_run.run_dir.stat().st_mode) == 0o700


def test_permission_check_refuses_group_or_other_bits(tmp_path):
    path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    try:
        os.chmod(path, 0o600)
        check_socket_permissions(path)  # ours and private: fine
        os.chmod(path, 0o660)
        with pytest.raises(ControlError, match="accessible to other users"):
            check_socket_permissions(path)
        os.chmod(path, 0o600)
        if os.getuid() == 0:
            os.chown(path, 12345, -1)
            with pytest.raises(ControlError, match="belongs to uid 12345"):
                check_socket_permissions(path)
    finally:
        sock.close()
    with pytest.raises(ControlError, match="no job is running"):
        check_socket_permissions(tmp_path / "missing.sock")


def test_killed_job_gives_a_clear_error_and_its_stale_socket_is_cleaned(write_script, tmp_path, capsys):
    script = write_script(SLOW_SCRIPT)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "amp_tui", "train", str(script), "--headless",
                             "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: socket_path(run_dir).exists(), 60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    assert socket_path(run_dir).exists(), "kill -9 leaves the socket behind"
    assert main(["ctl", str(run_dir), "status"]) == 1
    err = capsys.readouterr().err
    assert "not running any more" in err and "stale" in err
    assert not socket_path(run_dir).exists()
    assert main(["ls", str(tmp_path)]) == 0
    assert "crashed" in capsys.readouterr().out


def test_status_says_how_the_run_probes(live_run, capsys):
    run_dir = str(live_run.run_dir)
    assert main(["ctl", run_dir, "status", "--json"]) == 0
    assert '"probes": [\n      "auto"' in capsys.readouterr().out   # the default schedule
    assert main(["ctl", run_dir, "probe=every"]) == 0
    capsys.readouterr()
    assert main(["ctl", run_dir, "status"]) == 0
    assert "probes every step (asked for)" in capsys.readouterr().out
    assert main(["ctl", run_dir, "probe=auto"]) == 0
    capsys.readouterr()
    assert main(["ctl", run_dir, "status"]) == 0
    assert ", probes auto 1/" in capsys.readouterr().out
