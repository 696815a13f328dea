"""The dashboard under faults: its terminal gone (with or without SIGHUP), Ctrl+C once and twice.

The terminal tests run the real `amp-tui train` on a pseudo-terminal. Closing the other side sends
no SIGHUP here: the child is in a session of its own that the pseudo-terminal does not control, so
its input just reaches end of file (which Textual itself ignores, spinning on empty reads).
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from amp_tui.recording.format import SessionFormatError
from amp_tui.recording.reader import read_session
from amp_tui.ui.app import create_app
from amp_tui.ui.dialogs.scale_dialog import ScaleDialog
from amp_tui.ui.hangup import INPUT_CLOSED
from amp_tui.ui.screens.help_screen import HelpScreen

from fixed_source import FixedSource, synthetic_records
from support import HELD_SCRIPT, REPO, SIZE, FullDisk, build_live, notified, restorable, run_async, toasts, until

SCRIPT = REPO / "demos" / "healthy.py"
EXIT_BOUND_S = 15.0
# q (and Ctrl+C, SIGINT) waits up to STOP_TIMEOUT_S for the step, then forces the exit; a hang is
# what this bound catches, not a slow machine's shutdown.
QUIT_BOUND_S = 40.0



# ---- standard input at end of file, no SIGHUP ----------------------------------------------------

def step_records(run_dir: Path) -> int:
    try:
        return len(read_session(run_dir).steps)
    except (SessionFormatError, OSError):
        return 0




def session_members(sid: int) -> list[int]:
    """Processes still in session `sid` (the child's own: it and anything it started)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) "
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry))
    return found


class Drain(threading.Thread):
    """Reads the terminal's output so the app never blocks on a full pseudo-terminal."""

    def __init__(self, fd: int):
        super().__init__(daemon=True)
        self.fd = fd
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    if not os.read(self.fd, 65536):
                        return
                except OSError:
                    return

    def stop(self) -> None:
        self.done.set()
        self.join(5)


def dashboard_on_a_pty(run_dir: Path) -> tuple[subprocess.Popen, int, Drain]:
    """The real `amp-tui train` on the demo, on a pseudo-terminal of its own (its own session:
    closing our side sends it no signal), once it has recorded a few steps: (process, our side of
    the terminal, the thread draining its output)."""
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT.relative_to(REPO)} is not there yet")
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "amp_tui", "train", str(SCRIPT),
                             "--run-dir", str(run_dir), "--device", "cpu"],
                            stdin=slave, stdout=slave, stderr=slave, cwd=REPO,
                            start_new_session=True)
    os.close(slave)
    drain = Drain(master)
    drain.start()
    deadline = time.monotonic() + 90
    try:
        while step_records(run_dir) < 3:
            assert proc.poll() is None, f"amp-tui exited early with status {proc.returncode}"
            assert time.monotonic() < deadline, "the dashboard never got a run going"
            time.sleep(0.1)
    except BaseException:
        drain.stop()
        os.close(master)
        proc.kill()
        proc.wait()
        raise
    return proc, master, drain


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, needs a Linux pty")
@pytest.mark.parametrize("fault", ["end of file", "SIGHUP"])
def test_the_terminal_gone_stops_at_a_step_boundary_checkpoints_flushes_and_exits(fault, tmp_path):
    """The terminal closes with no signal (its input at end of file), or SIGHUP arrives."""
    run_dir = tmp_path / "run"
    proc, master, drain = dashboard_on_a_pty(run_dir)
    try:
        if fault == "SIGHUP":
            proc.send_signal(signal.SIGHUP)
        else:
            drain.stop()
            os.close(master)      # the terminal is gone; no signal is sent
            master = None
        closed = time.monotonic()
        try:
            status = proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"amp-tui still running {EXIT_BOUND_S:g} s after {fault}")
        assert time.monotonic() - closed < EXIT_BOUND_S
    finally:
        if master is not None:
            drain.stop()
            os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # 0: the UI got out by itself; 129: it was stuck on the dead terminal and was ended as a
    # hang-up would be. Either way nothing was lost:
    assert status in (0, 129)
    assert session_members(proc.pid) == []
    session = read_session(run_dir)
    assert session.end is not None and session.end["status"] == "stopped"
    assert session.skipped_lines == 0
    reason = INPUT_CLOSED if fault == "end of file" else fault
    stopping = [e for e in session.events if e["kind"] == "stopping"]
    assert [e["reason"] for e in stopping] == [reason]   # end of file: no SIGHUP came
    saved = [e for e in session.events if e["kind"] == "checkpoint_saved"]
    assert saved and saved[-1]["source"] == reason
    assert restorable(run_dir / saved[-1]["path"], SCRIPT).step == saved[-1]["checkpoint_step"]


