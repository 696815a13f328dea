"""amp_tui.monitor's options as one value, checked at the door: the monitor, the framework
callbacks and the tests hand this on instead of a dozen loose keywords, so a new option is one
field here (and one keyword of `amp_tui.monitor`, which the callbacks' signatures follow)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from amp_tui.core.policies import MONITOR_POLICIES, MonitorPolicy, checked
from amp_tui.training.probes.probe_options import ProbeOptions


@dataclass(frozen=True)
class MonitorOptions:
    """What `amp_tui.monitor` documents, keyword by keyword (job/monitor_api.py)."""

    dtype: str | None = None
    run_dir: str | Path | None = None
    probes: ProbeOptions = field(default_factory=ProbeOptions)
    checkpoint_every: int | None = None
    control: bool = True
    announce: bool = True
    tensorboard_dir: str | Path | None = None
    on_nonfinite: MonitorPolicy = "skip"
    forecast_horizon: int = 500
    min_scale: float | None = None
    fp32_modules: str | list[str] | tuple[str, ...] = ()
    wandb: str | bool | None = None       # a W&B project, or True (amp_tui.recording.trackers)
    mlflow: str | bool | None = None      # an MLflow tracking URI, or True
    mlflow_run_id: str | None = None      # the MLflow run to log into (Lightning's MLFlowLogger's)

    def __post_init__(self) -> None:
        checked("on_nonfinite", self.on_nonfinite, MONITOR_POLICIES)
        for name in ("wandb", "mlflow"):
            value = getattr(self, name)
            if not (value is None or isinstance(value, (bool, str, Path))) or value == "":
                raise ValueError(f"{name}={value!r}: " + ("a W&B project name, or True" if name == "wandb"
                                                          else "an MLflow tracking URI, or True"))
        if self.min_scale is not None and not (isinstance(self.min_scale, (int, float))
                                               and 0 < self.min_scale < math.inf):
            raise ValueError(f"min_scale={self.min_scale!r}: the loss scale's floor must be a positive finite number")
        if self.checkpoint_every is not None and not (isinstance(self.checkpoint_every, int)
                                                      and self.checkpoint_every >= 0):
            raise ValueError(f"checkpoint_every={self.checkpoint_every!r}: a whole number of steps (0: never)")

    @classmethod
    def of(cls, *, probe_every: int | str = "auto", probe_budget: float = 1.0, probe_alert_bits: float = 3.0,
           underflow_every: int = 10, fp8_every: int | str | None = None, **given) -> MonitorOptions:
        """From amp_tui.monitor's keywords: the probe options become one ProbeOptions."""
        return cls(probes=ProbeOptions.of(probe_every=probe_every, probe_budget=probe_budget,
                                          probe_alert_bits=probe_alert_bits, underflow_every=underflow_every,
                                          fp8_every=fp8_every),
                   **given)
