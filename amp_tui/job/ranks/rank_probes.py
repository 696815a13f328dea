"""The adaptive probe schedule of several ranks: rank 0's decides, every rank follows.

The ranks must probe the same steps (a probed step's figures go round from every rank), and each
rank's own timing would space them differently. So each step's words (job/ranks/boundary_words.py, in
DDP's gradient all-reduce or the loss check's own) carry rank 0's spacing, and every rank probes
one step in that many from the boundary that agrees on it, counting from the same last probed
step. The escalations that every rank sees alike (a skip, a scale drop, a non-finite loss or
gradients, a dtype change, a restore, a resume, the `probe` command) each rank's schedule makes at
the same step on its own. A layer short of headroom is seen in one rank's own outputs: that rank
votes, and every rank escalates at the boundary that agrees on the vote, a step after the one
that told (the words of a step go round in its loss check, before the step's end).

In a loop of one's own (`amp_tui.monitor`) no loss check agrees on each rank's loss, and a rank's
figures may be its own shard's: a non-finite loss or figure that a rank sees (with no skip, which
is GradScaler's on every rank) goes in the boundary's words as the rank that saw it, and every
rank escalates at that boundary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from amp_tui.training.probes.probe_schedule import ProbeSchedule


class RankProbes:
    """One rank's side of the agreed schedule: what its words say, and what it does with the
    words every rank sent."""

    def __init__(self, schedule: ProbeSchedule, rank: int):
        self.schedule = schedule
        self.rank = rank
        self._voting = False   # a low headroom sent, until a boundary agreed on it
        self._nonfinite: str | None = None   # this rank's own non-finite value, alike (its words)
        schedule.follow(schedule.spacing())

    def words(self) -> tuple[int, bool]:
        """(rank 0's spacing, or 0 on the others; whether this rank's last probed step was short
        of headroom). Sent until agreed: a step's later loss checks send it again."""
        low, self.schedule.low_headroom = self.schedule.low_headroom, None
        self._voting = self._voting or low is not None
        spacing = self.schedule.spacing() if self.rank == 0 else 0
        return spacing, self._voting

    def nonfinite_here(self) -> bool:
        """Whether this rank saw a non-finite value of its own that the ranks have not agreed on
        yet (a loop of one's own: `ProbeSchedule.own_verdicts`). Sent until agreed."""
        own, self.schedule.own_nonfinite = self.schedule.own_nonfinite, None
        self._nonfinite = self._nonfinite or own
        return self._nonfinite is not None

    def agreed(self, spacing: int, headroom_rank: int | None, nonfinite_rank: int | None = None) -> None:
        """The words every rank agreed on, at a step boundary: probe at rank 0's spacing from the
        next step, and every step once a rank was short of headroom, or (`own_verdicts`) saw a
        non-finite value of its own."""
        self._voting = False
        own, self._nonfinite = self._nonfinite, None
        if spacing:
            self.schedule.follow(spacing)
        if nonfinite_rank is not None and self.schedule.own_verdicts:
            seen = own if nonfinite_rank == self.rank and own else "a non-finite value"
            self.schedule.escalate("nonfinite", f"{seen} on rank {nonfinite_rank}")
        if headroom_rank is not None:
            self.schedule.escalate("headroom", f"a layer under {self.schedule.alert_bits:g} bits of headroom "
                                               f"on rank {headroom_rank}")