# ---- Ctrl+C is q: once stops cleanly, twice forces ------------------------------------------------

@run_async
async def test_ctrl_c_stops_at_a_step_boundary_flushes_and_exits_like_q(mlp_script, tmp_path):
    run, source = build_live(mlp_script, tmp_path / "run")
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: run.step > 2, "some steps")
        await pilot.press("ctrl+c")
        assert "stopping at the next step boundary" in toasts(app)
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert not source.alive and not app.forced_exit
    session = read_session(run.session_path)
    assert session.end is not None and session.end["status"] == "stopped"
    assert session.end["step"] == len(session.steps)
    assert not [e for e in session.events if e["kind"] == "checkpoint_saved"]   # as q: none


@run_async
async def test_a_second_ctrl_c_forces_the_exit_while_a_step_hangs(write_script, tmp_path):
    """The second Ctrl+C is shown to force the exit by the app leaving while the step still hangs
    (the first one's wait is far longer than the test's), no longer by a 5-s bound on the time it
    took, which a loaded machine can miss."""
    script = write_script(HELD_SCRIPT)
    run, source = build_live(script, tmp_path / "run", dtype="float32")
    app = create_app(source, stop_timeout=600.0)   # only the second Ctrl+C can end this before the step is let go
    said = notified(app)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: run.step >= 2, "the run to reach the hanging step")
            held_at = run.step
            await pilot.press("ctrl+c")
            await until(pilot, lambda: any("stopping at the next step boundary" in t for t in said),
                        "the stopping message")
            await pilot.press("ctrl+c")
            await until(pilot, lambda: not app.is_running, "the app to exit")
        assert app.forced_exit
        assert run.step == held_at and not script.with_name("release").exists(), "left while the step hung"
    finally:
        script.with_name("release").touch()
        assert source.stop(60.0), "the run stops once the step is let go"
    assert read_session(run.session_path).end["status"] == "stopped"


@pytest.mark.parametrize("opened", ["S", "question_mark"])
@run_async
async def test_ctrl_c_quits_from_a_dialog_or_the_help_too(opened):
    source = FixedSource(synthetic_records())
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        await pilot.press(opened)
        await pilot.pause()
        assert isinstance(app.screen, ScaleDialog if opened == "S" else HelpScreen)
        await pilot.press("ctrl+c")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert source.stopped and source.sent == [] and not app.forced_exit


@pytest.mark.parametrize("mode", ["replay", "attached"])
@run_async
async def test_ctrl_c_leaves_a_replay_or_an_attached_job_as_q_does(mode):
    source = FixedSource(synthetic_records(), mode=mode)
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        assert app.dashboard.active_bindings["ctrl+c"].enabled
        await pilot.press("ctrl+c")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert source.stopped and source.sent == []


# ---- a full disk pauses the dashboard; freeing space and resuming loses nothing -----------------

@run_async
async def test_a_full_disk_pauses_the_dashboard_and_resuming_writes_what_was_kept(mlp_script, tmp_path,
                                                                                 monkeypatch):

    import amp_tui.recording.writer as session_module
    disk = FullDisk()
    monkeypatch.setattr(session_module, "os", disk)
    # No step limit: the run is still going when the refused flush comes, however fast it is.
    run, source = build_live(mlp_script, tmp_path / "run")
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: run.step > 3, "some steps")
        disk.full, disk.room = True, 100      # the disk fills up mid-record
        await until(pilot, lambda: source.snapshot().state == "paused", "the run to pause")
        assert run.controller.pending_records()          # kept, not lost
        await until(pilot, lambda: "could not write" in toasts(app), "the notice")
        assert "No space left on device" in toasts(app)
        await until(pilot, lambda: "free some space" in toasts(app), "the pause notice")
        paused_at = run.step
        await pilot.pause(0.5)
        assert run.step == paused_at and source.alive          # held, not stopped
        disk.full = False                                      # space is freed
        await pilot.press("space")
        await until(pilot, lambda: run.step > paused_at + 3, "the run to go on")
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    session = read_session(run.session_path)
    assert [r["step"] for r in session.steps] == list(range(len(session.steps)))   # none lost
    assert session.skipped_lines == 0                                             # none torn
    assert len(session.steps) > paused_at + 3
    kinds = [(e["kind"], e.get("during") or e.get("reason")) for e in session.events]
    assert ("error", "io") in kinds and ("paused", "io") in kinds
    assert session.end is not None and session.end["status"] in ("stopped", "finished")


