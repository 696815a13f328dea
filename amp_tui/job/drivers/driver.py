"""What runs the steps, as the run controller (job/controller.py) sees it. Two drivers implement
it: the engine driver (job/drivers/engine_driver.py) and the hook driver (job/drivers/hook_driver.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from amp_tui.job.checkpoints.run_checkpoints import TrainingState
from amp_tui.training.local_fp32 import LocalFp32
from amp_tui.training.probes.probe_options import ProbeOptions
from amp_tui.training.probes.probe_schedule import ProbeSchedule
from amp_tui.training.step.engine import StepResult
from amp_tui.training.step.guards import Alert
from amp_tui.training.trace.isolation import FailedStep


class Driver(Protocol):
    """What runs the steps, as the controller sees it."""

    training: TrainingState      # what a checkpoint saves and restores (and the step counters)
    local_fp32: LocalFp32
    model: torch.nn.Module       # the model as the user gave it
    optimizer: torch.optim.Optimizer
    probe_schedule: ProbeSchedule   # which steps are probed, told what the run's own work costs
    probe_options: ProbeOptions     # what the schedule and the recurring fp8 what-if were made from
    xray_by: dict                   # who asked for the last step's X-ray (StepResult.xray)
    fp8_by: dict                    # ... and for its fp8 what-if (StepResult.fp8)

    @property
    def failed_step(self) -> FailedStep | None:
        """The last step that went non-finite, kept for the autopilot to replay with a module in
        fp32 (None: none, or a driver that can't replay a step)."""

    def news(self, result: StepResult) -> list[Alert]:
        """What the driver alone can tell about the step just ended, once (the controller raises
        each as an alert)."""

    def description(self) -> dict:
        """The session header's fields that only the driver knows (see `session_header`)."""

    def fp32_root(self) -> torch.nn.Module:
        """The model whose module names `fp32=NAME` matches."""

    def saved_extra(self) -> dict:
        """What a checkpoint holds beyond the training state (e.g. the batches consumed)."""

    def settle(self, *, failed: bool = False, flush: bool = False) -> None:
        """Record what was measured and not recorded yet, before what comes next."""

    def request_xray(self, by: dict | None = None) -> None:
        """Trace the next step op by op; its event names who asked (`by`: source, client)."""

    def request_fp8(self, by: dict | None = None) -> None:
        """The fp8 what-if of the next step; its event names who asked (`by`)."""

    def close(self) -> None:
        """Leave the user's objects as they were given."""
