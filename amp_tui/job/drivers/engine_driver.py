"""The engine driver: the steps of `amp-tui train`, amp-tui's own guarded step over the script's
batches (the loop amp-tui owns), under the run controller (job/controller.py).

With several ranks a probed step's figures come from every rank a step later (its gather is
waited for once the next step's loss check has been answered): until then rank 0 holds the step's
record and every record after it, and writes them in order. `settle()` waits for them at once
where something must see the step recorded first: a pause, a stop, a checkpoint saved or
restored, the end of the run (job/ranks/distributed.py, docs/distributed.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from amp_tui.job.drivers.feed import BatchFeed
from amp_tui.job.ranks.distributed import Ranks, RanksLost, communication_failure
from amp_tui.job.ranks.rank_probes import RankProbes
from amp_tui.job.records.probe_events import announce_probe_changes
from amp_tui.recording.format import step_record
from amp_tui.training.local_fp32 import LocalFp32
from amp_tui.training.probes.probe_schedule import ProbeSchedule
from amp_tui.training.script import ScriptError, TrainSetup, describe_exception
from amp_tui.training.step.engine import GuardedTrainer, LossError, StepResult
from amp_tui.training.step.guards import Alert
from amp_tui.training.trace.isolation import FailedStep

if TYPE_CHECKING:
    from amp_tui.job.config import RunConfig
    from amp_tui.job.controller import RunController


class StepFailure(Exception):
    """A step raised: `message` says which and where, `original` is what it raised."""

    def __init__(self, step: int, message: str, original: BaseException):
        super().__init__(message)
        self.step, self.message, self.original = step, message, original


class EngineDriver:
    """GuardedTrainer over the batch feed; one `step()` per iteration of the controller's loop."""

    def __init__(self, config: RunConfig, setup: TrainSetup, device: torch.device, feed: BatchFeed,
                 ranks: Ranks | None = None):
        self.config = config
        self.setup = setup
        self.feed = feed
        self.ranks = ranks
        self.model = setup.model
        self.optimizer = setup.optimizer
        setup.model.to(device)
        self.trainer = GuardedTrainer(
            ranks.replicate(setup.model) if ranks else setup.model, setup.optimizer, setup.loss_fn,
            device=device, dtype=config.dtype,
            init_scale=config.init_scale, scheduler=setup.scheduler,
            max_grad_norm=setup.max_grad_norm, probes=config.probes,
            fp8_filter=str(config.fp8_filter) if config.fp8_filter else None)
        self.training = self.trainer
        self.probe_options = config.probes
        self.local_fp32 = LocalFp32(setup.model, device.type)
        for pattern in config.fp32_modules:
            self.local_fp32.add(pattern)  # ModuleMatchError names a pattern that matches nothing
        self.trainer.fp8.kept_out = lambda: self.local_fp32.names   # in fp8, an fp32 module isn't
        self.run: RunController | None = None
        self.xray_by: dict = {}   # who asked for the X-ray of the next step (its event says)
        self.fp8_by: dict = {}    # ... for its fp8 what-if
        # Several ranks: the last probed step's figures on their way to rank 0 (what waits for
        # them, and the step's own result), its record held until then.
        self._figures_due: tuple[Callable[..., StepResult], StepResult] | None = None
        self._act_unmeasured_said = False

    def attach(self, run: RunController) -> None:
        self.run = run
        if self.ranks:
            self.trainer.agree_finite = self.ranks.agree_finite
            # Each step's loss check carries what applies at the boundary after it (the step
            # counter has not moved on yet when the check runs).
            self.ranks.upcoming = lambda: run.queued(self.trainer.step_index + 1)
            # ... in DDP's own gradient all-reduce where it can, with the figures.
            self.ranks.carry_in_gradients(self.trainer.model, len(self.trainer.layer_names))
            # The adaptive probe schedule: rank 0's spacing and every rank's headroom, in the words.
            schedule = self.trainer.probe_schedule
            if schedule is not None and schedule.auto:
                self.ranks.probes = RankProbes(schedule, self.ranks.rank)

    # ---- what the controller asks ------------------------------------------------------------
    def description(self) -> dict:
        cfg, setup = self.config, self.setup
        return {"script": str(cfg.script), "argv": cfg.script_argv, "command": cfg.command_line,
                "steps": cfg.steps, "accumulate": setup.accumulate, "max_grad_norm": setup.max_grad_norm,
                **self.trainer.probe_schedule.header_fields(), **cfg.probes.header_fields(),
                "layers": self.trainer.layer_names, "compile": self.trainer.compile_info(),
                "fp8_filter": str(cfg.fp8_filter) if cfg.fp8_filter else None}

    def request_xray(self, by: dict | None = None) -> None:
        self.xray_by = by or {}
        self.trainer.request_xray()

    def request_fp8(self, by: dict | None = None) -> None:
        self.fp8_by = by or {}
        self.trainer.request_fp8()

    def fp32_root(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def probe_schedule(self) -> ProbeSchedule:
        return self.trainer.probe_schedule

    @property
    def failed_step(self) -> FailedStep | None:
        """The last step that went non-finite, kept until the next one starts, for the autopilot to
        replay with a module in fp32 (None: none, or several ranks, where it isn't replayed)."""
        return self.trainer.failed_step

    def saved_extra(self) -> dict:
        """The micro-batches consumed, so a resume reads the data in the same order."""
        return {"micro_batches_consumed": self.feed.consumed}

    def close(self) -> None:
        self.trainer.close()

    # ---- the pre-flight -----------------------------------------------------------------------
    def first_batch(self):
        script = self.config.script
        try:
            return self.feed.peek()
        except ScriptError:
            raise ScriptError(f"'batches' from {script.name} is empty") from None
        except Exception as exc:  # noqa: BLE001 - the user's DataLoader or dataset failed
            raise ScriptError(f"'batches' from {script.name} failed on the first batch: "
                              f"{describe_exception(exc, script)}") from None

    def first_forward(self, batch) -> None:
        """The first step's forward, kept for that step (GuardedTrainer.start_step)."""
        script = self.config.script
        try:
            self.trainer.start_step(batch)
        except LossError as exc:
            raise ScriptError(f"{script.name}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the user's code failed: say where
            raise ScriptError(f"loss_fn in {script.name} failed on the first batch: "
                              f"{describe_exception(exc, script)}") from None

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> None:
        run, step = self.run, self.trainer.step_index
        due = None
        if self.ranks:
            announce_probe_changes(run)   # what the boundary's words changed, from this step on
        try:
            micro = self.feed.take(self.setup.accumulate)  # the user's DataLoader or dataset may raise too
            begun = time.perf_counter()
            result = self.trainer.step(micro)
            # amp-tui's own work on the step starts where its measured duration ends: what the
            # trainer does around the forward, backward and update (asking the schedule, telling
            # it the step) counts with the run's, not in the step's duration.
            after, apart = begun + result.duration, run.budget.apart_seconds
            if self.ranks:
                # The last probed step's gather: every rank issued it before this step's loss
                # check, which has been answered, so it is in (or as good as).
                self.settle()
                if result.nonfinite is None and run.state != "paused":
                    due = self.ranks.gather_later(result, self.trainer.layer_names)
                else:   # rare, and the details need every rank's words; a single step is shown at once
                    result = self.ranks.gather_step(result, self.trainer.layer_names, details=True)
        except (LossError, ScriptError) as exc:
            raise StepFailure(step, f"step {step}: {exc}", exc) from exc
        except Exception as exc:  # noqa: BLE001
            if self.ranks and communication_failure(exc):   # DDP's all-reduce, or one of ours
                lost = RanksLost(self.ranks.lost_message(exc))
                raise StepFailure(step, f"step {step}: {lost}", lost) from exc
            where = describe_exception(exc, self.config.script)
            raise StepFailure(step, f"step {step}: the script raised {where}", exc) from exc
        if due is not None:
            # Recorded once every rank's figures are in; what comes meanwhile is held behind it.
            self._figures_due = (due, result)
        # Batched (a few steps formatted together, at most PUBLISH_INTERVAL late; a non-finite or
        # paused step at once): formatting one between every two steps finds the caches cold, and
        # several ranks keep their order through the recorder's hold instead.
        run.end_step(result, since=after, apart=apart, held=due is not None, batched=not self.ranks)

    def news(self, result: StepResult) -> list[Alert]:
        if not self.trainer.act_unmeasured or self._act_unmeasured_said:
            return []
        self._act_unmeasured_said = True
        return [Alert("act_not_measured", self.trainer.act_unmeasured,
                      cause="the compiled graph was built before amp-tui attached its hooks",
                      fix="leave the first call of the compiled model to amp-tui (none in setup())")]

    def settle(self, *, failed: bool = False, flush: bool = False) -> None:
        """Record the probed step whose figures were on their way from every rank, then what was
        held behind it. Where they can't come (a rank is gone), that step goes unrecorded, as when
        its gather was waited for at once, and what came after it is written all the same; after
        a failure (`failed`, the error already recorded) that is said no more. `flush`: in the
        file now, for whoever reads it next (as while paused)."""
        due, self._figures_due = self._figures_due, None
        if due is None:
            if self.run is not None:
                self.run.publish(flush=flush)   # the steps recorded in a batch, before whatever comes next
            return
        figures, own = due
        run = self.run
        try:
            result = figures(failed=failed)
        except Exception:
            run.recorder.release(None)
            if failed:
                return
            raise
        if run.last_result is own:
            run.last_result = result
        run.recorder.release(step_record(result), flush=flush or run.state == "paused")
