"""The command line as typed, taken apart: amp-tui's own arguments and the script's, and the
options a job started from it must not get again."""

from __future__ import annotations


def split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """amp-tui's own arguments, and the script's (after `--`)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def without_options(argv: list[str], options: tuple[str, ...], flags: tuple[str, ...] = ()) -> list[str]:
    """`argv` without `options` (each with its value, as `--opt V` or `--opt=V`) and `flags`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in options:
            skip = "=" not in arg
            continue
        if arg in flags:
            continue
        out.append(arg)
    return out
