"""--fp8-every: the fp8 what-if (training/fp8/whatif.py) recurring through a run, so that a layer
drifting out of fp8's range as it trains (outliers that grow late) shows in the what-ifs' verdicts
over time. Each one comes as an `fp8` command from `"source": "schedule"`, applied at a step
boundary like any other.

- N: before every Nth step (N, 2N, ...).
- auto: spaced so the what-ifs cost at most FP8_SHARE of the probe budget (--probe-budget) of the
  training time: each what-if's own duration is paid for by the training time after it. Before
  the first one is timed, a what-if is taken to cost FIRST_COST_STEPS steps.
"""

from __future__ import annotations

from amp_tui.core.commands import Command
from amp_tui.training.step.step_result import StepResult

FP8_SHARE = 0.25         # of the probe budget
FIRST_COST_STEPS = 20    # a what-if of the bench models costs 12 to 23 of their steps on the CPU


class Fp8Schedule:
    def __init__(self, every: int | str | None, budget_percent: float):
        self.every = every
        self.share = budget_percent / 100 * FP8_SHARE
        self.trained = 0.0     # training seconds since the last what-if was asked for
        self.steps = 0         # ... and the steps
        self.cost: float | None = None   # the last what-if's seconds

    def observe(self, result: StepResult) -> None:
        if result.fp8 is not None and isinstance(result.fp8.get("seconds"), (int, float)):
            self.cost = float(result.fp8["seconds"])
        self.trained += max(result.duration or 0.0, 0.0)
        self.steps += 1

    def commands(self, step: int) -> list[Command]:
        """The what-if to ask for at boundary `step`, if one is due."""
        if not self._due(step):
            return []
        self.trained, self.steps = 0.0, 0
        return [Command("fp8", None, "schedule")]

    def _due(self, step: int) -> bool:
        if self.every is None or step <= 0:
            return False
        if isinstance(self.every, int):
            return step % self.every == 0
        if self.steps == 0 or self.share <= 0:
            return False
        cost = self.cost if self.cost is not None else FIRST_COST_STEPS * self.trained / self.steps
        return self.trained * self.share >= cost
