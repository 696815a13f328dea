"""`amp-tui attach RUN_DIR`: the dashboard on a job running in the background (also where
`train --detach` ends up)."""

from __future__ import annotations

from pathlib import Path

from amp_tui.cli import argtypes
from amp_tui.cli.terminal import error


def add_parser(sub) -> None:
    attach = sub.add_parser("attach", help="open the dashboard on a job running in RUN_DIR",
                            description="Show a running job (figures follow its recording) and steer "
                                        "it over its control socket. q detaches and leaves the job "
                                        "running; Q stops the job.")
    attach.add_argument("run", type=Path, metavar="RUN_DIR")
    attach.add_argument("--refresh-rate", type=argtypes.positive, default=20.0, metavar="HZ",
                        help="dashboard refreshes per second at most (default 20)")
    attach.set_defaults(func=cmd_attach)


def cmd_attach(args) -> int:
    from amp_tui.sources.attached import check_attachable

    reason = check_attachable(args.run)
    if reason is not None:
        return error(reason, status=1)
    return attach_dashboard(args.run, args.refresh_rate)


def attach_dashboard(run_dir: Path, refresh_rate: float) -> int:
    """The dashboard on the job in `run_dir` until q (the job keeps running) or Q (it stops)."""
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.sources.attached import AttachedSource
    from amp_tui.ui.app import create_app

    try:
        source = AttachedSource(run_dir)
    except SessionFormatError as exc:
        return error(str(exc), status=1)
    except OSError as exc:
        return error(f"cannot read {run_dir}: {exc.strerror or exc}", status=1)
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
