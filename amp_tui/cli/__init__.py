"""The `amp-tui` command line: train, report (and the app factory the tests share)."""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from pathlib import Path

from amp_tui import __version__

from amp_tui.cli import argtypes

EXIT_USAGE = 2
DEFAULT_RUNS = "runs"   # where runs go without --run-dir, and what `amp-tui ls` lists by default


def _dtype(text: str) -> str:
    from amp_tui.core.precision import canonical
    try:
        return canonical(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amp-tui", description="See and steer mixed-precision training live in the terminal.")
    parser.add_argument("--version", action="version", version=f"amp-tui {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="run a training script under the guarded AMP loop",
                           description="Run SCRIPT's setup() under the guarded autocast + GradScaler "
                                       "loop. Arguments after -- go to the script.")
    train.add_argument("script", type=Path, help="a Python file with a setup() function")
    train.add_argument("--dtype", type=_dtype, default=None,
                       help="fp16 (default), bf16 or fp32 (resuming: the checkpoint's dtype)")
    train.add_argument("--init-scale", type=argtypes.positive, default=65536.0, metavar="X",
                       help="GradScaler's initial loss scale in fp16 (default 65536)")
    train.add_argument("--steps", type=argtypes.positive_int, default=None, metavar="N",
                       help="iterations to run (default: until stopped); with --resume, that many "
                            "more from where the recording goes on")
    train.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    train.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                       help="where session.jsonl and checkpoints/ go (default runs/<time>-<script>)")
    train.add_argument("--headless", action="store_true", help="no dashboard: a status line and events")
    train.add_argument("--detach", action="store_true",
                       help="run the job in the background (headless, output in RUN_DIR/job.log) and "
                            "attach the dashboard to it: q leaves it running, amp-tui attach RUN_DIR "
                            "comes back")
    train.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                       help="continue RUN_DIR from its newest valid checkpoint, appending to its session")
    train.add_argument("--checkpoint-every", type=argtypes.positive_int, default=None, metavar="N",
                       help="save a checkpoint every N steps")
    train.add_argument("--probe-every", type=argtypes.positive_int, default=1, metavar="N",
                       help="collect per-layer figures every N steps (default 1)")
    train.add_argument("--underflow-every", type=argtypes.positive_int, default=10, metavar="N",
                       help="underflow shares on every Nth probed step (default 10; 1 = every probe)")
    train.add_argument("--on-nonfinite", choices=("skip", "pause", "stop", "fallback"), default=None,
                       help="what a non-finite loss does (default: skip headless, pause in the "
                            "dashboard); fallback moves fp16 -> bf16 -> fp32 when it keeps failing")
    train.add_argument("--repeat-interventions", type=Path, default=None, metavar="RUN",
                       help="apply a recording's interventions again at the same steps")
    train.add_argument("--at", action="append", default=[], metavar="STEP:ACTION",
                       help="schedule an intervention before STEP: dtype=bf16|fp16|fp32, scale=4096, "
                            "scale=half, save, restore=latest|PATH, pause (repeatable)")
    train.add_argument("--refresh-rate", type=argtypes.positive, default=20.0, metavar="HZ",
                       help="dashboard refreshes per second at most (default 20)")
    train.add_argument("--fp32-modules", action="append", default=[], metavar="PATTERN",
                       help="run modules whose name matches PATTERN (fnmatch, e.g. 'blocks.*.attn') "
                            "with autocast off and float32 inputs (repeatable)")
    guards = train.add_argument_group("scale guards and the fallback ladder")
    guards.add_argument("--min-scale", type=argtypes.positive, default=None, metavar="X",
                        help="never let the loss scale fall below X")
    guards.add_argument("--alert-scale-drops", type=argtypes.positive_int, default=5, metavar="N",
                        help="alert when the scale falls N times in a row (default 5)")
    guards.add_argument("--alert-skip-share", type=argtypes.share, default=0.25, metavar="X",
                        help="alert when more than X (0-1) of a window's updates are skipped (default 0.25)")
    guards.add_argument("--alert-window", type=argtypes.positive_int, default=100, metavar="N",
                        help="steps in the skip-share window (default 100)")
    guards.add_argument("--fallback-after", type=argtypes.positive_int, default=3, metavar="K",
                        help="with --on-nonfinite fallback: move down the ladder after K non-finite "
                             "steps in a row (default 3)")
    guards.add_argument("--storm-share", type=argtypes.share, default=0.5, metavar="X",
                        help="... or when X (0-1) of the last --storm-window updates were skipped (default 0.5)")
    guards.add_argument("--storm-window", type=argtypes.positive_int, default=20, metavar="N",
                        help="steps in the skip-storm window (default 20)")
    guards.add_argument("--rollback", action="store_true",
                        help="with --on-nonfinite fallback: restore the newest good checkpoint before moving")

    report = sub.add_parser("report", help="print the summary of a recorded run")
    report.add_argument("run", type=Path, help="a run directory or a session.jsonl")
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.add_argument("--as-at", action="store_true",
                        help="print the run's interventions as --at STEP:ACTION arguments")

    replay = sub.add_parser("replay", help="replay a recorded (or running) run in the dashboard",
                            description="Open RUN's recording in the dashboard; with --headless (or "
                                        "no terminal) print its timeline instead.")
    replay.add_argument("run", type=Path, metavar="RUN_DIR|SESSION")
    replay.add_argument("--headless", action="store_true", help="print the timeline: events, skip "
                        "storms, dtype changes, with steps")
    replay.add_argument("--follow", action="store_true",
                        help="start at the end and follow a session that is still being written")
    replay.add_argument("--speed", type=argtypes.positive, default=16.0, metavar="STEPS_PER_S",
                        help="playback speed (default 16 steps/s; + and - change it)")
    replay.add_argument("--refresh-rate", type=argtypes.positive, default=20.0, metavar="HZ",
                        help="dashboard refreshes per second at most (default 20)")

    from amp_tui.compare.command import add_parser as add_compare_parser
    add_compare_parser(sub)

    ctl = sub.add_parser("ctl", help="steer a running job from a shell",
                         description="Send COMMAND to the job running in RUN_DIR over its control "
                                     "socket and print its answer.")
    ctl.add_argument("run", type=Path, metavar="RUN_DIR")
    ctl.add_argument("action", metavar="COMMAND",
                     help="dtype=fp16|bf16|fp32, scale=N|half, save, restore=latest|PATH, pause, "
                          "resume, step, stop, fp32=MODULE, status")
    ctl.add_argument("--json", action="store_true", help="print the job's answer as JSON")

    attach = sub.add_parser("attach", help="open the dashboard on a job running in RUN_DIR",
                            description="Show a running job (figures follow its recording) and steer "
                                        "it over its control socket. q detaches and leaves the job "
                                        "running; Q stops the job.")
    attach.add_argument("run", type=Path, metavar="RUN_DIR")
    attach.add_argument("--refresh-rate", type=argtypes.positive, default=20.0, metavar="HZ",
                        help="dashboard refreshes per second at most (default 20)")

    ls = sub.add_parser("ls", help="list runs under some folders with their state",
                        description="List the runs under each DIR (a folder of run directories, a "
                                    "run directory, or a quoted glob like 'exp/*'), newest first.")
    ls.add_argument("folders", nargs="*", metavar="DIR",
                    help=f"folders of run directories (default {DEFAULT_RUNS}/: runs made with "
                         "--run-dir elsewhere are listed only when named)")
    return parser


