"""What every command shares about the terminal: the one-line error (its own and argparse's), and
whether a person is there."""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2
EXIT_UNREADABLE = 1   # a reader given a session it cannot read (docs/user-guide.md, "Exit status")


def error(message: str, status: int = EXIT_USAGE) -> int:
    """Print `amp-tui: error: MESSAGE` on stderr and return the exit status to leave with."""
    print(f"amp-tui: error: {message}", file=sys.stderr)
    return status


def unreadable(exc: Exception, run) -> int:
    """The one-line error of a reader (report, replay, export, plot) that could not read `run`:
    exit 1 for a file damaged past reading, not a session, or one the disk refused; 2 when the
    path names no session at all, a mistake on the command line."""
    from amp_tui.recording.format import NoSessionError

    if isinstance(exc, OSError):
        return error(f"cannot read {run}: {exc.strerror or exc}", EXIT_UNREADABLE)
    # One line whatever the message quotes: a damaged file's bytes can hold line breaks.
    message = " ".join(str(exc).splitlines())
    return error(message, EXIT_USAGE if isinstance(exc, NoSessionError) else EXIT_UNREADABLE)


def interactive() -> bool:
    """Both ends are a terminal: a dashboard can read keys and draw. Pipes, CI and a job started
    in the background get the printed (headless) output instead."""
    return sys.stdin.isatty() and sys.stdout.isatty()


class CommandParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line that names the command's --help, instead of the
    whole usage before it (17 lines for train)."""

    commands: dict[str, argparse.ArgumentParser] = {}   # the top level's: each command's parser

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
