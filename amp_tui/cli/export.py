"""`amp-tui export RUN`: a recording as TensorBoard event files, CSV, a W&B or an MLflow run (read
side: no torch)."""

from __future__ import annotations

import sys
from pathlib import Path

from amp_tui.cli.terminal import error, unreadable


def add_parser(sub) -> None:
    export = sub.add_parser("export", help="write a recorded (or running) run as TensorBoard event files, CSV, "
                                           "a W&B or an MLflow run",
                            description="Write RUN's recording as TensorBoard event files, CSV files, a W&B "
                                        "run and/or an MLflow run, in one pass over it.")
    export.add_argument("run", type=Path, metavar="RUN_DIR|SESSION")
    export.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                        help="TensorBoard event files into DIR (needs pip install 'amp-tui[tensorboard]')")
    export.add_argument("--csv", type=Path, default=None, metavar="FILE",
                        help="one row per step: loss, scale, skips, dtype, lr, grad norm, least headroom")
    export.add_argument("--layers-csv", type=Path, default=None, metavar="FILE",
                        help="one row per step and layer: max |act|, |grad|, |weight|, headroom bits")
    export.add_argument("--forecasts-csv", type=Path, default=None, metavar="FILE",
                        help="one row per forecast (loss-scale growth, layer headroom) and whether it came true")
    export.add_argument("--wandb", nargs="?", const=True, default=None, metavar="PROJECT",
                        help="a W&B run of its own in PROJECT (default $WANDB_PROJECT or amp-tui; "
                             "WANDB_MODE=offline works; pip install 'amp-tui[wandb]')")
    export.add_argument("--mlflow", default=None, metavar="URI",
                        help="an MLflow run of its own at tracking URI, e.g. sqlite:///mlflow.db "
                             "(pip install 'amp-tui[mlflow]')")
    export.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from amp_tui.recording.export import export
    from amp_tui.recording.extras import MissingExtra
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.trackers import TrackerError

    outputs = (args.tensorboard, args.csv, args.layers_csv, args.forecasts_csv, args.wandb, args.mlflow)
    if all(out is None for out in outputs):
        return error("export: say what to write: --tensorboard DIR, --csv FILE, --layers-csv FILE, "
                     "--forecasts-csv FILE, --wandb [PROJECT] and/or --mlflow URI")
    try:
        result = export(args.run, tensorboard=args.tensorboard, csv=args.csv, layers_csv=args.layers_csv,
                        forecasts_csv=args.forecasts_csv, wandb=args.wandb, mlflow=args.mlflow,
                        notify=lambda text: print(f"amp-tui: note: {text}", file=sys.stderr, flush=True))
    except SessionFormatError as exc:
        return unreadable(exc, args.run)
    except (MissingExtra, ValueError) as exc:
        return error(str(exc))
    except TrackerError as exc:
        return error(f"export: {exc}", 1)
    except OSError as exc:
        return error(f"export: {exc.filename or args.run}: {exc.strerror or exc}", 1)
    names = {"tensorboard": "TensorBoard", "csv": "steps CSV", "layers_csv": "layers CSV",
             "forecasts_csv": "forecasts CSV"}
    for key, path in result.written.items():
        print(f"{names.get(key, key):<12} {path}")
    print(f"exported {result.steps:,} steps and {result.events:,} events"
          + ("" if result.ended else "; no end record: the run is still going, or was killed"))
    if result.skipped:
        print(f"note: {result.skipped}")
    return 0