def _split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _error(message: str, status: int = EXIT_USAGE) -> int:
    print(f"amp-tui: error: {message}", file=sys.stderr)
    return status


def prepare_run(args: argparse.Namespace, script_argv: list[str], command_line: list[str],
                on_nonfinite_default: str = "skip"):
    """Load and check the script, then build the Run (no file is written yet).

    Raises ScriptError / DeviceError / CommandError / PrecisionRefused with a message for the user.
    """
    from amp_tui.core.commands import parse_at
    from amp_tui.training.devices import resolve_device
    from amp_tui.training.guards import GuardConfig
    from amp_tui.training.checkpoint import list_checkpoints
    from amp_tui.job.run import BatchFeed, Run, RunConfig
    from amp_tui.training.script import ScriptError, load_script

    at = [parse_at(text) for text in args.at]
    if args.repeat_interventions is not None:
        from amp_tui.recording.format import SessionFormatError
        from amp_tui.recording.timeline import interventions_as_commands
        try:
            at += interventions_as_commands(args.repeat_interventions)
        except (SessionFormatError, OSError) as exc:
            raise ScriptError(f"--repeat-interventions: {exc}") from None
    device = resolve_device(args.device)
    run_dir = args.run_dir
    if args.resume is not None:
        if run_dir is not None and run_dir.resolve() != args.resume.resolve():
            raise ScriptError("--resume RUN_DIR continues that run in place; drop --run-dir")
        run_dir = args.resume
        if not (run_dir / "session.jsonl").is_file():
            raise ScriptError(f"--resume {run_dir}: no session.jsonl there")
        from amp_tui.job.control import job_alive
        if job_alive(run_dir):
            raise ScriptError(f"--resume {run_dir}: a job is still running there (amp-tui ctl {run_dir} stop)")
    elif run_dir is not None and (run_dir / "session.jsonl").exists():
        raise ScriptError(f"{run_dir} already holds a session; choose another --run-dir (or --resume it)")
    candidates = list_checkpoints(run_dir / "checkpoints") if args.resume is not None else []
    dtype = args.dtype or next((c.dtype for c in candidates if c.dtype), None) or "float16"
    from amp_tui.training.autocast import unsupported_reason
    reason = unsupported_reason(device, dtype)
    if reason:
        from amp_tui.training.engine import PrecisionRefused
        raise PrecisionRefused(reason)
    setup = load_script(args.script, device=str(device), argv=script_argv, dtype=dtype)
    resume_from, resume_skipped = None, []
    if args.resume is not None:
        resume_from, resume_skipped = _newest_valid_checkpoint(candidates, setup, run_dir)
        setup.warnings.extend(f"--resume: skipped {path.relative_to(run_dir)}: {reason}"
                              for path, reason in resume_skipped)
    feed = BatchFeed(setup.batches, device)
    from amp_tui.training.local_fp32 import match_modules
    for pattern in args.fp32_modules:
        if not match_modules(setup.model, pattern):
            raise ScriptError(f"--fp32-modules {pattern!r} matches no module of the model "
                              f"(module names look like {_example_names(setup.model)})")
    policy = args.on_nonfinite or on_nonfinite_default
    guard = GuardConfig(
        min_scale=args.min_scale, alert_scale_drops=args.alert_scale_drops,
        alert_skip_share=args.alert_skip_share, alert_window=args.alert_window,
        fallback=policy == "fallback", fallback_after=args.fallback_after,
        storm_share=args.storm_share, storm_window=args.storm_window, rollback=args.rollback)
    config = RunConfig(
        script=args.script, script_argv=script_argv, dtype=dtype, init_scale=args.init_scale,
        steps=args.steps, run_dir=run_dir, checkpoint_every=args.checkpoint_every,
        probe_every=args.probe_every, underflow_every=args.underflow_every, on_nonfinite=policy,
        at=at, command_line=command_line,
        guard=guard, fp32_modules=list(args.fp32_modules), resume_from=resume_from,
        resume_skipped=[(str(path.relative_to(run_dir)), reason) for path, reason in resume_skipped],
        control=True)
    run = Run(config, setup, device, feed)
    # After every precision policy is in place (--dtype, --fp32-modules, --at 0:...): the check
    # is the first step's own forward.
    run.preflight()
    return run, setup.warnings


