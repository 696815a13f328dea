"""`amp-tui compare` on the command line. amp_tui.compare defines its arguments but imports torch,
so it is registered here with its help line only, and imported when the command is used."""

from __future__ import annotations

import argparse

HELP = "validate fp16/bf16 against an fp32 reference on a fixed eval set"


def add_parser(sub) -> None:
    sub.add_parser("compare", help=HELP, add_help=False, deferred=_real_parser)


def _real_parser(prog: str) -> argparse.ArgumentParser:
    """The parser amp_tui.compare defines, with the same prog ("amp-tui compare"), so its usage,
    help and errors read as if it had been in the tree all along."""
    from amp_tui.compare import add_parser as add_compare_parser

    parent_prog = prog.rsplit(" ", 1)[0]
    parser = add_compare_parser(argparse.ArgumentParser().add_subparsers(prog=parent_prog))
    parser.set_defaults(func=cmd_compare)
    return parser


def cmd_compare(args) -> int:
    from amp_tui.compare import cmd_compare as run_compare

    return run_compare(args, args.script_argv)