@run_async
async def test_a_checkpoint_that_does_not_fit_pauses_the_dashboard_and_keeps_the_previous_one(
        mlp_script, tmp_path, monkeypatch):
    import errno
    real_fsync = os.fsync
    refusing = {"on": True}

    def fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if refusing["on"] and name.startswith(".step-0000004"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    run, source = build_live(mlp_script, tmp_path / "run", steps=400, checkpoint_every=2)
    checkpoints = tmp_path / "run" / "checkpoints"
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: source.snapshot().state == "paused", "the run to pause")
        await until(pilot, lambda: "could not write" in toasts(app), "the notice")
        assert "No space left on device" in toasts(app)
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-0000002.safetensors"]
        assert restorable(checkpoints / "step-0000002.safetensors", mlp_script).step == 2
        refusing["on"] = False
        await pilot.press("space")
        await until(pilot, lambda: (checkpoints / "step-0000006.safetensors").exists(), "the next checkpoint")
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    session = read_session(run.session_path)
    errors = [e for e in session.events if e["kind"] == "error"]
    assert [e["during"] for e in errors] == ["save"] and errors[0]["step"] == 4
    assert [r["step"] for r in session.steps] == list(range(len(session.steps)))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, needs a Linux pty")
def test_sigint_sent_to_the_dashboard_does_what_ctrl_c_does(tmp_path):
    """`kill -INT` (the terminal itself sends Ctrl+C as a key): the app shuts down as for q (a
    step boundary, no checkpoint, the session flushed, the terminal restored, exit 0)."""
    run_dir = tmp_path / "run"
    proc, master, drain = dashboard_on_a_pty(run_dir)
    try:
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=QUIT_BOUND_S)
        restored = termios.tcgetattr(master)[3] & termios.ICANON   # the app left raw mode
    finally:
        drain.stop()
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 0 and restored
    session = read_session(run_dir)
    assert session.end is not None and session.end["status"] == "stopped"
    assert session.end["step"] == len(session.steps) and session.skipped_lines == 0
    assert not [e for e in session.events if e["kind"] == "checkpoint_saved"]   # as q: none


# ---- a full disk at the very end: the last flush counts like every other one ---------------------

LAST_RUN_STEPS = 12


def live_run_filling_the_disk_at_its_end(script, run_dir, monkeypatch):
    """A live run of LAST_RUN_STEPS steps whose disk takes every step record and then fills up:
    the end record, the last one, is refused. Step records are flushed as they come (no flush
    interval), so what is kept back does not depend on how fast the steps run."""

    import amp_tui.recording.writer as session_module
    disk = FullDisk()
    monkeypatch.setattr(session_module, "os", disk)
    run, source = build_live(script, run_dir, steps=LAST_RUN_STEPS, flush_interval=0.0)

    def fill_after_the_last_step(record):
        if record.get("type") == "step" and record["step"] == LAST_RUN_STEPS - 1:
            disk.full, disk.room = True, 7     # the end record goes in part, then ENOSPC
    run.observers.append(fill_after_the_last_step)
    return run, source, disk


def assert_whole(run, status: str):
    session = read_session(run.session_path)
    assert [r["step"] for r in session.steps] == list(range(LAST_RUN_STEPS))
    assert session.skipped_lines == 0
    assert session.end is not None and session.end["status"] == status
    kinds = [(e["kind"], e.get("during") or e.get("reason")) for e in session.events]
    assert ("error", "io") in kinds and ("paused", "io") in kinds   # the file says what happened
    return session


@run_async
async def test_a_full_disk_at_the_end_pauses_and_freeing_space_and_space_writes_the_end(
        mlp_script, tmp_path, monkeypatch):
    run, source, disk = live_run_filling_the_disk_at_its_end(mlp_script, tmp_path / "run", monkeypatch)
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: source.snapshot().state == "paused", "the run to pause")
        await until(pilot, lambda: "could not write" in toasts(app), "the notice")
        assert "No space left on device" in toasts(app)
        await until(pilot, lambda: "free some space" in toasts(app), "the pause notice")
        assert run.step == LAST_RUN_STEPS and source.alive       # trained, held for the disk
        assert run.controller.pending_records().get("end") == 1
        disk.full = False                                        # space is freed
        await pilot.press("space")
        await until(pilot, lambda: not source.alive, "the run to end")
        assert source.snapshot().state == "finished"
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert_whole(run, "finished")
    assert run.unwritten == {} and run.exit_status == 0 and run.error is None