def _newest_valid_checkpoint(candidates, setup, run_dir: Path) -> tuple[Path, list[tuple[Path, str]]]:
    """The newest checkpoint that passes every check against this script's model, and the newer
    ones skipped with the reason (a partly written or corrupted file, one whose header can't
    even be read, a weights-only file that has no optimizer state to go on from)."""
    from amp_tui.training.checkpoint import CheckpointError, checkpoint_files, read_checkpoint
    from amp_tui.training.script import ScriptError
    skipped: list[tuple[Path, str]] = []
    chosen = None
    for info in candidates:
        if info.kind != "full":
            skipped.append((info.path, "weights only: no optimizer or scaler state to resume from"))
            continue
        try:
            read_checkpoint(info.path, model=setup.model, optimizer=setup.optimizer, scheduler=setup.scheduler)
            chosen = info
            break
        except CheckpointError as exc:
            skipped.append((info.path, str(exc)))
    listed = {info.path for info in candidates}
    for path in checkpoint_files(run_dir / "checkpoints"):
        if path in listed:
            continue
        try:
            newer = chosen is None or path.stat().st_mtime >= chosen.mtime
            if newer:
                read_checkpoint(path, model=setup.model, optimizer=setup.optimizer,
                                scheduler=setup.scheduler)
        except (CheckpointError, OSError) as exc:
            skipped.append((path, str(exc)))
    if chosen is None:
        detail = f" (newest refused: {skipped[0][1]})" if skipped else ""
        raise ScriptError(f"--resume {run_dir}: no valid checkpoint in {run_dir / 'checkpoints'}{detail}")
    return chosen.path, skipped


