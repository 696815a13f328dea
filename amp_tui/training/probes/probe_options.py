"""The probe options as one value, checked where it is made: `amp-tui train`'s --probe-every,
--probe-budget, --probe-alert-bits, --underflow-every and --fp8-every (the fp8 what-if recurring,
job/steering/fp8_schedule.py), and amp_tui.monitor's keywords of the same names. Every way of
running hands this one value on, so a new option is one field here."""

from __future__ import annotations

import math
from dataclasses import dataclass

from amp_tui.training.probes.probe_schedule import ProbeSchedule


@dataclass(frozen=True)
class ProbeOptions:
    every: int | str = "auto"      # "auto": the adaptive schedule (probe_schedule.py); N: every Nth step
    budget: float = 1.0            # percent of the training time amp-tui may cost (auto)
    alert_bits: float = 3.0        # headroom under which every step is probed (auto)
    underflow_every: int = 10      # underflow shares on every Nth probed step
    fp8_every: int | str | None = None   # the fp8 what-if every Nth step, or "auto" (None: on request only)

    def __post_init__(self) -> None:
        every = self.every
        if not (every == "auto" or (isinstance(every, int) and not isinstance(every, bool) and every >= 1)):
            raise ValueError(f"probe_every={every!r}: use 'auto' or a whole number of steps, 1 or more")
        if not (isinstance(self.budget, (int, float)) and 0 <= self.budget <= 100):
            raise ValueError(f"probe_budget={self.budget!r}: a percentage of the training time, 0 to 100")
        if not (isinstance(self.alert_bits, (int, float)) and 0 <= self.alert_bits < math.inf):
            raise ValueError(f"probe_alert_bits={self.alert_bits!r}: bits of headroom, 0 or more")
        if not (isinstance(self.underflow_every, int) and self.underflow_every >= 1):
            raise ValueError(f"underflow_every={self.underflow_every!r}: a whole number of probed steps, 1 or more")
        fp8 = self.fp8_every
        if not (fp8 is None or fp8 == "auto" or (isinstance(fp8, int) and not isinstance(fp8, bool) and fp8 >= 1)):
            raise ValueError(f"fp8_every={fp8!r}: use 'auto', a whole number of steps (1 or more), or None")

    @classmethod
    def of(cls, *, probe_every: int | str = "auto", probe_budget: float = 1.0, probe_alert_bits: float = 3.0,
           underflow_every: int = 10, fp8_every: int | str | None = None) -> ProbeOptions:
        """From the keywords users write (amp_tui.monitor's, the framework callbacks')."""
        return cls(probe_every, probe_budget, probe_alert_bits, underflow_every, fp8_every)

    def schedule(self, names: list[str]) -> ProbeSchedule:
        """The schedule of a model whose layers are `names`."""
        return ProbeSchedule(self.every, budget=self.budget, alert_bits=self.alert_bits, names=names)

    def header_fields(self) -> dict:
        """What the session header says of the options (the schedule adds its own)."""
        return {"underflow_every": self.underflow_every}
