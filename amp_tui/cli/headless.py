"""Headless mode: a live status line and events printed as they happen (the summary at the end
is summary.py's, shared with the dashboard), and `run_headless`, a run driven so."""

from __future__ import annotations

import shlex
import signal
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.text import Text

from amp_tui.cli.summary import print_after_run
from amp_tui.core import precision
from amp_tui.core.jsonsafe import read_float
from amp_tui.core.numfmt import number
from amp_tui.core.records import note_text
from amp_tui.core.signals import STOP_SIGNALS, handling_signals

EVENT_STYLES = {
    "nonfinite": "yellow", "error": "bold red", "intervention": "cyan",
    "checkpoint_saved": "green", "checkpoint_restored": "green", "paused": "magenta",
    "stopping": "magenta", "alert": "yellow", "forecast": "dim", "note": "bold blue",
}


class HeadlessPrinter:
    """An observer of a Run: redraws the live line at most `rate` times a second."""

    def __init__(self, console: Console, total_steps: int | None, rate: float = 8.0,
                 run_dir: Path | None = None):
        self.console = console
        self.total = total_steps
        self.run_dir = run_dir  # for the way out of a pause: amp-tui ctl RUN_DIR resume
        self.interval = 1.0 / rate
        self._last_draw = 0.0
        self._lock = threading.Lock()
        self._last: dict | None = None
        self._start = time.monotonic()
        self._live: Live | None = None
        self._suppressed_skips = 0

    def __enter__(self):
        if self.console.is_terminal:
            # Redrawn from the observer only: Live's own refresh thread would be a thread that
            # nobody joins (Live.stop() does not), alive while the interpreter shuts down.
            self._live = Live(Text(""), console=self.console, auto_refresh=False, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def __call__(self, record: dict) -> None:
        kind = record.get("type")
        if kind == "step":
            with self._lock:
                self._last = record
                now = time.monotonic()
                if self._live is not None and now - self._last_draw >= self.interval:
                    self._last_draw = now
                    self._live.update(self.status_line(), refresh=True)
        elif kind == "header":
            self.total = record.get("steps")   # a resume stops later than its --steps alone
        elif kind == "event":
            self.print_event(record)
            if _pauses(record):
                self.print_resume_hint()

    def print_event(self, record: dict) -> None:
        style = EVENT_STYLES.get(record.get("kind", ""), "")
        line = Text(f"step {record.get('step', '?'):>6}  ", style="dim")
        line.append(f"{record.get('kind', '?'):<20}", style=style)
        # literal: no markup from messages; a note's kind already says what its text is
        line.append(note_text(record) if record.get("kind") == "note" else str(record.get("message", "")))
        self.console.print(line, soft_wrap=True)
        tb = record.get("traceback")
        if tb:
            self.console.print(Text(tb.rstrip(), style="red"))

    def print_resume_hint(self) -> None:
        """Headless, nothing on this terminal resumes a paused run: say what does."""
        ctl = f"amp-tui ctl {shlex.quote(str(self.run_dir or 'RUN_DIR'))}"
        self.console.print(Text(f"{'':>13}paused: continue with `{ctl} resume`, or `{ctl} step` "
                                "for one step at a time", style="magenta"), soft_wrap=True)

    def status_line(self) -> Text:
        r = self._last or {}
        step = r.get("step", -1) + 1
        total = f"/{self.total}" if self.total else ""
        loss = read_float(r.get("loss"))
        scale = read_float(r.get("scale"))
        elapsed = max(time.monotonic() - self._start, 1e-9)
        text = Text()
        text.append(f"step {step}{total}", style="bold")
        text.append(f"  loss {_num(loss)}")
        text.append(f"  {precision.SHORT.get(r.get('dtype', ''), '?')}", style="cyan")
        text.append(f"  scale {'-' if scale is None else f'{scale:g}'}")
        text.append(f"  skipped {r.get('skipped_total', 0)}", style="yellow" if r.get("skipped_total") else "")
        text.append(f"  {step / elapsed:.1f} it/s", style="dim")
        return text


def _pauses(record: dict) -> bool:
    """A `paused` event (--on-nonfinite pause, a full disk) or a pause intervention (--at, ctl)."""
    if record.get("kind") == "paused":
        return True
    after = record.get("after")
    return (record.get("kind") == "intervention" and record.get("action") == "pause"
            and isinstance(after, dict) and after.get("state") == "paused")


def _num(x: float | None) -> str:
    return number(x, 5)


# ---- a run, headless ----------------------------------------------------------------------------

def run_headless(run, warnings: list[str]) -> int:
    """Run `run` with the status line and its events on the terminal (Ctrl+C stops at the next
    step boundary, a second one forces the exit; SIGHUP and SIGTERM stop with a checkpoint), then
    print the summary; the exit status."""
    console = Console(highlight=False, stderr=False)
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {warning}", markup=True)
    interrupts = 0

    def on_signal(signum, _frame):
        nonlocal interrupts
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:
                raise KeyboardInterrupt  # the second Ctrl+C forces the exit
            run.request_stop(reason="interrupted (Ctrl+C)")
        else:
            # SIGHUP (the SSH connection dropped) or SIGTERM: keep the progress, then exit.
            run.request_stop(checkpoint=True, reason=signal.Signals(signum).name)

    try:
        with (handling_signals(STOP_SIGNALS, on_signal),
              HeadlessPrinter(console, run.config.steps, run_dir=run.run_dir) as printer):
            run.observers.append(printer)
            status = run.run()
    except KeyboardInterrupt:
        console.print("forced exit (second Ctrl+C); the session is closed")
        return 130
    print_after_run(run, console)
    return status