@run_async
async def test_q_on_a_full_disk_says_what_would_be_lost_and_writes_it_once_space_is_freed(
        mlp_script, tmp_path, monkeypatch):
    run, source, disk = live_run_filling_the_disk_at_its_end(mlp_script, tmp_path / "run", monkeypatch)
    app = create_app(source)
    said = notified(app)   # the notices of the full disk come first: the toasts on screen may not show it
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: source.snapshot().state == "paused", "the run to pause")
        await pilot.press("q")
        await until(pilot, lambda: any("would be lost" in m for m in said), "the count of what q would lose")
        lost = next(m for m in said if "would be lost" in m)
        assert "the end record" in lost and "q again" in lost
        assert app.is_running and source.alive                    # nothing quit yet
        disk.full = False                                         # space is freed: q writes it all
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert not source.alive
    assert_whole(run, "finished")
    assert run.unwritten == {}


@run_async
async def test_a_second_q_quits_without_the_records_and_the_summary_and_status_say_so(
        mlp_script, tmp_path, monkeypatch, capsys):
    from amp_tui.cli.train import _finish
    run, source, disk = live_run_filling_the_disk_at_its_end(mlp_script, tmp_path / "run", monkeypatch)
    app = create_app(source)
    said = notified(app)   # the notices of the full disk come first: the toasts on screen may not show it
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: source.snapshot().state == "paused", "the run to pause")
        await pilot.press("q")
        await until(pilot, lambda: any("would be lost" in m for m in said), "the count of what q would lose")
        await pilot.press("q")                                    # the disk is still full
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert not source.alive
    assert run.unwritten.get("end") == 1 and run.exit_status != 0
    session = read_session(run.session_path)
    assert [r["step"] for r in session.steps] == list(range(LAST_RUN_STEPS))
    assert session.end is None and session.skipped_lines == 0    # the cut end record is cut off
    status = _finish(run, [], stopped=True, crashed=False)
    out = capsys.readouterr().out
    assert status != 0
    assert "No space left on device" in out and str(run.session_path) in out
    assert "could not be written" in out and "the end record" in out
    assert "finished (the run, after 12 steps)" in out             # the run, and the file, apart


@run_async
async def test_a_checkpoint_at_the_last_step_that_does_not_fit_pauses_and_is_written_on_resume(
        mlp_script, tmp_path, monkeypatch):
    import errno
    real_fsync = os.fsync
    refusing = {"on": True}

    def fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if refusing["on"] and name.startswith(".step-0000006"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    run, source = build_live(mlp_script, tmp_path / "run", steps=6, checkpoint_every=3)
    checkpoints = tmp_path / "run" / "checkpoints"
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: source.snapshot().state == "paused", "the run to pause")
        await until(pilot, lambda: "No space left on device" in toasts(app), "the notice")
        assert run.step == 6 and source.alive                   # trained, held for the checkpoint
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-0000003.safetensors"]
        refusing["on"] = False
        await pilot.press("space")
        await until(pilot, lambda: not source.alive, "the run to end")
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert restorable(checkpoints / "step-0000006.safetensors", mlp_script).step == 6
    session = read_session(run.session_path)
    assert session.end is not None and session.end["status"] == "finished"
    saved = [e["checkpoint_step"] for e in session.events if e["kind"] == "checkpoint_saved"]
    assert saved == [3, 6]


def test_a_checkpoint_on_a_hang_up_that_does_not_fit_ends_the_run_as_headless_would(
        mlp_script, tmp_path, monkeypatch):
    """Nobody is left to free space (the terminal is gone): a refused checkpoint at the stop
    ends the run with an error status instead of pausing for an answer that can't come."""
    import errno
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".step-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    run, source = build_live(mlp_script, tmp_path / "run")
    stepped = threading.Event()
    run.observers.append(lambda r: r.get("type") == "step" and r["step"] >= 2 and stepped.set())
    source.start()
    assert stepped.wait(60), "the run never got going"
    run.unattended()                                   # what the hang-up guard does first
    run.request_stop(checkpoint=True, reason="SIGHUP")
    assert source.stop(30), "the run did not stop"
    assert run.exit_status == 1
    session = read_session(run.session_path)
    errors = [e for e in session.events if e["kind"] == "error"]
    assert [e["during"] for e in errors] == ["save"] and "No space left" in errors[0]["message"]
    assert session.end is not None and session.end["exit_status"] == 1
