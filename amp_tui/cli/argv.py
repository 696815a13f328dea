"""The command line as typed, taken apart: amp-tui's own arguments and the script's, and the
options a job started from it must not get again."""

from __future__ import annotations


def split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """amp-tui's own arguments, and the script's (after `--`)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


STEP_OPTIONS = ("--at",)   # options whose value starts with a step number (STEP:ACTION)


def joined_step_values(argv: list[str], options: tuple[str, ...] = STEP_OPTIONS) -> list[str]:
    """`argv` with `--at -3:save` written `--at=-3:save`: argparse takes a value that starts with
    `-` for an option of its own (and says only `expected one argument`), where the step's own
    check says what is wrong with it."""
    out = []
    for arg in argv:
        if out and out[-1] in options and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
            continue
        out.append(arg)
    return out


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
