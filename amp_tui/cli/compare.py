"""`amp-tui compare SCRIPT`: its arguments, and the command that validates, times and prints
(the comparison itself is amp_tui.compare's).

Building the parser imports no torch, so `amp-tui report`, `replay` and `ls` start without it;
the validation, the timing and the output are imported when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from amp_tui.cli import argtypes
from amp_tui.cli.terminal import error
from amp_tui.compare.criteria import (
    DEFAULT_ATOL,
    DEFAULT_EVAL_BATCHES,
    DEFAULT_MIN_AGREEMENT,
    DEFAULT_RTOL,
    Criteria,
    MaxFlips,
)
from amp_tui.core import precision

# The defaults are documented in docs/compare.md.
DEFAULT_DTYPES = ("float16", "bfloat16")
DEFAULT_SPEED_STEPS = 20
DEFAULT_WARMUP = 3


def parse_dtypes(text: str) -> list[str]:
    """--dtypes: AMP dtype names, comma-separated, in canonical form and without repeats."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            name = precision.canonical(part)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if name == "float32":
            raise argparse.ArgumentTypeError("fp32 is the reference: list fp16 and/or bf16")
        if name == "float8":
            raise argparse.ArgumentTypeError("fp8 is judged layer by layer: amp-tui fp8 SCRIPT says which "
                                             "layers can train in it")
        if name not in out:
            out.append(name)
    if not out:
        raise argparse.ArgumentTypeError("name at least one dtype: fp16, bf16 or fp16,bf16")
    return out


def parse_max_flips(text: str) -> MaxFlips:
    """A whole number is a count; a decimal in [0, 1] or a percentage is a share of the samples."""
    text = text.strip()
    if text.isdigit():
        return MaxFlips(count=int(text))
    share = argtypes.unit_share(text)
    return MaxFlips(count=None, share=share)


def add_parser(sub) -> None:
    """Register `compare` on the CLI's subparsers."""
    p = sub.add_parser(
        "compare", help="validate fp16/bf16 against an fp32 reference on a fixed eval set",
        description="Run SCRIPT's model in eval mode in fp32 (the reference) and under each AMP dtype "
                    "on a fixed evaluation set, and judge scores and decisions against criteria "
                    "declared up front. Exit 0: every dtype passed; 1: a criterion failed; 2: bad "
                    "command line or script. Arguments after -- go to the script.")
    p.add_argument("script", type=Path, help="a Python file with a setup() function")
    p.add_argument("--dtypes", type=parse_dtypes, default=list(DEFAULT_DTYPES), metavar="LIST",
                   help="AMP dtypes to validate, comma-separated (default fp16,bf16)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--eval-batches", type=argtypes.positive_int, default=DEFAULT_EVAL_BATCHES, metavar="N",
                   help="when the script has no eval_batches: use the first N of its batches "
                        f"(default {DEFAULT_EVAL_BATCHES})")
    crit = p.add_argument_group("criteria (fixed before the run)")
    crit.add_argument("--atol", type=argtypes.nonnegative, default=DEFAULT_ATOL, metavar="X",
                      help=f"absolute score tolerance (default {DEFAULT_ATOL:g})")
    crit.add_argument("--rtol", type=argtypes.nonnegative, default=DEFAULT_RTOL, metavar="X",
                      help=f"relative score tolerance: each element within atol + rtol·|fp32| "
                           f"(default {DEFAULT_RTOL:g})")
    crit.add_argument("--max-flips", type=parse_max_flips, default=MaxFlips(),
                      metavar="N|SHARE",
                      help="decisions allowed to change, near-ties excluded: a count (default 0) "
                           "or a share of the samples (0.01 or 1%%)")
    crit.add_argument("--tie-margin", type=argtypes.nonnegative, default=None, metavar="X",
                      help="a sample is a near-tie when the reference's top-2 score gap (|score| for "
                           "a single output) is ≤ X (default: within the score tolerance)")
    crit.add_argument("--min-agreement", type=argtypes.unit_share, default=DEFAULT_MIN_AGREEMENT, metavar="X",
                      help="minimum share of decisions equal to fp32's, near-ties included "
                           f"(default {DEFAULT_MIN_AGREEMENT:g})")
    sp = p.add_argument_group("speed and memory (after validation, passing dtypes only)")
    sp.add_argument("--speed", action="store_true",
                    help="time training steps and measure peak memory against fp32")
    sp.add_argument("--speed-steps", type=argtypes.positive_int, default=DEFAULT_SPEED_STEPS, metavar="N",
                    help=f"timed training steps per dtype (default {DEFAULT_SPEED_STEPS})")
    sp.add_argument("--warmup", type=argtypes.nonnegative_int, default=DEFAULT_WARMUP, metavar="N",
                    help=f"untimed steps first (default {DEFAULT_WARMUP})")
    p.add_argument("--json", action="store_true", help="machine-readable output (strict JSON)")
    p.set_defaults(func=cmd_compare)


def criteria_from_args(args) -> Criteria:
    return Criteria(atol=args.atol, rtol=args.rtol, max_flips=args.max_flips,
                    tie_margin=args.tie_margin, min_agreement=args.min_agreement)


def cmd_compare(args) -> int:
    """Validate, optionally time, then print the tables or one JSON document. Exit status: 0 when
    every dtype passed, 1 when one failed, 2 for a script problem (one line on stderr)."""
    # torch comes in here, with the modules that use it: not when the parser is built.
    from rich.console import Console

    from amp_tui.compare import render
    from amp_tui.compare.speed import measure_speed
    from amp_tui.compare.validation import validate
    from amp_tui.core.jsonsafe import dumps, strict
    from amp_tui.training.devices import DeviceError, describe_device, resolve_device
    from amp_tui.training.script import ScriptError, load_script

    script_argv = list(args.script_argv)
    criteria = criteria_from_args(args)
    console = Console(highlight=False, stderr=False)
    try:
        device = resolve_device(args.device)
        setup = load_script(args.script, device=str(device), argv=script_argv, dtype="float32")
    except (ScriptError, DeviceError) as exc:
        return error(str(exc))
    if not args.json:
        render.header(console, args.script, describe_device(device), args.dtypes, criteria,
                      setup.warnings)
    try:
        validation = validate(setup, device, args.dtypes, criteria, script=args.script,
                              eval_batches_default=args.eval_batches)
    except ScriptError as exc:
        return error(str(exc))
    if not args.json:
        render.comparison(console, validation)
    speed = None
    passing = [r.dtype for r in validation.results if r.passed]
    if args.speed and passing:
        if not args.json:
            render.speed_plan(console, passing, warmup=args.warmup, steps=args.speed_steps)
        speed = measure_speed(setup, device, passing, steps=args.speed_steps, warmup=args.warmup,
                              script=args.script, eval_fallback=validation.batches)
        if not args.json:
            render.speed_table(console, speed)
    elif args.speed and not args.json and validation.reference.finite:
        render.nothing_to_time(console)
    status = 0 if validation.passed else 1
    if args.json:
        data = {"script": str(args.script), "script_argv": script_argv,
                "device": describe_device(device), "dtypes": list(args.dtypes),
                **validation.as_json(),
                "speed": speed.as_json() if speed else None,
                "speed_requested": bool(args.speed), "exit_status": status}
        print(dumps(strict(data)))
    else:
        render.verdict(console, validation)
    return status
