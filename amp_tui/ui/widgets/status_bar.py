"""The two status lines at the top: what runs where, and the numbers that matter right now."""

from __future__ import annotations

import math
from pathlib import PurePath

from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget

from amp_tui.core.jsonsafe import read_float
from amp_tui.core.numfmt import scale_text
from amp_tui.core.precision import short_name
from amp_tui.core.records import STEERED_MODES
from amp_tui.core.text import one_line
from amp_tui.sources.protocol import Snapshot
from amp_tui.ui.text import literal, loss_text, same_text
from amp_tui.ui.view import Precision, rank_summary, scale_forecast

STATE_STYLES = {
    "starting": "black on grey70",
    "running": "black on green",
    "paused": "black on yellow",
    "stopping": "black on yellow",
    "stopped": "white on blue",
    "finished": "white on blue",
    "error": "bold white on red",
}
STALL_AFTER_S = 10.0  # a running run with no new step for this long is flagged


class StatusBar(Widget):
    """Two fixed lines, redrawn as often as a step lands: kept to the Line API and rendered only
    when the text changed (a Static's update costs several times more on the UI thread)."""

    DEFAULT_CSS = """
    StatusBar {
        height: 2;
        padding: 0 1;
        background: $panel;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._text = Text()
        self._strips: list[Strip] | None = None
        self._width = 0

    def show(self, snap: Snapshot, prec: Precision, *, pending: list[str], stopping: bool,
             now: float, playback: str | None = None) -> None:
        text = status_text(snap, prec, pending=pending, stopping=stopping, now=now,
                           playback=playback)
        if not same_text(text, self._text):
            self._text = text
            self._strips = None
            self.refresh()

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if self._strips is None or width != self._width:
            console = self.app.console
            options = console.options.update(width=width, height=2, no_wrap=True,
                                             overflow="ellipsis")
            lines = console.render_lines(self._text, options, style=self.rich_style, pad=True)
            self._strips = [Strip(line, width) for line in lines[:2]]
            self._width = width
        return self._strips[y] if y < len(self._strips) else Strip.blank(width, self.rich_style)

    def render(self) -> Text:   # for tests and screenshots' text: what the two lines say
        return self._text


def status_text(snap: Snapshot, prec: Precision, *, pending: list[str], stopping: bool,
                now: float, playback: str | None = None) -> Text:
    """`playback`: a replay's "paused · 16 steps/s" (then the badge is the recorded run's state)."""
    header, last = snap.header, snap.last or {}
    state: str = snap.state
    if stopping and snap.mode in STEERED_MODES and state in ("running", "paused", "starting"):
        state = "stopping"
    text = Text()
    text.append(f" {state.upper()} ", style=STATE_STYLES.get(state, "reverse"))
    text.append(" ")
    text.append(f" {short_name(prec.dtype)} ", style="bold black on cyan")
    text.append(" ")
    fp32 = fp32_text(snap.in_force.fp32_modules)
    if fp32:   # what runs in fp32 whatever the dtype: next to the dtype it is an exception to
        text.append_text(literal(fp32, "bold cyan"))
        text.append("  ")
    script = header.get("script")
    text.append_text(literal(PurePath(script).name if script else "starting…", "bold"))
    device = header.get("device")
    if isinstance(device, dict):
        text.append("  on ", style="dim")
        text.append_text(literal(f"{device.get('backend', '?')} {device.get('name', '')}".strip()))
    if snap.mode == "attached":
        text.append("  attached (q detaches, Q stops the job)", style="bold magenta")
    elif snap.mode == "launched":
        text.append("  amp-tui run (q stops the job, o its output)", style="bold magenta")
    elif snap.mode != "live":
        text.append(f"  {snap.mode} (read-only)", style="bold magenta")
        if playback is not None:
            text.append(f": {playback}", style="magenta")
    forecast = scale_forecast(snap)
    if forecast is not None:
        text.append(f"  {forecast}", style="yellow")
    if snap.notice:
        text.append("  ")
        text.append_text(literal(snap.notice, "yellow"))
    stalled = _stalled_for(snap, last, now)
    if stalled is not None:
        text.append(f"  no step for {stalled:.0f} s", style="bold yellow")
    if pending:
        text.append("  queued: ", style="dim")
        text.append_text(literal(", ".join(pending), "italic"))
    text.append("\n")
    _numbers(text, snap, prec, last)
    return text


def _numbers(text: Text, snap: Snapshot, prec: Precision, last: dict) -> None:
    """The status bar's second line: the step's figures."""
    # The numbers, most important first: the line is cut at the right on a narrow terminal.
    iterations = int(last["step"]) + 1 if "step" in last else 0
    total = snap.total_steps
    text.append("step ", style="dim")
    text.append(f"{iterations}/{total}" if total else str(iterations), style="bold")
    loss = read_float(last.get("loss"))
    _field(text, "loss", loss_text(loss), "bold red" if loss is not None and not math.isfinite(loss) else "bold")
    _field(text, "scale", f"{prec.scale:g}" if prec.scale is not None else "none")
    _field(text, "floor", scale_text(snap.in_force.scale_floor))
    skipped = int(last.get("skipped_total", 0) or 0)
    _field(text, "skipped", str(skipped), "bold yellow" if skipped else "bold")
    _field(text, "applied", f"{last.get('updates', 0)}/{iterations}")
    # A paused rate means nothing; a replay's pace is its playback speed, shown above.
    running = snap.state == "running" and snap.playback_state is None and snap.steps_per_second
    _field(text, "it/s", f"{snap.steps_per_second:.1f}" if running else "-")
    probes = probes_text(last.get("probes"))
    if probes is not None:
        _field(text, "probes", *probes)
    ranks = rank_summary(snap)
    if ranks is not None:
        _field(text, "ranks", str(ranks.world_size))
        if ranks.slowest is not None:
            _field(text, "slowest", f"rank {ranks.slowest}", "bold yellow")


FP32_SHOWN = 2   # modules named in the status bar; the layer table marks every one


def fp32_text(modules: tuple[str, ...]) -> str:
    """The modules in fp32, short: "fp32: blocks.0.attn, head +3"; "" when none."""
    if not modules:
        return ""
    more = f" +{len(modules) - FP32_SHOWN}" if len(modules) > FP32_SHOWN else ""
    return "fp32: " + ", ".join(one_line(m) for m in modules[:FP32_SHOWN]) + more


def probes_text(probes) -> tuple[str, str] | None:
    """The probe schedule a step record carries, in words and a style: "auto 1/9 · 0.8%" (one
    step in 9 probed; probing and the records have cost 0.8% of the training time), or "every step · why"."""
    if not isinstance(probes, list) or not probes:
        return None
    if probes[0] == "every":
        why = probes[1] if len(probes) > 1 and isinstance(probes[1], str) else ""
        return (f"every step · {one_line(why)}" if why else "every step"), "bold yellow"
    if probes[0] == "auto" and len(probes) >= 3 and all(isinstance(v, (int, float)) for v in probes[1:3]):
        return f"auto 1/{probes[1]:g} · {probes[2]:.2g}%", "bold"
    return None


def _field(text: Text, label: str, value: str, style: str = "bold") -> None:
    text.append(f"  {label} ", style="dim")
    text.append(value, style=style)


def _stalled_for(snap: Snapshot, last: dict, now: float) -> float | None:
    t = last.get("time")
    if snap.mode not in STEERED_MODES or snap.state != "running" or not isinstance(t, (int, float)):
        return None
    waited = now - t
    return waited if waited >= STALL_AFTER_S else None
