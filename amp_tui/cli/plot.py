"""`amp-tui plot RUN -o FILE.png|svg`: one figure of a recorded run (read side: no torch)."""

from __future__ import annotations

from pathlib import Path

from amp_tui.cli.terminal import error, unreadable


def add_parser(sub) -> None:
    plot = sub.add_parser("plot", help="draw a recorded (or running) run as one PNG or SVG figure",
                          description="Draw RUN as one figure: the loss with the skipped updates, the "
                                      "loss scale with the interventions, and a layer x step map of "
                                      "headroom bits. Needs pip install 'amp-tui[plot]'.")
    plot.add_argument("run", type=Path, metavar="RUN_DIR|SESSION")
    plot.add_argument("-o", "--output", type=Path, required=True, metavar="FILE.png|svg",
                      help="the file to write (.png or .svg)")
    plot.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    from amp_tui.recording.extras import MissingExtra
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.plot import PlotError, plot

    try:
        data = plot(args.run, args.output).data
    except SessionFormatError as exc:
        return unreadable(exc, args.run)
    except (MissingExtra, PlotError) as exc:
        return error(str(exc))
    except OSError as exc:
        return error(f"plot: {exc.filename or args.output}: {exc.strerror or exc}", 1)
    print(f"{args.output}: {data.title}")
    for note in data.notes:
        print(f"note: {note}")
    return 0
