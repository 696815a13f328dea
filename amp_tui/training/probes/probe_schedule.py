"""Which steps are probed: a fixed schedule (every N steps), or an adaptive one under a budget.

The adaptive schedule (`every="auto"`) measures what a probed step costs over an unprobed one on
this model and device, from the durations the steps already measure (the median of each kind's
recent steps: one slow step of a busy machine moves a median little, where it would throw a
moving average far off), and spaces the probed steps so that amp-tui takes at most `budget` percent
of the training time. A probed step's forecasts, made after it, count in its time (`add_time`), and
what every step costs whatever the schedule (formatting its record with the guards,
`add_record_time`; the run's other work between two steps, `add_own_time`) comes out of the budget
before probing is spaced. It still probes once every `live_seconds` of training, so a dashboard
stays live, and probes the first steps, to measure both costs.

From the first sign of trouble (a skipped update, a scale drop, a non-finite loss, a layer under
`alert_bits` of headroom, a dtype change, a restore or a resume) every step is probed, until
`clean_steps` clean steps in a row bring it back to the budget. `p` in the dashboard (the `probe`
command) pins every step, or lets go back to the schedule.

One object for both drivers: the engine's `GuardedTrainer` and the hook driver of the user's own
loop ask `probing(step)` before a step and tell `observe(...)` after it; the changes of mode wait
in `drain()` for the run to record them as `probes` events. Deterministic: no clock of its own.

Several ranks must probe the same steps, and each one's timing would space them differently: there
(`follow`), rank 0's `spacing()` decides, agreed each step (job/ranks/rank_probes.py), and a layer's
headroom, which each rank sees in its own outputs, is voted on instead of escalating one rank alone
(`low_headroom`). Under `amp-tui train` the other signs of trouble are the same on every rank at
the same step; in a loop of one's own (`own_verdicts`), a non-finite loss or figure is one rank's
own too, and goes in the words alike (`own_nonfinite`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Literal

from amp_tui.core.precision import MAX_FINITE, SHORT
from amp_tui.training.probes.recent_median import RecentMedian

Mode = Literal["every", "auto"]

FIRST_PROBED = 3        # the first steps are probed; warming up, their durations are not counted
PROBED_WINDOW = 15      # recent probed steps whose median duration is a probed step's
PLAIN_WINDOW = 31       # recent unprobed steps whose median duration is an unprobed step's
PLAIN_REFRESH = 4       # ... made again every this many counted steps once the window is full
FIRST_INTERVAL = 10     # one step in this many while a cost is still unknown
RISK_SHARE = 1 / 8      # the next probe within this share of the soonest overflow the figures suggest
# The budget is a share of a step at least this long: on shorter steps (in µs, not held to 1%), a
# probe that costs a few steps would otherwise come once in a thousand.
SHORT_STEP = 0.010
MAX_SPACING = (1 << 24) - 1   # the widest spacing the ranks agree on (exact in fp32 and int64 words)
NONFINITE_WORDS = {"loss": "loss", "activations": "activation", "gradients": "gradient"}


@dataclass(frozen=True)
class ProbeChange:
    """An escalation to every step, or a return to the schedule: a `probes` event."""

    mode: Mode
    reason: str         # skip, scale_drop, nonfinite, headroom, dtype, restore, resume, command, clean,
                        # trend (the spacing narrowed by a forecast), growth (the step before a scale growth)
    message: str


class ProbeSchedule:
    """`every`: "auto" (the budget), or N (every Nth step, as it always was; escalations on
    trouble are the adaptive schedule's, the `probe` command works on both)."""

    def __init__(self, every: int | str = "auto", *, budget: float = 1.0, alert_bits: float = 3.0,
                 live_seconds: float = 2.0, clean_steps: int = 50, weights_every: int = 4,
                 names: list[str] | None = None):
        self.auto = every == "auto"
        self.every = 1 if self.auto else max(1, int(every))
        self._budget = max(0.0, float(budget))
        self.alert_bits = float(alert_bits)
        self.live_seconds = float(live_seconds)
        self.clean_steps = max(1, int(clean_steps))
        self.weights_every = max(1, int(weights_every))
        self.names = list(names or [])
        # The modules run in fp32 whatever the dtype (`--fp32-modules`, `fp32=`, `f`, the
        # autopilot): their figures, and their children's, count to fp32's max. The run sets it.
        self.fp32_modules: Callable[[], Iterable[str]] = tuple
        self.escalated: str | None = None   # why every step is probed (a trouble's words)
        self.pinned = False                 # `probe=every`: until `probe=auto`
        self._probed = RecentMedian(PROBED_WINDOW)               # a probed step's duration ...
        self._plain = RecentMedian(PLAIN_WINDOW, PLAIN_REFRESH)   # ... and an unprobed one's
        self.observed = 0                   # steps observed
        self.probed_steps = 0               # planned probed steps observed
        self.since_probe = 0                # unprobed steps since the last probed one ...
        self.seconds_since_probe = 0.0      # ... and their training time
        self.clean = 0                      # clean steps in a row while escalated
        self.probe_seconds = 0.0            # what probing cost so far (measured) ...
        self.total_seconds = 0.0            # ... out of this much training time
        # What the run spends on every step besides it, whatever the schedule: formatting its
        # record with the guards (per record, as they are done in batches), and the rest of its
        # own work between two steps (`add_own_time`): the recent medians of each.
        self._record = RecentMedian(PLAIN_WINDOW)
        self._own = RecentMedian(PLAIN_WINDOW, PLAIN_REFRESH)
        self._last: tuple[bool, RecentMedian | None] | None = None   # the last step: planned, its window
        self._changes: list[ProbeChange] = []
        self._spacing = FIRST_INTERVAL      # the interval the last resolvable cost gave
        self._interval: int | None = None   # interval(), until a figure it depends on moves
        # Several ranks (`follow`): the spacing rank 0's schedule chose, as the ranks agreed on it
        # (None: this schedule decides alone), and the last low headroom this rank saw in its own
        # figures, for its vote, instead of an escalation of its own.
        self.agreed_spacing: int | None = None
        self.low_headroom: tuple[str, float] | None = None
        # A loop of one's own (`amp_tui.monitor`) with several ranks: no collective agrees on a
        # rank's loss, nor on its figures where they are its own shard's, so a non-finite one is
        # told in the words too (`own_nonfinite`: what this rank saw) instead of escalating here.
        # A skip and a scale drop are GradScaler's, the same on every rank.
        self.own_verdicts = False
        self.own_nonfinite: str | None = None
        # Spaced by risk as well as by cost: the next probe no later than a share of the soonest
        # overflow the figures suggest (`limit_spacing`), and the steps known to matter ahead of
        # time (`probe_at`: the one before GradScaler's next growth).
        self.risk_spacing: int | None = None
        self._due: dict[int, str] = {}   # step -> why it is probed
        self._growth_said = False

    @property
    def budget(self) -> float:
        """The most amp-tui may take, in percent of the training time."""
        return self._budget

    @budget.setter
    def budget(self, percent: float) -> None:
        self._budget = max(0.0, float(percent))
        self._interval = None

    @property
    def probed_time(self) -> float | None:
        """A probed step's duration: the median of the recent ones (None: none counted yet)."""
        return self._probed.value

    @property
    def plain_time(self) -> float | None:
        """An unprobed step's duration, alike."""
        return self._plain.value

    @property
    def record_time(self) -> float:
        """What formatting a step's record with the guards takes (the recent median)."""
        return self._record.value or 0.0

    @property
    def own_time(self) -> float:
        """What the run's other work between two steps takes (the recent median)."""
        return self._own.value or 0.0

    # ---- before a step ----------------------------------------------------------------------
    @property
    def mode(self) -> Mode:
        return "every" if self.escalated is not None or self.pinned else "auto"

    def probing(self, step: int) -> bool:
        """Whether step `step` is probed (asked any number of times: only `observe` moves it on)."""
        if self.mode == "every" or (self.auto and self.budget >= 100):
            return True
        if not self.auto:
            return step % self.every == 0
        if self.observed < FIRST_PROBED:
            return True
        if self.agreed_spacing is not None:
            return self.since_probe + 1 >= self.agreed_spacing
        if step in self._due:
            return True
        if self.plain_time is None:
            return False   # an unprobed step first, to know what probing adds
        spacing = self.interval() if self.risk_spacing is None else min(self.interval(), self.risk_spacing)
        return self.since_probe + 1 >= spacing or self.seconds_since_probe >= self.live_seconds

    def interval(self) -> int:
        """One step in this many is probed, for probing to cost at most what the budget leaves
        once what every step costs is paid (`probe_share`): cost / (k * plain + cost) <= b gives
        k >= cost * (1 - b) / (b * plain)."""
        if self._interval is None:
            self._interval = self._spaced()
        return self._interval

    def fixed_share(self) -> float:
        """What every step costs besides its own work (its record, the guards, the rest of the
        run's work between steps), as a share of an unprobed step (0..1)."""
        return (self.record_time + self.own_time) / self.plain_time if self.plain_time else 0.0

    def _budgeted_step(self) -> float:   # what the budget is a share of
        return max(self.plain_time or 0.0, SHORT_STEP)

    def probe_share(self) -> float:
        """The share of the training time (0..1) the probes may take: the budget, less what every
        step costs whatever the schedule (`fixed_share`), but never under a quarter of the budget
        (the figures are the point); of a step of SHORT_STEP where steps are shorter."""
        budget = self.budget / 100
        fixed = (self.record_time + self.own_time) / self._budgeted_step() if self.plain_time else 0.0
        return max(budget - fixed, budget / 4)

    def _spaced(self) -> int:
        if not self.auto:
            return self.every
        if self.probed_time is None or self.plain_time is None:
            return FIRST_INTERVAL
        if self.budget >= 100:
            return 1
        share = self.probe_share()
        cost = self.probed_time - self.plain_time
        if share <= 0 or self.plain_time <= 0:
            return 1 << 30   # only the live floor probes
        if cost <= 0:
            # A probed step that measures no dearer than an unprobed one is the noise of a busy
            # machine moving both medians, not a free probe: keep the spacing last measured.
            return self._spacing
        # At least every other step unprobed, so that both averages keep up with the run.
        # (rounded first: an exact 18 computed as 18.000000000000004 is 18)
        self._spacing = max(2, math.ceil(round(cost * (1 - share) / (share * self._budgeted_step()), 6)))
        return self._spacing

    def spacing(self) -> int:
        """One step in this many, as `probing` would space them now, the live floor included: what
        rank 0 proposes to the other ranks. The floor probes once the unprobed steps since the last
        probed one reach `live_seconds` at an unprobed step's median duration."""
        if not self.auto:
            return self.every
        if self.budget >= 100:
            return 1
        spacing = self.interval() if self.risk_spacing is None else min(self.interval(), self.risk_spacing)
        if self.plain_time:
            spacing = min(spacing, math.ceil(self.live_seconds / self.plain_time) + 1)
        return max(1, min(spacing, MAX_SPACING))

    def limit_spacing(self, steps_left: int | None, why: str = "") -> None:
        """The soonest overflow the figures suggest is `steps_left` steps away (None: none seen):
        probe again within RISK_SHARE of it, so the estimate sharpens as it nears (the budget's
        spacing stays the widest). A narrowing by half or more is said in a `probes` event."""
        if not self.auto:
            return
        if steps_left is None:
            self.risk_spacing = None
            return
        spacing = max(1, math.ceil(steps_left * RISK_SHARE))
        widest = self._interval if self._interval is not None else FIRST_INTERVAL
        if spacing >= widest:
            self.risk_spacing = None
            return
        before = self.risk_spacing
        self.risk_spacing = spacing
        if (before is None or spacing * 2 <= before) and self.mode == "auto":
            self._changes.append(ProbeChange("auto", "trend", f"probing at least every {spacing} steps: {why}"))

    def probe_at(self, step: int, why: str) -> None:
        """Probe step `step` whatever the spacing (the adaptive schedule of one process only:
        several ranks probe what rank 0's spacing says). Said once, when the first such step is
        probed."""
        if not self.auto or self.agreed_spacing is not None:
            return
        self._due.setdefault(step, why)

    def follow(self, spacing: int) -> None:
        """Several ranks: probe at `spacing`, as the ranks agreed (rank 0's), not at this
        schedule's own; and put a low headroom to the vote instead of escalating on it here."""
        self.agreed_spacing = max(1, int(spacing))

    def weights_due(self) -> bool:
        """Whether the step being probed reads the weights: every `weights_every`th probed step
        of the adaptive schedule, and every escalated one (a fixed schedule: every probed step)."""
        return not self.auto or self.mode == "every" or self.probed_steps % self.weights_every == 0

    def ops_due(self, dtype: str) -> bool:
        """Whether the step being probed measures the ops inside modules' forwards (op_probe.py):
        in fp16 only (what can overflow there), and while every step is probed, every
        `weights_every`th (their cost counts in the probed steps' time like the rest)."""
        return dtype == "float16" and (self.mode == "auto" or self.probed_steps % self.weights_every == 0)

    def underflow_due(self, step: int, every: int) -> bool:
        """Whether the step being probed counts the underflow shares: every `every`th probed step."""
        probed = step // self.every if not self.auto else self.probed_steps
        return probed % every == 0

    def share(self) -> float:
        """The share of the training time amp-tui took so far, as measured (0..1): probing, and
        what every step costs whatever the schedule (`fixed_share`, at its recent rate)."""
        if self.total_seconds <= 0:
            return 0.0
        return max(0.0, self.probe_seconds) / self.total_seconds + self.fixed_share()

    # ---- after a step -----------------------------------------------------------------------
    def observe(self, *, planned: bool, duration: float, skipped: bool = False, nonfinite: str | None = None,
                scale: float | None = None, next_scale: float | None = None, dtype: str = "float32",
                act: list | None = None, grad: list | None = None, step: int | None = None,
                calibration: bool = False) -> None:
        """A step's outcome: `planned` whether it was probed as planned, its duration, and its
        figures (`act`, `grad`: None when not measured). `calibration`: a skip of GradScaler
        finding its scale at the start (training/step/calibration.py), which is no trouble."""
        self.observed += 1
        if step is not None and self._due:
            why = self._due.get(step)
            if why is not None and planned and not self._growth_said:
                self._growth_said = True
                self._changes.append(ProbeChange(self.mode, "growth", f"probing the step before each scale "
                                                                   f"growth (step {step:,}): {why}"))
            self._due = {due: said for due, said in self._due.items() if due > step}
        trouble = None if calibration else self._trouble(skipped, nonfinite, scale, next_scale, dtype, act, grad,
                                                         step)
        if planned:
            self.probed_steps += 1
        # A skipped step's time (no optimizer step) says nothing of a step's cost either.
        self._measure(planned, duration,
                      counted=trouble is None and not calibration and self.observed > FIRST_PROBED)
        if trouble is not None:
            self.clean = 0
            if self.escalated is None and self.auto:
                self._escalate(*trouble)
        elif self.escalated is not None:
            self.clean += 1
            if self.clean >= self.clean_steps:
                self.escalated = None
                if not self.pinned:
                    self._changes.append(ProbeChange("auto", "clean", f"probing back to {self.describe_budget()} "
                                                                      f"after {self.clean} clean steps"))

    def _measure(self, planned: bool, duration: float, *, counted: bool) -> None:
        self.total_seconds += duration
        if planned:
            if self.plain_time is not None:
                # Signed: a probed step the noise made quicker than the median unprobed one
                # cancels one it made slower, instead of only the slower ones adding up.
                self.probe_seconds += duration - self.plain_time
            self.since_probe, self.seconds_since_probe = 0, 0.0
        else:
            self.since_probe += 1
            self.seconds_since_probe += duration
        self._last = (planned, None)
        if not counted:   # the first steps (warm-up) and trouble steps (a diagnosis) say nothing of the cost
            return
        window = self._probed if planned else self._plain
        self._last = (planned, window)
        if window.add(duration):
            self._interval = None

    def add_time(self, seconds: float) -> None:
        """What the run spent on the last step observed after it ended (its forecasts): counted
        in that step's time, so what a probed step adds there is probing's cost."""
        if self._last is None or seconds <= 0:
            return
        planned, window = self._last
        self.total_seconds += seconds
        if planned:
            self.probe_seconds += seconds
        else:
            self.seconds_since_probe += seconds
        if window is not None:
            window.add_to_last(seconds)
            self._interval = None

    def add_own_time(self, seconds: float) -> None:
        """The run's own work on the last step between it and the next one, besides formatting
        records (`add_record_time`) and a probed step's forecasts (`add_time`): what every step
        pays, taken from the budget. Told for unprobed steps; a probed step's is the same."""
        if self._last is None or self._last[0] or seconds <= 0:
            return
        self.total_seconds += seconds
        self.seconds_since_probe += seconds
        if self._own.add(seconds):
            self._interval = None

    def add_record_time(self, seconds: float, records: int) -> None:
        """What formatting `records` step records together took, with the guards on them: what
        every step pays, whatever the schedule, taken from the budget before probing is spaced."""
        if records <= 0 or seconds <= 0:
            return
        self.total_seconds += seconds
        self._record.add(seconds / records)
        self._interval = None

    def _trouble(self, skipped, nonfinite, scale, next_scale, dtype, act, grad, step) -> tuple[str, str] | None:
        if not skipped and nonfinite is None and act is None and grad is None \
                and (scale is None or next_scale is None or next_scale >= scale):
            return None   # an unprobed clean step: said without a word built
        at = f" at step {step}" if step is not None else ""
        if nonfinite is not None and self.own_verdicts and self.agreed_spacing is not None:
            if skipped:   # GradScaler's, on every rank: the sign they share
                return "skip", f"an update skipped{at}"
            # This rank's own loss or figures, which no collective agreed on: told in the step's
            # words (job/ranks/rank_probes.py), every rank escalating at the boundary that agrees on them.
            self.own_nonfinite = f"a non-finite {NONFINITE_WORDS.get(nonfinite, nonfinite)}{at}"
            return None
        if nonfinite in ("loss", "activations"):
            return "nonfinite", f"a non-finite {NONFINITE_WORDS[nonfinite]}{at}"
        if skipped:
            return "skip", f"an update skipped{at}"
        if nonfinite is not None:
            return "nonfinite", f"non-finite gradients{at}"
        if scale is not None and next_scale is not None and next_scale < scale:
            return "scale_drop", f"the loss scale dropped {scale:g} → {next_scale:g}{at}"
        low = self.least_headroom(dtype, act, grad)
        if low is not None and low[1] < self.alert_bits:
            if self.agreed_spacing is not None:   # this rank's own outputs: put to the ranks' vote
                self.low_headroom = low
                return None
            return "headroom", f"{low[0]} at {low[1]:.1f} bits of headroom"
        return None

    def least_headroom(self, dtype: str, act: list | None, grad: list | None) -> tuple[str, float] | None:
        """The layer with the least headroom (its activations, or its gradients, in bits to the
        dtype's max).

        The gradients are judged unscaled. GradScaler's scale is always dynamic (its growth
        factor must exceed 1): it raises the scale until grad × scale overflows, then halves it,
        so that product sits within a bit or two of the max in every healthy fp16 run, and the
        overflow it makes is a skipped update, a sign of its own. Gradients near the max even
        unscaled are ones no scale of 1 or more can save."""
        top = MAX_FINITE.get(dtype, MAX_FINITE["float32"])
        held = tuple(self.fp32_modules())
        worst: tuple[str, float] | None = None
        for figures in (act, grad):
            for i, v in enumerate(figures or ()):
                if v is None or v == 0:
                    continue
                v = abs(v)
                name = self.names[i] if i < len(self.names) else f"layer {i}"
                limit = MAX_FINITE["float32"] if in_fp32(name, held) else top
                bits = math.log2(limit / v) if math.isfinite(v) else -math.inf
                if worst is None or bits < worst[1]:
                    worst = (name, bits)
        return worst

    # ---- from outside: commands, dtype changes, restores, resumes -------------------------------
    def escalate(self, reason: str, why: str) -> None:
        """Every step from the next one on, for `why` (the adaptive schedule only)."""
        self.clean = 0
        if self.auto and self.escalated is None:
            self._escalate(reason, why)

    def _escalate(self, reason: str, why: str) -> None:
        was = self.mode
        self.escalated = why
        if was != "every":
            self._changes.append(ProbeChange("every", reason, f"probing every step: {why}"))

    def set_mode(self, mode: Mode) -> ProbeChange | None:
        """The `probe` command: `every` pins every step, `auto` lets go (None: nothing changes)."""
        if mode == "every":
            if self.pinned:
                return None
            was, self.pinned = self.mode, True
            change = ProbeChange("every", "command", "probing every step: asked for")
            return change if was != "every" else None
        if not self.pinned and self.escalated is None:
            return None
        self.pinned, self.escalated, self.clean = False, None, 0
        return ProbeChange("auto", "command", f"probing back to {self.describe_budget()}: asked for")

    def drain(self) -> list[ProbeChange]:
        changes, self._changes = self._changes, []
        return changes

    # ---- in words ----------------------------------------------------------------------------
    def describe_budget(self) -> str:
        return f"the budget ({self.budget:g}% of the training time)" if self.auto else f"every {self.every} steps"

    @property
    def asked(self) -> int | str:
        """The schedule as asked for: "auto", or N."""
        return "auto" if self.auto else self.every

    def header_fields(self) -> dict:
        return {"probe_every": self.asked, "probe_budget": self.budget}

    def record_field(self) -> list | None:
        """What a step record carries of the schedule: ["auto", one step in N, the measured
        cost in percent of the training time] or ["every", why]; None for a fixed schedule, as
        planned. A flat list keeps the record on the replay index's fast path."""
        if self.mode == "every":
            return ["every", self.escalated or "asked for"]
        if not self.auto:
            return None
        interval = self.agreed_spacing if self.agreed_spacing is not None else self.interval()
        return ["auto", interval, round(100 * self.share(), 2)]

    def status_field(self) -> list:
        """The schedule in `ctl status`: the record's field, or ["every_n", N] for a fixed one."""
        return self.record_field() or ["every_n", self.every]


def in_fp32(name: str, held: Iterable[str]) -> bool:
    """Whether layer `name` runs in fp32 with the modules `held` there: one of them, or inside one."""
    return any(name == module or name.startswith(module + ".") for module in held)


def observe_step(schedule: ProbeSchedule, result, *, planned: bool) -> None:
    """A StepResult told to the schedule, which the result then carries (`probes`)."""
    f = result.figures
    schedule.observe(planned=planned, duration=result.duration, skipped=result.skipped,
                     nonfinite=result.nonfinite, scale=result.scale, next_scale=result.next_scale,
                     dtype=result.dtype, act=f.act if f else None, grad=f.grad if f else None, step=result.step,
                     calibration=result.calibration)
    result.probes = schedule.record_field()


def dtype_change_reason(before: str, after: str) -> str:
    return f"the dtype changed {SHORT.get(before, before)} → {SHORT.get(after, after)}"

