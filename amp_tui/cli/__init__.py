"""The `amp-tui` command line: one module per command, the tree and the dispatch in parser.py.

    train.py    train (headless, the dashboard, --detach) and prepare_run
    run.py      run (a command whose own loop uses amp_tui.monitor)
    report.py   report           replay.py   replay          ls.py      ls
    export.py   export           plot.py     plot
    ctl.py      ctl              attach.py   attach          compare.py compare (amp_tui.compare)
    summary.py  the after-run summary (headless and the dashboard)
    headless.py the headless status line and events
    terminal.py the one-line error and the terminal check; argtypes.py the argument types
"""

from amp_tui.cli.parser import build_parser, main
from amp_tui.cli.train import prepare_run, run_headless

__all__ = ["build_parser", "main", "prepare_run", "run_headless"]
