"""`amp-tui ls [DIR...]`: the runs under some folders with their state (read side: no torch)."""

from __future__ import annotations

import sys

from amp_tui.cli.terminal import error

DEFAULT_RUNS = "runs"   # where runs go without --run-dir, and what `amp-tui ls` lists by default
STATE_STYLES = {"running": "green", "crashed": "red", "error": "red", "stopped": "yellow"}
COLUMNS = ("run", "state", "script", "steps", "dtype", "skipped")   # then the last event, cut to fit


def add_parser(sub) -> None:
    ls = sub.add_parser("ls", help="list runs under some folders with their state",
                        description="List the runs under each DIR (a folder of run directories, a "
                                    "run directory, or a quoted glob like 'exp/*'), newest first.")
    ls.add_argument("folders", nargs="*", metavar="DIR",
                    help=f"folders of run directories (default {DEFAULT_RUNS}/: runs made with "
                         "--run-dir elsewhere are listed only when named)")
    ls.set_defaults(func=cmd_ls)


def cmd_ls(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from amp_tui.core.precision import short_name
    from amp_tui.job.steering.control import job_alive
    from amp_tui.recording.listing import expand_folders, list_runs_in

    named = list(args.folders)
    folders, missing = expand_folders(named or [DEFAULT_RUNS])
    if named and missing:
        what = "folder or run" if len(missing) == 1 else "folders or runs"
        return error(f"no {what} matching {', '.join(repr(m) for m in missing)}", status=1)
    rows = list_runs_in(folders, is_running=job_alive)
    if not rows:
        where = ", ".join(named) if named else f"{DEFAULT_RUNS}/"
        hint = "" if named else " (runs made with --run-dir elsewhere: amp-tui ls DIR)"
        print(f"no runs under {where}{hint}")
        return 0
    # One folder: its runs' names are enough. Several: the path tells them apart.
    several = len(folders) > 1
    cells = [[Text(str(r.run_dir) if several else r.run_dir.name),
              Text(r.state, style=STATE_STYLES.get(r.state, "")),
              Text(r.script + (f" ({r.world_size} ranks)" if r.world_size > 1 else "")),
              Text(str(r.steps)), Text(short_name(r.dtype)), Text(str(r.skipped))] for r in rows]
    # Piped output has no width to fit: keep whole rows for grep and friends.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    table = Table(box=None, header_style="bold")
    used = 0
    for i, name in enumerate(COLUMNS):
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
