"""The `amp-tui` argument tree and the dispatch: each command's module adds its own subparser and
names the function that runs it (`set_defaults(func=...)`).

Building the tree imports no command's heavy dependencies (torch, the engine, Textual): the
read-side commands (report, replay --headless, ls) start without them.
"""

from __future__ import annotations

import sys

from amp_tui import __version__
from amp_tui.cli import attach, compare, ctl, export, fp8, ls, plot, replay, report, run, train
from amp_tui.cli.argv import joined_step_values, split_script_args
from amp_tui.cli.terminal import CommandParser

# In the order `amp-tui --help` lists them.
COMMANDS = (train, run, fp8, report, replay, export, plot, compare, ctl, attach, ls)


def build_parser() -> CommandParser:
    # The subcommands' parsers are of the same class: every usage error is one line.
    parser = CommandParser(
        prog="amp-tui", description="See and steer mixed-precision training live in the terminal.")
    parser.add_argument("--version", action="version", version=f"amp-tui {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    parser.commands = dict(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    # amp-tui is the program (its console script, `python -m amp_tui`), not a call from someone's
    # code: what a training process sets up for itself (cli/training_process.py) is for it alone.
    own_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, script_argv = split_script_args(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(joined_step_values(ours))
    if unknown:
        # Named by the command they were given to, whose --help lists what it takes.
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    # What train and compare hand on: the script's arguments, and the command line as typed
    # (recorded in the session's header; --detach starts the job with it).
    args.script_argv = script_argv
    args.command_line = ["amp-tui", *argv]
    args.own_process = own_process
    return args.func(args)
