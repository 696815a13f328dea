"""`amp-tui run [--run-dir DIR] [--headless] [--detach] -- COMMAND [ARGS...]`: run any command whose
training loop starts `amp_tui.monitor(...)`, and show its dashboard.

The command runs as a child process with AMP_TUI_RUN_DIR naming the run directory its monitor
records to; its stdout and stderr go to RUN_DIR/output.log (the dashboard shows them behind `o`;
headless, they are printed too). The dashboard follows the recording as `amp-tui attach` does and
steers over the control socket; `q` stops the job at a step boundary and waits for it to exit
(`--detach`: `q` leaves it running). SIGHUP or SIGTERM to amp-tui reaches the command as a stop at
its next step boundary. Once the command has exited, amp-tui prints the summary `train` ends with,
and exits with the command's status, or with 2 when the command succeeded without ever starting a
monitor (nothing was recorded).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from amp_tui.cli import argtypes
from amp_tui.cli.terminal import error, interactive
from amp_tui.core.signals import STOP_SIGNALS, handling_signals

NO_MONITOR = 2
OUTPUT_NAME = "output.log"
STOP_WAIT_S = 30.0   # after the dashboard: how long the command gets to finish its step and exit


def add_parser(sub) -> None:
    run = sub.add_parser(
        "run", help="run a command whose own training loop uses amp_tui.monitor, with the dashboard",
        description="Run COMMAND (everything after --) as a child process whose amp_tui.monitor "
                    "records to RUN_DIR, and open the dashboard on it. Its output goes to "
                    "RUN_DIR/output.log (o shows it). q stops the job at a step boundary; with "
                    "--detach, q leaves it running (amp-tui attach RUN_DIR comes back).")
    run.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                     help="where the monitor records (default runs/<time>-<script>)")
    run.add_argument("--headless", action="store_true",
                     help="no dashboard: print the command's output and wait for it")
    run.add_argument("--detach", action="store_true",
                     help="q leaves the job running instead of stopping it")
    run.add_argument("--refresh-rate", type=argtypes.positive, default=20.0, metavar="HZ",
                     help="dashboard refreshes per second at most (default 20)")
    run.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from amp_tui.core.run_dirs import default_run_dir

    command = list(args.script_argv)
    if not command:
        return error("amp-tui run: give the command after --, e.g. amp-tui run -- python train.py --lr 3e-4")
    run_dir = args.run_dir or default_run_dir(Path(_script_of(command)))
    if (run_dir / "session.jsonl").exists():
        return error(f"{run_dir} already holds a session; choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AMP_TUI_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1"}
    headless = args.headless or not interactive()
    try:
        process = _start(command, env, run_dir / OUTPUT_NAME, tee=headless)
    except OSError as exc:
        return error(f"cannot run {shlex.join(command)}: {exc.strerror or exc}")
    if headless:
        status = _wait_headless(process, run_dir)
    else:
        status = _dashboard(process, command, run_dir, detach=args.detach, refresh_rate=args.refresh_rate)
    return _exit_status(status, command, run_dir)


def _script_of(command: list[str]) -> str:
    """What the run directory is named after: the first .py file in the command, else the program."""
    for part in command:
        if part.endswith(".py"):
            return part
    return Path(command[0]).name or "run"


def _start(command: list[str], env: dict, log_path: Path, *, tee: bool) -> subprocess.Popen:
    """The command in a session of its own (a signal meant for amp-tui reaches it only as amp-tui
    passes it on), its output to the log, and with `tee` to our stdout too."""
    log = open(log_path, "ab")   # noqa: SIM115 - closed by the thread that copies into it, or below
    if not tee:
        try:
            return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)

    def copy() -> None:
        with log:
            for chunk in iter(lambda: process.stdout.read1(65536), b""):
                log.write(chunk)
                log.flush()
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
    process.copier = threading.Thread(target=copy, name="amp-tui-output", daemon=True)
    process.copier.start()
    return process


def _passing_stops_on(process: subprocess.Popen):
    """SIGHUP/SIGTERM (and headless, Ctrl+C) to amp-tui: a stop at the command's next step
    boundary (its monitor takes SIGHUP and SIGTERM so, and records which one came; Ctrl+C is passed
    on as SIGTERM); a second Ctrl+C interrupts it (KeyboardInterrupt). A with-block: the previous
    handlers come back after it."""
    interrupts = 0

    def on_signal(signum, _frame):
        nonlocal interrupts
        if process.poll() is not None:
            return
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:
                process.send_signal(signal.SIGINT)
                return
        process.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)
    return handling_signals(STOP_SIGNALS, on_signal)


def _wait_headless(process: subprocess.Popen, run_dir: Path) -> int:
    with _passing_stops_on(process):
        status = process.wait()
        copier = getattr(process, "copier", None)
        if copier is not None:
            copier.join(10)
    return status


def _dashboard(process: subprocess.Popen, command: list[str], run_dir: Path, *, detach: bool,
               refresh_rate: float) -> int | None:
    from amp_tui.sources.launched import LaunchedSource
    from amp_tui.ui.app import create_app

    source = LaunchedSource(run_dir, process, command, detaches=detach)
    app = create_app(source, refresh_rate=refresh_rate)

    def stop_and_leave(signum, _frame):
        # The terminal went away, or someone asked amp-tui to end: the command stops at its next
        # step boundary (and checkpoints, as its monitor does on either signal); the dashboard leaves
        # (asked from a thread: a signal handler must not touch the app's event loop).
        if process.poll() is None:
            process.send_signal(signum)
        threading.Thread(target=app.call_from_thread, args=(app.exit,), daemon=True).start()
    try:
        with handling_signals((signal.SIGHUP, signal.SIGTERM), stop_and_leave):
            app.run()
    finally:
        source.close()
    if detach and process.poll() is None:
        print(f"amp-tui: detached; the job keeps running in {run_dir} (pid {process.pid}). "
              f"Re-attach with: amp-tui attach {run_dir}")
        return None
    if process.poll() is None:
        # q waited for it already; a forced exit or a signal did not: give it its step to finish.
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            print(f"amp-tui: {shlex.join(command)} did not exit within {STOP_WAIT_S:g} s of SIGTERM; "
                  "it keeps running", file=sys.stderr)
            return 1
    return process.returncode


def _exit_status(status: int | None, command: list[str], run_dir: Path) -> int:
    if status is None:          # detached: the job runs on
        return 0
    if status < 0:              # ended by a signal: the status a shell would give
        status = 128 - status
    if not (run_dir / "session.jsonl").exists():
        if status == 0:
            print(f"amp-tui: error: {shlex.join(command)} exited without starting a monitor "
                  "(amp_tui.monitor): nothing was recorded", file=sys.stderr)
            return NO_MONITOR
        print(f"amp-tui: {shlex.join(command)} exited with status {status} before starting a monitor; "
              f"its output is in {run_dir / OUTPUT_NAME}", file=sys.stderr)
        return status
    _print_summary(run_dir)
    if status != 0:
        print(f"amp-tui: {shlex.join(command)} exited with status {status}; the session and the "
              f"checkpoints are kept in {run_dir} (its output: {run_dir / OUTPUT_NAME})", file=sys.stderr)
    return status


def _print_summary(run_dir: Path) -> None:
    """The summary `amp-tui train` ends with, of what the command's monitor recorded."""
    from rich.console import Console

    from amp_tui.cli.summary import print_recorded

    try:
        print_recorded(run_dir, Console(highlight=False))
    except OSError:
        pass  # the terminal is gone (SSH drop): the session on disk is what matters
