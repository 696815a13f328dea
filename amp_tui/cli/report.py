"""`amp-tui report RUN`: the summary of a recorded run (read side: no torch)."""

from __future__ import annotations

import json
from pathlib import Path

from amp_tui.cli.terminal import error


def add_parser(sub) -> None:
    report = sub.add_parser("report", help="print the summary of a recorded run")
    report.add_argument("run", type=Path, help="a run directory or a session.jsonl")
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.add_argument("--as-at", action="store_true",
                        help="print the run's interventions as --at STEP:ACTION arguments")
    report.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from rich.console import Console

    from amp_tui.cli.summary import render_summary
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.report import read_digest, summarize

    try:
        digest = read_digest(args.run)
    except SessionFormatError as exc:
        return error(str(exc))
    except OSError as exc:
        return error(f"cannot read {args.run}: {exc.strerror or exc}")
    if args.as_at:
        from amp_tui.recording.timeline import at_arguments, interventions_as_at
        print(json.dumps(interventions_as_at(args.run)) if args.json else at_arguments(args.run))
        return 0
    summary = summarize(digest)
    if args.json:
        print(json.dumps(summary.as_json(), indent=2, allow_nan=False))
    else:
        render_summary(summary, Console(highlight=False))
    return 0
