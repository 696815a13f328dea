"""The autopilot of `--on-nonfinite isolate` (and `amp_tui.monitor(on_nonfinite="isolate")`): the
smallest change that makes a failing step finite, made for the user, said, and undoable.

- A forward overflow (a non-finite loss or activation) in a known module (the event's `op_module`,
  else the module the probes or the checked pass saw first, `origin`): that module in local fp32,
  the same switch as `--fp32-modules` and `fp32=MODULE`. Under `amp-tui train` the failing step is
  replayed with it first; when the step is still not finite, the enclosing module is tried, and so
  on, up to `widen` widenings; then the dtype ladder's next rung. A loop the user owns can't be
  rewound: there the module goes into fp32 from the next step, and an overflow before a finite
  step has come widens the same way.
- A backward overflow at a loss scale: the scale is lowered as GradScaler's backoff does (halved;
  GradScaler has already done it when it skipped the step), and said.
- An isolation after which the loss keeps growing (past twice its level before it) has diverged:
  down the ladder, and with `--rollback` from the newest checkpoint saved before the isolation.

Every decision is an `intervention` with `"source": "autopilot"`; `undo` (u, `ctl RUN undo`) puts
the last one's `before` back. The guard's own ladder (a streak, a skip storm) goes through the
autopilot too. The controller calls `after_step` after the guards, and `undo` is a handler.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from amp_tui.core import precision
from amp_tui.core.commands import Command, Outcome
from amp_tui.core.numfmt import scale_text
from amp_tui.job.records.run_records import nonfinite_fields
from amp_tui.job.run_context import RunContext
from amp_tui.job.steering import command_handlers as handlers
from amp_tui.training.step.autocast import unsupported_reason
from amp_tui.training.step.engine import PrecisionRefused, StepResult
from amp_tui.training.step.guards import GROWTH, LOSS_RUN, GuardConfig, LadderMove, LossTrend, next_rung
from amp_tui.training.trace.isolation import widening

SOURCE = "autopilot"
MOST_MODULES = 8   # modules one isolation puts in fp32 together before it widens instead
FORWARD = ("loss", "activations")



@dataclass
class Decision:
    """One of the autopilot's changes, as `undo` needs it: what it changed and what was there."""
    action: str     # "fp32", "scale" or "dtype"
    before: dict
    what: str       # in a few words: "attn in fp32", "loss scale 65536 → 32768", "fp16 → bf16"


