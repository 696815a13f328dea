"""The `amp-tui` command line: one module per command, the tree and the dispatch in parser.py.

    train.py    train (headless, the dashboard, --detach); train_options.py its options as a
                RunConfig (amp_tui.job.build.build_run builds the run) and --tensorboard's checks
    distributed.py  train --nproc/--nnodes: the launcher, and what each rank does
    run.py      run (a command whose own loop uses amp_tui.monitor)
    report.py   report           replay.py   replay          ls.py      ls
    export.py   export           plot.py     plot
    ctl.py      ctl              attach.py   attach          compare.py compare (amp_tui.compare)
    summary.py  the after-run summary (headless and the dashboard)
    headless.py the headless status line and events, and a run driven headless
    terminal.py the one-line error and the terminal check; argtypes.py the argument types;
    argv.py     the command line as typed: amp-tui's arguments and the script's
"""

from amp_tui.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
