"""The ranks of a run with several: each one's loss and step time at the newest step that has
them, the slowest (the straggler the others wait for at every all-reduce) marked."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from amp_tui.ui.text import loss_text
from amp_tui.ui.view import RankSummary


class RankTable(Static):
    DEFAULT_CSS = """
    RankTable {
        height: auto;
        max-height: 12;
        padding: 0 1;
        border-top: solid $panel-lighten-2;
        display: none;
    }
    RankTable.-visible {
        display: block;
    }
    """

    _shown: RankSummary | None = None

    def show(self, summary: RankSummary | None) -> None:
        if summary == self._shown:
            return
        self._shown = summary
        self.set_class(summary is not None, "-visible")
        if summary is not None:
            self.update(rank_text(summary))


def milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g} ms"


def rank_text(s: RankSummary) -> Text:
    text = Text()
    text.append(f"{s.world_size} ranks", style="bold")
    if s.step is None:
        text.append("  waiting for a probed step", style="dim")
        return text
    text.append(f"  at step {s.step}", style="dim")
    if s.slowest is not None:
        text.append("  slowest: ", style="dim")
        text.append(f"rank {s.slowest}", style="bold yellow")
        if s.lag is not None:
            text.append(f" ({s.lag:.2f}x the fastest)", style="dim")
    text.append("\n")
    text.append(f"{'rank':>6}  {'loss':>10}  {'step time':>10}", style="dim")
    for row in s.rows:
        text.append("\n")
        text.append(f"{row.rank:>6}  {loss_text(row.loss):>10}  {milliseconds(row.step_time):>10}",
                    style="bold yellow" if row.slowest else "")
        if row.slowest:
            text.append("  slowest", style="yellow")
    if s.hidden:
        text.append(f"\n{'':>6}  … {s.hidden} more (the slowest are shown)", style="dim")
    return text