def _example_names(model, count: int = 3) -> str:
    from amp_tui.training.local_fp32 import named_modules
    names = [n for n in named_modules(model) if n][:count]
    return ", ".join(repr(n) for n in names) or "(the model has no submodules)"


def cmd_train(args, script_argv: list[str], command_line: list[str]) -> int:
    from amp_tui.core.commands import CommandError
    from amp_tui.training.devices import DeviceError
    from amp_tui.training.engine import PrecisionRefused
    from amp_tui.training.script import ScriptError

    if args.detach:
        return cmd_detach(args, command_line[1:])
    dashboard = use_dashboard(args)
    try:
        run, warnings = prepare_run(args, script_argv, command_line,
                                    on_nonfinite_default="pause" if dashboard else "skip")
    except (ScriptError, DeviceError, CommandError, PrecisionRefused) as exc:
        return _error(str(exc))
    if dashboard:
        from amp_tui.ui.app import run_dashboard
        return run_dashboard(run, warnings, refresh_rate=args.refresh_rate)
    return run_headless(run, warnings)


def use_dashboard(args) -> bool:
    """The dashboard needs a terminal on both ends; --headless, pipes and CI keep the headless mode."""
    return not args.headless and sys.stdin.isatty() and sys.stdout.isatty()


def run_headless(run, warnings: list[str]) -> int:
    from rich.console import Console

    from amp_tui.cli.headless import HeadlessPrinter, print_after_run

    console = Console(highlight=False, stderr=False)
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {warning}", markup=True)
    interrupts = 0

    def on_signal(signum, _frame):
        nonlocal interrupts
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:
                raise KeyboardInterrupt  # the second Ctrl+C forces the exit
            run.request_stop(reason="interrupted (Ctrl+C)")
        else:
            # SIGHUP (the SSH connection dropped) or SIGTERM: keep the progress, then exit.
            run.request_stop(checkpoint=True, reason=signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with HeadlessPrinter(console, run.config.steps, run_dir=run.run_dir) as printer:
            run.observers.append(printer)
            status = run.run()
    except KeyboardInterrupt:
        console.print("forced exit (second Ctrl+C); the session is closed")
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print_after_run(run, console)
    return status


def cmd_report(args) -> int:
    from rich.console import Console

    from amp_tui.recording.report import render_summary, summarize
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.reader import read_session

    try:
        session = read_session(args.run)
    except SessionFormatError as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"cannot read {args.run}: {exc.strerror or exc}")
    if args.as_at:
        from amp_tui.recording.timeline import at_arguments, interventions_as_at
        print(json.dumps(interventions_as_at(args.run)) if args.json else at_arguments(args.run))
        return 0
    summary = summarize(session)
    if args.json:
        print(json.dumps(summary.as_json(), indent=2, allow_nan=False))
    else:
        render_summary(summary, Console(highlight=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, script_argv = _split_script_args(argv)
    args = build_parser().parse_args(ours)
    if args.command == "train":
        return cmd_train(args, script_argv, ["amp-tui", *argv])
    if args.command == "report":
        return cmd_report(args)
    if args.command == "compare":
        from amp_tui.compare.command import cmd_compare
        return cmd_compare(args, script_argv)
    if args.command == "ctl":
        return cmd_ctl(args)
    if args.command == "replay":
        return cmd_replay(args)
    if args.command == "ls":
        return cmd_ls(args)
    if args.command == "attach":
        return cmd_attach(args)
    return EXIT_USAGE


def cmd_replay(args) -> int:
    from amp_tui.sources.replay import ReplaySource
    from amp_tui.recording.index import SessionIndex
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.timeline import timeline_lines

    headless = args.headless or not (sys.stdin.isatty() and sys.stdout.isatty())
    try:
        if headless:
            with SessionIndex(args.run) as index:
                lines = timeline_lines(index)
            print("\n".join(lines))
            return 0
        source = ReplaySource(args.run, follow=args.follow, speed=args.speed)
    except SessionFormatError as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"cannot read {args.run}: {exc.strerror or exc}")
    from amp_tui.ui.app import create_app
    app = create_app(source, refresh_rate=args.refresh_rate)
    try:
        app.run()
    finally:
        source.stop()
    return 0


def cmd_ctl(args) -> int:
    from amp_tui.job.control import ControlError, send

    try:
        answer = send(args.run, args.action.strip())
    except ControlError as exc:
        return _error(str(exc), status=1)
    if args.json:
        print(json.dumps(answer, indent=2, allow_nan=False))
    else:
        print(answer.get("message", ""))
    return 0 if answer.get("ok") else 1


def cmd_ls(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from amp_tui.recording.listing import expand_folders, list_runs_in, short_dtype

    named = list(args.folders)
    folders, missing = expand_folders(named or [DEFAULT_RUNS])
    if named and missing:
        what = "folder or run" if len(missing) == 1 else "folders or runs"
        return _error(f"no {what} matching {', '.join(repr(m) for m in missing)}", status=1)
    rows = list_runs_in(folders)
    if not rows:
        where = ", ".join(named) if named else f"{DEFAULT_RUNS}/"
        hint = "" if named else " (runs made with --run-dir elsewhere: amp-tui ls DIR)"
        print(f"no runs under {where}{hint}")
        return 0
    # One folder: its runs' names are enough. Several: the path tells them apart.
    several = len(folders) > 1
    styles = {"running": "green", "crashed": "red", "error": "red", "stopped": "yellow"}
    cells = [[Text(str(r.run_dir) if several else r.run_dir.name),
              Text(r.state, style=styles.get(r.state, "")), Text(r.script),
              Text(str(r.steps)), Text(short_dtype(r.dtype)), Text(str(r.skipped))] for r in rows]
    # Piped output has no width to fit: keep whole rows for grep and friends.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    table = Table(box=None, header_style="bold")
    used = 0
    for i, name in enumerate(("run", "state", "script", "steps", "dtype", "skipped")):
        # Whole values in these columns; only the last event is cut to fit the terminal.
        width = max([len(name)] + [len(row[i].plain) for row in cells])
        table.add_column(name, no_wrap=True, min_width=width)
        used += width + 2
    table.add_column("last event", no_wrap=True, overflow="ellipsis",
                     max_width=max(10, console.width - used - 2))
    for row, r in zip(cells, rows):
        table.add_row(*row, Text(r.last_event))
    console.print(table)
    return 0


DETACH_WAIT_S = 60.0


def cmd_detach(args, argv: list[str]) -> int:
    """`train --detach`: the same command line as a headless background job, then attach to it."""
    import subprocess
    import time

    from amp_tui.job.control import job_alive
    from amp_tui.job.run import default_run_dir

    ours, script_argv = _split_script_args(argv)
    run_dir = args.resume or args.run_dir or default_run_dir(args.script)
    job = [a for a in ours if a != "--detach"]
    if not args.headless:
        job.append("--headless")
    if args.resume is None and args.run_dir is None:
        job += ["--run-dir", str(run_dir)]
    job = [sys.executable, "-m", "amp_tui", *job] + (["--", *script_argv] if "--" in argv else [])
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "job.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(job, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + DETACH_WAIT_S
    while not (job_alive(run_dir) and (run_dir / "session.jsonl").is_file()):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                why = f"the job did not open its control socket within {DETACH_WAIT_S:.0f} s"
            else:
                why = f"the job exited with status {proc.returncode} before it started"
            print(f"amp-tui: error: {why}; the end of {log_path}:", file=sys.stderr)
            print(_tail(log_path), file=sys.stderr)
            return 1
        time.sleep(0.1)
    if args.headless or not (sys.stdin.isatty() and sys.stdout.isatty()):
        print(f"amp-tui: the job runs in the background (pid {proc.pid}) in {run_dir}; "
              f"attach with: amp-tui attach {run_dir}")
        return 0
    return _attach(run_dir, args.refresh_rate)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read it: {exc})"


def cmd_attach(args) -> int:
    from amp_tui.sources.attached import check_attachable

    reason = check_attachable(args.run)
    if reason is not None:
        return _error(reason, status=1)
    return _attach(args.run, args.refresh_rate)


def _attach(run_dir: Path, refresh_rate: float) -> int:
    from amp_tui.sources.attached import AttachedSource
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.ui.app import create_app

    try:
        source = AttachedSource(run_dir)
    except SessionFormatError as exc:
        return _error(str(exc), status=1)
    except OSError as exc:
        return _error(f"cannot read {run_dir}: {exc.strerror or exc}", status=1)
    app = create_app(source, refresh_rate=refresh_rate)
    try:
        app.run()
    finally:
        source.stop()
    if source.job_alive():
        print(f"amp-tui: detached; the job keeps running in {run_dir}. "
              f"Re-attach with: amp-tui attach {run_dir}")
    else:
        print(f"amp-tui: the job in {run_dir} is not running any more (amp-tui report {run_dir})")
    return 0
