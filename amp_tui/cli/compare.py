"""`amp-tui compare` on the command line: its arguments and its work are amp_tui.compare's."""

from __future__ import annotations


def add_parser(sub) -> None:
    from amp_tui.compare import add_parser as add_compare_parser

    add_compare_parser(sub).set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    from amp_tui.compare import cmd_compare as run_compare

    return run_compare(args, args.script_argv)
