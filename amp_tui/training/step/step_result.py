"""What one step did, as both drivers report it (training/step/outcome.py builds it) and the run
records it (job/records/run_records.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from amp_tui.training.probes.layer_probes import LayerFigures
from amp_tui.training.trace.diagnose import Diagnosis

# Where a step went non-finite: its loss, or its gradients (the loss finite), or on a probed step
# an activation that the loss and the gradients never saw (an fp16 overflow behind a tanh).
NonfiniteKind = Literal["loss", "gradients", "activations"]


@dataclass
class StepResult:
    step: int                     # 0-based iteration index
    loss: float                   # mean over micro-batches; NaN/inf when non-finite
    scale: float | None           # the loss scale used in this step (None: no scaler)
    skipped: bool                 # the optimizer update was not applied
    skipped_total: int
    updates_applied: int
    dtype: str
    micro_batches: int
    nonfinite: NonfiniteKind | None = None
    first_nonfinite_layer: str | None = None
    grad_norm: float | None = None
    lr: float | None = None       # the lr this step's update used (before scheduler.step())
    figures: LayerFigures | None = None
    diagnosis: Diagnosis | None = None
    next_scale: float | None = None  # the scale after scaler.update(): what the next step uses
    duration: float = 0.0
    wall_time: float = field(default_factory=time.time)
    per_rank: Any = None          # several ranks: each rank's figures (job/ranks/rank_figures.py)
    probes: list | None = None    # the probe schedule after this step (ProbeSchedule.record_field)
    op_trace: dict | None = None  # a non-finite step replayed op by op: the op and its fix (step_trace.py)
    xray: dict | None = None      # the step traced op by op on request (request_xray; op_xray.py)
    fp8: dict | None = None       # the step's fp8 what-if on request (request_fp8; fp8/whatif.py)
    fp8_layers: dict | None = None   # the step that entered fp8: its layers and their filter (fp8_training.py)
    eta: list | None = None       # each layer's steps left before the dtype's max (job/records/forecasts.py)
    held_back: bool = False       # amp-tui kept an update with inf/NaN gradients from applying (update_guard.py)
    calibration: bool = False     # a skip of GradScaler finding its scale at the start (calibration.py)
