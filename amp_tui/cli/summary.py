"""The summary printed after `amp-tui train`, headless or from the dashboard alike."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def print_after_run(run, console: Console) -> None:
    """What the recording holds, and where the disk refused part of it, what the run did beyond
    that and what was lost."""
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.reader import read_session
    from amp_tui.recording.report import describe_records, render_summary, summarize

    if run.unwritten:
        console.print(Text(f"amp-tui: error: {run.recording_error}: "
                           f"{describe_records(run.unwritten)} could not be written", style="bold red"),
                      soft_wrap=True)   # one line, never folded: the path stays whole
    try:
        render_summary(summarize(read_session(run.session_path), run.outcome()), console)
    except (SessionFormatError, OSError) as exc:
        console.print(Text(f"amp-tui: no session to summarize: {exc}", style="red"))
