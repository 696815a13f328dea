"""The run summary on a terminal: after `amp-tui train` (headless or from the dashboard alike),
after `amp-tui run` and for `amp-tui report`."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from amp_tui.core.text import clip, visible
from amp_tui.recording.report import TEXT_LIMIT, Summary, summary_lines

NOTES_SHOWN = 20   # the newest; `amp-tui replay RUN --headless` lists every one at its step


def print_after_run(run, console: Console) -> None:
    """What the recording holds, and where the disk refused part of it, what the run did beyond
    that and what was lost."""
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.report import describe_records, read_digest, summarize

    if run.unwritten:
        console.print(Text(f"amp-tui: error: {run.recording_error}: "
                           f"{describe_records(run.unwritten)} could not be written", style="bold red"),
                      soft_wrap=True)   # one line, never folded: the path stays whole
    try:
        render_summary(summarize(read_digest(run.session_path), run.outcome()), console)
    except (SessionFormatError, OSError) as exc:
        console.print(Text(f"amp-tui: no session to summarize: {exc}", style="red"))


def print_recorded(run_dir: Path, console: Console) -> None:
    """The same summary after a run another process made (`amp-tui run`'s command): what its
    recording holds."""
    from amp_tui.recording.format import SessionFormatError
    from amp_tui.recording.report import read_digest, summarize

    try:
        render_summary(summarize(read_digest(run_dir)), console)
    except (SessionFormatError, OSError) as exc:
        console.print(Text(f"amp-tui: no session to summarize: {exc}", style="red"))


def render_summary(s: Summary, console: Console) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in summary_lines(s):
        table.add_row(key, Text(clip(value, TEXT_LIMIT, count=True)))  # Text(): paths and messages are shown literally
    console.print(table)
    for message in s.errors[-3:]:
        console.print(Text("error: " + clip(message, TEXT_LIMIT, count=True), style="red"))
    for refusal in s.refused[-3:]:
        console.print(Text(f"refused at step {refusal['step']}: " + clip(refusal["message"], TEXT_LIMIT, count=True),
                           style="yellow"))
    if len(s.notes) > NOTES_SHOWN:
        console.print(Text(f"notes: the last {NOTES_SHOWN} of {len(s.notes)}", style="dim"))
    for note in s.notes[-NOTES_SHOWN:]:
        console.print(Text(f"note at step {note['step']}: {clip(visible(note['text']), TEXT_LIMIT, count=True)}"))
