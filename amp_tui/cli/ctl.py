"""`amp-tui ctl RUN_DIR COMMAND`: steer a running job from a shell over its control socket."""

from __future__ import annotations

from pathlib import Path

from amp_tui.cli.terminal import error


def add_parser(sub) -> None:
    ctl = sub.add_parser("ctl", help="steer a running job from a shell",
                         description="Send COMMAND to the job running in RUN_DIR over its control "
                                     "socket and print its answer.")
    ctl.add_argument("run", type=Path, metavar="RUN_DIR")
    ctl.add_argument("action", metavar="COMMAND",
                     help="dtype=fp16|bf16|fp32|fp8, scale=N|half, save, restore=latest|PATH, pause, "
                          "resume, step, stop, fp32=MODULE, note=TEXT (a line recorded in the session: "
                          "quote it), probe=every|auto (probe every step, or the schedule), xray (the next step "
                          "traced op by op, into a file in RUN_DIR), fp8 (the next step's Linear layers cast to fp8: a "
                          "verdict per layer and a torchao filter, into files in RUN_DIR), undo (the autopilot's "
                          "last decision, --on-nonfinite isolate), status")
    ctl.add_argument("--json", action="store_true", help="print the job's answer as JSON")
    ctl.set_defaults(func=cmd_ctl)


def cmd_ctl(args) -> int:
    from amp_tui.core.jsonsafe import output_json
    from amp_tui.job.steering.control import ControlError, send

    try:
        answer = send(args.run, args.action.strip())
    except ControlError as exc:
        return error(str(exc), status=1)
    if args.json:
        print(output_json(answer, indent=2))
    else:
        print(answer.get("message", ""))
    return 0 if answer.get("ok") else 1
