"""`amp-tui report RUN`: the summary of a recorded run (read side: no torch)."""

from __future__ import annotations

from pathlib import Path

from amp_tui.cli.terminal import unreadable


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
    from amp_tui.core.jsonsafe import output_json
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.report import read_digest, summarize

    try:
        digest = read_digest(args.run)
        if args.as_at:
            from amp_tui.recording.timeline import at_arguments, interventions_as_at
            print(output_json(interventions_as_at(args.run)) if args.json else at_arguments(args.run))
            return 0
    except (SessionFormatError, OSError) as exc:
        return unreadable(exc, args.run)
    summary = summarize(digest)
    if args.json:
        print(output_json(summary.as_json(), indent=2))
    else:
        render_summary(summary, Console(highlight=False))
    return 0