class Autopilot:
    """Every run has one; it decides only when `on` (--on-nonfinite isolate). Off, the guard's
    ladder moves go through it unchanged."""

    def __init__(self, run: RunContext, on: bool, config: GuardConfig):
        self.run = run
        self.on = on
        self.widen = max(0, int(config.isolate_widen))
        self.rollback = config.rollback
        self.decisions: list[Decision] = []
        self._acted_at: int | None = None        # the last step a module or the dtype answered
        self._unproven = 0                       # isolations applied since the last finite step
        self._trend = LossTrend()                # the loss before the current isolation
        self._isolated_at: int | None = None     # the step the current isolation answered
        self._since: collections.deque[float] = collections.deque(maxlen=LOSS_RUN)

    # ---- what the controller calls -------------------------------------------------------
    def after_step(self, result: StepResult, move: LadderMove | None) -> None:
        """A recorded step, read through its non-finite event's fields (the same whichever driver
        ran it: an `op_module` where the step was replayed, else the `origin` the probes saw), and
        the guard's ladder move for it (a streak of non-finite steps, a skip storm) if any."""
        if not self.on:
            if move is not None:
                handlers.fall_back(run=self.run, move=move)
            return
        self._answer(result)
        if move is not None and self._acted_at != result.step:
            # the ladder under the autopilot is its decision, unless an isolation answered this step
            self._fall_back(result, move.reason, rollback_before=move.rollback_before)

    def _answer(self, result: StepResult) -> None:
        event = nonfinite_fields(result) if result.nonfinite else None
        if event is None:
            self._unproven = 0 if not result.skipped else self._unproven
            self._watch_divergence(result)
            return
        if event.get("where") in FORWARD or event.get("op_phase") == "forward":
            self._isolate(result, event)
        elif event.get("where") == "gradients" and result.scale is not None:
            self._lower_scale(result)

    # ---- the forward: a module in fp32 ---------------------------------------------------
    def _isolate(self, result: StepResult, event: dict) -> None:
        module = event.get("op_module") or event.get("origin") or event.get("layer")
        if not module:
            return   # the overflow's module is unknown (an unprobed step): the next one may say
        local, root = self.run.local_fp32, self.run.driver.fp32_root()
        chain = widening(root, str(module))
        held = local.names
        chain = [m for m in chain if not _covered(m, held)]
        failed = self.run.driver.failed_step
        if failed is not None and result.step == self.run.step_index - 1:
            self._isolate_verified(result, module, chain, failed, _verdicts(event))
        else:
            self._isolate_next_step(result, module, chain, _verdicts(event))

    def _isolate_verified(self, result, module, chain, failed, known: dict[str, bool]) -> None:
        """amp-tui train: the failing step replayed with each candidate; the first finite is kept
        (the op trace's own replay of the op's module in fp32 counts: it ran on the same state).
        Where the step stays non-finite because another op overflows in a module of its own (the
        next block's attention, in a model whose every block overflows alike), that module joins
        the candidate instead of widening it: the smallest set of modules in fp32, up to
        MOST_MODULES, before the enclosing ones."""
        root = self.run.driver.fp32_root()
        widened = len(widening(root, str(module))) - len(chain)
        kept: list[str] = []   # modules that stay in fp32 while another one is looked for
        tried: list[str] = []
        while chain and widened <= self.widen:
            candidate, names = chain[0], [*kept, chain[0]]
            if not kept and candidate in known:
                finite, next_module = known[candidate], None
            else:
                finite, _, next_module = failed.replay_with_fp32(names)
            if finite:
                why = f"step {result.step} replayed finite with {' and '.join(names)} in fp32" + (
                    f"; with {', then '.join(tried)} in fp32 it stayed non-finite" if tried else "")
                self._apply_fp32(result, names, widened, verified=True, why=why)
                return
            # A module of its own: neither inside the candidates nor around one (an op in the
            # enclosing module's own forward is the widening's to answer).
            if next_module is not None and not _covered(next_module, names) \
                    and not any(_covered(n, [next_module]) for n in names) and len(names) < MOST_MODULES:
                kept = names   # this op is answered; the next overflow is another module's
                held = [*self.run.local_fp32.names, *kept]
                chain = [m for m in widening(root, next_module) if not _covered(m, held)]
                continue
            tried.append(" and ".join(names))
            chain = chain[1:]
            widened += 1
        self._fall_back(result, f"step {result.step} stayed non-finite with {', then '.join(tried)} in fp32 "
                                f"(--isolate-widen {self.widen})" if tried else
                        f"no module around {module} left to put in fp32 (--isolate-widen {self.widen})")

    def _isolate_next_step(self, result, module, chain, known: dict[str, bool]) -> None:
        """A loop that can't be rewound: the module in fp32 from the next step (verified where the
        event's own replay found the step finite with it); an overflow before a finite step came
        counts as a widening."""
        widened = self._unproven
        if not chain or widened > self.widen:
            held = ", ".join(self.run.local_fp32.names) or module
            self._fall_back(result, f"step {result.step} is still non-finite with {held} in fp32, and "
                                    f"--isolate-widen {self.widen} allows no wider module")
            return
        replayed = "; the replay of this step was finite with it" if chain[0] in known else ""
        self._apply_fp32(result, [chain[0]], widened, verified=True if chain[0] in known else None,
                         why=f"applied from the next step: this loop can't be rewound to train this one again"
                             f"{replayed}")

    def _apply_fp32(self, result: StepResult, modules: list[str], widened: int, *, verified: bool | None,
                    why: str) -> None:
        local = self.run.local_fp32
        before = {"fp32_modules": local.names}
        for module in modules:
            for inside in [n for n in local.names if n.startswith(module + ".")]:
                local.remove(inside)   # widened: the enclosing module holds it now
            local.add(module)
        self.run.training.discard_started_step()   # it ran under the old autocast policy
        short = precision.SHORT[result.dtype]
        named = " and ".join(modules)
        message = (f"autopilot: {named} now in fp32, {short} everywhere else: {why}"
                   + (f" (widened {widened}: --isolate-widen {self.widen})" if widened else ""))
        self._record("fp32", ",".join(modules), before, {"fp32_modules": local.names}, message,
                     f"{named} in fp32", result,
                     reason=f"a non-finite {result.nonfinite} in {result.dtype} at step {result.step}",
                     verified=verified, widened=widened)
        self._unproven += 1
        if self._isolated_at is None:
            self._isolated_at = result.step
            self._since.clear()

    # ---- the backward: the scale -----------------------------------------------------------
    def _lower_scale(self, result: StepResult) -> None:
        now = self.run.precision.scale
        if now is None:
            return
        if now >= result.scale:   # nothing lowered it (a scaler that doesn't back off, a --min-scale)
            try:
                self.run.precision.set_scale(result.scale / 2.0)
            except PrecisionRefused:
                return
            now = self.run.precision.scale
        before = {"dtype": result.dtype, "scale": result.scale}
        was, is_now = scale_text(result.scale), scale_text(now)
        message = (f"autopilot: loss scale {was} → {is_now}: the backward overflowed at "
                   f"{was} (halved, as GradScaler's backoff does)")
        self._record("scale", now, before, {"dtype": result.dtype, "scale": now}, message,
                     f"loss scale {was} → {is_now}", result,
                     reason=f"non-finite gradients at scale {was}")

    # ---- the ladder -----------------------------------------------------------------------
    def _fall_back(self, result: StepResult, why: str, *, rollback_before: int | None = None) -> None:
        target = next_rung(result.dtype, unsupported_reason(self.run.device, "bfloat16") is None)
        if target is None:
            return   # fp32 already: the guards' alerts say what's left
        before = self.run.precision.describe()
        handlers.fall_back(run=self.run, move=LadderMove(target, why, rollback_before), source=SOURCE)
        self.decisions.append(Decision("dtype", before, f"{precision.SHORT[result.dtype]} → "
                                                        f"{precision.SHORT[target]}"))
        self._acted_at = result.step
        self._unproven, self._isolated_at = 0, None

    def _watch_divergence(self, result: StepResult) -> None:
        """The loss before an isolation is its reference (an isolation at the very start: its first
        LOSS_RUN losses after it); after it, LOSS_RUN finite losses in a row above GROWTH times
        that level is a divergence."""
        if self._isolated_at is None or not self._trend.known:
            self._trend.add(result.loss)
            return
        if math.isfinite(result.loss):
            self._since.append(abs(result.loss))
        floor = self._trend.floor
        if self._trend.known and len(self._since) == LOSS_RUN and min(self._since) > GROWTH * floor:
            step = self._isolated_at
            self._fall_back(result, f"the loss diverged after the isolation of step {step} "
                                    f"({floor:.3g} → {self._since[-1]:.3g})",
                            rollback_before=step if self.rollback else None)

    def _record(self, action: str, value, before: dict, after: dict, message: str, what: str,
                result: StepResult, **fields) -> None:
        # between steps: numbered as the step it applies to, the next one
        self.run.event("intervention", message, step=result.step + 1, action=action, value=value,
                       source=SOURCE, before=before, after=after, **fields)
        self.decisions.append(Decision(action, before, what))
        if action == "fp32":
            self._acted_at = result.step


