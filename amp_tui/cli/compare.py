"""`amp-tui compare` on the command line: amp_tui.compare.command defines its arguments (without
importing torch) and runs it."""

from __future__ import annotations


def add_parser(sub) -> None:
    from amp_tui.compare.command import add_parser as define
    define(sub).set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    from amp_tui.compare.command import cmd_compare as run_compare
    return run_compare(args, args.script_argv)
