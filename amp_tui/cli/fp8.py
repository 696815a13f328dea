"""`amp-tui fp8 SCRIPT`: the fp8 what-if in one command. SCRIPT's setup() runs under `amp-tui
train` (headless) up to step N, whose Linear layers are cast to fp8 and fp4 in a what-if before it
runs (training/fp8/whatif.py); then the verdict per layer, and the filter it wrote for torchao's
`convert_to_float8_training`, are printed. The run directory keeps the session, the what-if's JSON
and the filter."""

from __future__ import annotations

import json
from pathlib import Path

from amp_tui.cli import argtypes
from amp_tui.cli.terminal import error


def add_parser(sub) -> None:
    fp8 = sub.add_parser("fp8", help="which Linear layers of SCRIPT's model can train in fp8",
                         description="Run SCRIPT's setup() (as amp-tui train --headless) up to step N, cast "
                                     "that step's Linear layers to fp8 and fp4 in a what-if, and print the "
                                     "verdict per layer and the torchao filter it implies. Arguments after "
                                     "-- go to the script.")
    fp8.add_argument("script", type=Path, help="a Python file with a setup() function")
    fp8.add_argument("--step", type=argtypes.nonnegative_int, default=0, metavar="N",
                     help="the step to cast (default 0: the first); the steps before it train as usual")
    fp8.add_argument("--dtype", type=argtypes.dtype, default="bfloat16",
                     help="the precision the steps run in, and the what-if compares against (default bf16)")
    fp8.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    fp8.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                     help="where the session, the what-if and the filter go (default runs/<time>-<script>)")
    fp8.add_argument("--json", action="store_true", help="print the what-if's verdict and files as JSON")
    fp8.set_defaults(func=cmd_fp8)


def cmd_fp8(args) -> int:
    from amp_tui.cli import train as train_command
    from amp_tui.cli.terminal import CommandParser
    from amp_tui.core.run_dirs import default_run_dir
    from amp_tui.recording.fp8_file import read_fp8

    train = ["train", str(args.script), "--headless", "--steps", str(args.step + 1), "--at", f"{args.step}:fp8",
             "--dtype", args.dtype]
    train += ["--device", args.device] if args.device else []
    run_dir = args.run_dir or default_run_dir(args.script)
    train += ["--run-dir", str(run_dir)]
    parser = CommandParser(prog="amp-tui")
    train_command.add_parser(parser.add_subparsers(dest="command"))
    train_args = parser.parse_args(train)
    train_args.script_argv, train_args.own_process = args.script_argv, args.own_process
    train_args.command_line = args.command_line
    code = train_args.func(train_args)
    event, failed = _fp8_event(run_dir)
    if event is None:
        why = failed or f"the run ended before step {args.step}"
        return error(f"no fp8 what-if was recorded in {run_dir}: {why}", code or 1)
    try:
        whatif = read_fp8(run_dir, event["path"])
    except (OSError, ValueError) as exc:
        return error(f"the fp8 what-if of step {event.get('step')} can't be read: {exc}", 1)
    if args.json:
        print(json.dumps({"step": event["step"], "run_dir": str(run_dir), "path": event["path"],
                          "filter": event["filter"], "verdict": whatif["verdict"]}, indent=1))
    else:
        print(render(whatif, event, run_dir))
    return code


def _fp8_event(run_dir: Path) -> tuple[dict | None, str | None]:
    """The run's fp8 event, or None and why none came (its replay's error, where it failed)."""
    from amp_tui.recording.reader import read_session
    try:
        session = read_session(run_dir)
    except (OSError, ValueError) as exc:
        return None, str(exc)
    event = next((e for e in reversed(session.events) if e.get("kind") == "fp8"), None)
    failed = next((e.get("message") for e in session.events if e.get("kind") == "error" and e.get("during") == "fp8"),
                  None)
    return event, failed


def render(whatif: dict, event: dict, run_dir: Path) -> str:
    """The verdict as a table, one Linear layer a line, those kept in bf16 first."""
    from amp_tui.recording.fp8_file import SUMMARY_COLUMNS, fp8_message, layer_summaries, summary_cell

    lines = layer_summaries(whatif)
    lines.sort(key=lambda line: line["verdict"] == "fp8")
    keys = [key for key, _ in SUMMARY_COLUMNS if key != "why"]
    cells = [[heading for key, heading in SUMMARY_COLUMNS if key != "why"]]
    cells += [[summary_cell(key, line[key]) for key in keys] for line in lines]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keys))]
    table = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    why = [f"  {line['module']}: {line['why']}" for line in lines if line["why"]]
    return "\n".join([fp8_message(event["step"], whatif), "", *table,
                      *(["", "kept in bf16:", *why] if why else []), "",
                      f"what-if: {run_dir / event['path']}",
                      f"filter:  {run_dir / event['filter']}  (module_filter_fn for convert_to_float8_training)"])