def _covered(module: str, held) -> bool:
    """`module` is in fp32 already: one of `held`, or inside one."""
    return any(module == h or module.startswith(h + ".") for h in held)


def _verdicts(event: dict) -> dict[str, bool]:
    """The modules the op trace already replayed the step with in fp32 and found it finite. Only
    those: its replay has the backward at the step's scale in it too, where a forward overflow is
    judged on the forward alone (a backward that overflows the scale is GradScaler's to answer)."""
    out = {}
    for tried in event.get("fixes_tried") or ():
        flag = str(tried.get("fix") or "")
        if tried.get("verified") and flag.startswith("--fp32-modules '") and flag.endswith("'"):
            out[flag[len("--fp32-modules '"):-1]] = True
    return out


# ---- undo: u, ctl RUN undo ---------------------------------------------------------------------
NO_AUTOPILOT = ("undo takes back the autopilot's last decision, and this run has none "
                "(--on-nonfinite isolate, or amp_tui.monitor(on_nonfinite='isolate'))")


def undo(run: RunContext, command: Command) -> Outcome:
    """Put the autopilot's last decision's `before` back: the modules in fp32, the scale or the dtype."""
    pilot = run.autopilot
    if not pilot.on:
        return run.refused(command, NO_AUTOPILOT)
    if not pilot.decisions:
        return run.refused(command, "nothing to undo: the autopilot has made no decision yet"
                           if not pilot.run.nonfinite_events else "nothing to undo: every decision "
                           "of the autopilot is undone already")
    decision = pilot.decisions.pop()
    try:
        before, after = _put_back(run, decision)
    except PrecisionRefused as exc:
        pilot.decisions.append(decision)
        return run.refused(command, f"undo refused: {exc}")
    return run.intervention(command, before, after, f"undid the autopilot's {decision.what}")


def _put_back(run: RunContext, decision: Decision) -> tuple[dict, dict]:
    if decision.action == "fp32":
        local = run.local_fp32
        before = {"fp32_modules": local.names}
        for name in set(local.names) - set(decision.before["fp32_modules"]):
            local.remove(name)
        for name in set(decision.before["fp32_modules"]) - set(local.names):
            local.add(name)
        run.training.discard_started_step()
        return before, {"fp32_modules": local.names}
    if decision.action == "scale":
        change = run.precision.set_scale(decision.before["scale"])
    else:
        change = run.training.set_dtype(decision.before["dtype"])
    return change["before"], change["after"]
