"""`amp-tui replay RUN`: a recording in the dashboard, or its timeline printed (read side: no torch)."""

from __future__ import annotations

from pathlib import Path

from amp_tui.cli import argtypes
from amp_tui.cli.terminal import interactive, unreadable


def add_parser(sub) -> None:
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
    replay.set_defaults(func=cmd_replay)


def cmd_replay(args) -> int:
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.index import SessionIndex
    from amp_tui.recording.timeline import timeline_lines
    from amp_tui.sources.replay import ReplaySource

    try:
        if args.headless or not interactive():
            with SessionIndex(args.run) as index:
                lines = timeline_lines(index)
            print("\n".join(lines))
            return 0
        source = ReplaySource(args.run, follow=args.follow, speed=args.speed)
    except (SessionFormatError, OSError) as exc:
        return unreadable(exc, args.run)
    from amp_tui.ui.app import create_app
    app = create_app(source, refresh_rate=args.refresh_rate)
    try:
        app.run()
    finally:
        source.stop()
    return 0
