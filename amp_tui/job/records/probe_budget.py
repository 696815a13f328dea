"""What the run's own work costs each step, told to the probe schedule's budget, in one place.

The schedule spaces its probes so that they and the rest of amp-tui's work stay within a share of
the training (training/probes/probe_schedule.py). It is told three costs apart: formatting the
records (`published`), a probed step's forecasts, and the rest of the run's own work on a step
(`own_work_done`). Time the run spent on something that is not every step's cost (a pause, a
command applied at a boundary, a checkpoint every N steps) is counted `held` and left out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class ProbeBudget:
    """The time accounting behind the probe budget (see the module docstring). `schedule` is the
    driver's ProbeSchedule, or None where the driver probes nothing; `told` False: several ranks,
    whose schedules agree on figures rather than on each rank's own timing."""

    def __init__(self, schedule, *, told: bool = True):
        self.schedule = schedule
        self.told = told
        self.published_seconds = 0.0   # spent formatting records so far (publish)
        self.held_seconds = 0.0        # spent at boundaries that had something to do, and on checkpoints every N steps

    @property
    def apart_seconds(self) -> float:
        """What own_work_done leaves out of a step's own work, so far: formatting the records and
        the time held."""
        return self.published_seconds + self.held_seconds

    def published(self, seconds: float, records: int) -> None:
        """`records` step records formatted in `seconds`: what every step costs, taken from the
        probes' budget."""
        self.published_seconds += seconds
        if self.schedule is not None:
            self.schedule.add_record_time(seconds, records)

    def probed(self, seconds: float) -> None:
        """Work that a probed step alone costs (its forecasts' trend fits): probing's cost."""
        if self.schedule is not None:
            self.schedule.add_time(seconds)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Time spent in the block is not what every step costs (the records made meanwhile are
        counted by `published`)."""
        entered, published = time.perf_counter(), self.published_seconds
        try:
            yield
        finally:
            self.held_seconds += time.perf_counter() - entered - (self.published_seconds - published)

    def own_work_done(self, since: float, apart: float) -> None:
        """The run's own work on a step, from `since` (perf_counter) to now, told to the probe
        schedule as what every step costs; what `apart_seconds` counted meanwhile (it was `apart`)
        is told apart."""
        if self.schedule is not None and self.told:
            self.schedule.add_own_time(time.perf_counter() - since - (self.apart_seconds - apart))
