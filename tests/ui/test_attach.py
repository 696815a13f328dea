"""Attaching the dashboard to a running job: steering over the control socket, q detaches and
leaves the job running, Q stops it, and interventions from other clients show up."""

from __future__ import annotations

import os

from amp_tui.cli import main
from amp_tui.core.commands import Command
from amp_tui.job.steering.control import job_alive, send
from amp_tui.recording.reader import read_session
from amp_tui.sources.attached import AttachedSource
from amp_tui.ui.app import create_app

from support import SLOW_SCRIPT, run_async, toasts, until, wait_for

SIZE = (120, 40)


def interventions(run) -> list[dict]:
    return [e for e in read_session(run.run_dir).events if e.get("kind") == "intervention"]


@run_async
async def test_keys_steer_the_job_and_q_detaches(live_job):
    run, thread = live_job
    source = AttachedSource(run.run_dir)
    app = create_app(source)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await until(pilot, lambda: "attached" in str(app.dashboard.query_one("#status").render()),
                    "the status bar")
        active = set(app.dashboard.active_bindings)
        assert {"d", "s", "S", "c", "r", "space", "n", "q", "Q"} <= active
        assert not active & {"plus", "minus", "g", "left_square_bracket"}
        await pilot.press("d")
        await until(pilot, lambda: "dtype fp16 → bf16" in toasts(app), "the job's answer")
        done = interventions(run)
        assert done[-1]["action"] == "dtype" and done[-1]["source"].startswith("ctl")
        assert done[-1]["client"]["uid"] == os.getuid()
        # the follower shows it in the event log and the state as the job's
        await until(pilot, lambda: any(e.get("action") == "dtype" for e in source.snapshot().events),
                    "the event in the log")
        assert source.snapshot().state == "running" and source.snapshot().playback_state is None
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert thread.is_alive() and job_alive(run.run_dir) and run.state == "running"


@run_async
async def test_shift_q_stops_the_job(live_job):
    run, thread = live_job
    app = create_app(AttachedSource(run.run_dir))
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        await pilot.press("Q")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    thread.join(20)
    assert not thread.is_alive() and run.state == "stopped"
    assert interventions(run)[-1]["action"] == "stop"


def test_two_attached_dashboards_see_each_others_interventions(live_job):
    run, _ = live_job
    one, two = AttachedSource(run.run_dir, refresh_interval=0.05), AttachedSource(run.run_dir,
                                                                                 refresh_interval=0.05)
    one.start()
    two.start()
    try:
        answers = []
        command = Command("scale", "half", "dashboard")
        command.on_done = answers.append
        assert one.send(command) == (True, "sent to the job")
        assert wait_for(lambda: answers, 20) and answers[0].ok
        assert wait_for(lambda: any(e.get("action") == "scale" and e["source"].startswith("ctl")
                                    for e in two.snapshot().events), 20)
        assert one.checkpoints() == [] and one.session_path == run.session_path
    finally:
        assert one.stop() and two.stop()
    assert job_alive(run.run_dir)   # detaching leaves the job alone


def test_attach_refuses_without_a_job(tmp_path, capsys):
    assert main(["attach", str(tmp_path)]) == 1
    assert "no job is running" in capsys.readouterr().err


def test_send_refuses_when_the_job_is_gone(live_job):
    run, thread = live_job
    source = AttachedSource(run.run_dir)
    assert send(run.run_dir, "stop")["ok"]
    thread.join(20)
    ok, message = source.send(Command("save"))
    assert not ok and "no job is running" in message
    source.stop()


def test_detach_starts_a_background_job(write_script, tmp_path, capsys):
    script = write_script(SLOW_SCRIPT)
    run_dir = tmp_path / "bg"
    # no terminal here: --detach starts the job, waits for its socket and says how to attach
    assert main(["train", str(script), "--detach", "--run-dir", str(run_dir), "--init-scale", "256"]) == 0
    try:
        out = capsys.readouterr().out
        assert f"amp-tui attach {run_dir}" in out and job_alive(run_dir)
        header = read_session(run_dir).header
        assert "--headless" in header["command"] and "--detach" not in header["command"]
    finally:
        send(run_dir, "stop")
    assert wait_for(lambda: not job_alive(run_dir), 20)
    assert (run_dir / "job.log").exists()
