"""The dashboard on a command `amp-tui run` started, before and without a monitor: it says it is
waiting, shows the command's output behind `o`, and when the command ends without a monitor (or
crashes) says so with the end of its output in the error panel."""

from __future__ import annotations

import subprocess
import sys

from amp_tui.sources.launched import OUTPUT_NAME, LaunchedSource
from amp_tui.ui.app import create_app

from support import run_async, until

SIZE = (120, 40)


def launch(run_dir, code: str) -> tuple[LaunchedSource, subprocess.Popen]:
    command = [sys.executable, "-c", code]
    with open(run_dir / OUTPUT_NAME, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return LaunchedSource(run_dir, process, command), process


def status_text(app) -> str:
    return str(app.dashboard.query_one("#status").render())


def error_text(app) -> str:
    return str(app.dashboard.query_one("#error-text").render())


@run_async
async def test_waiting_then_exited_without_a_monitor(tmp_path):
    go = tmp_path / "go"
    # The command prints, then waits for the test's signal to exit: the waiting notice is seen
    # whatever the machine's speed.
    code = (f"import pathlib, time\nprint('loading the data', flush=True)\n"
            f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n")
    source, process = launch(tmp_path, code)
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "waiting for" in status_text(app), "the waiting notice")
            assert "amp_tui.monitor" in status_text(app)
            await until(pilot, lambda: "loading the data" in source.output_tail(), "the command's output")
            await pilot.press("o")
            await until(pilot, lambda: "loading the data" in str(app.screen.query_one("#output-text").render()),
                        "the output screen")
            await pilot.press("escape")
            go.touch()
            await until(pilot, lambda: "without starting a monitor" in status_text(app), "the exit notice")
            assert "exited with status 0" in status_text(app)
            assert not app.dashboard.error_panel.has_class("-visible")   # status 0 is no crash
    finally:
        process.kill()
        process.wait()


@run_async
async def test_a_crash_before_any_monitor_shows_its_traceback(tmp_path):
    source, process = launch(tmp_path, "def load():\n    return 1 / 0\nload()\n")
    process.wait(30)
    app = create_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "ZeroDivisionError" in error_text(app), "the traceback in the error panel")
        assert "exited with status 1" in error_text(app)
        assert "return 1 / 0" in error_text(app)
        assert app.dashboard.error_panel.has_class("-visible")
        assert "without starting a monitor" in status_text(app)
