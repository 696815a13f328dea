"""`amp_tui.monitor(model, optimizer, ...)`: the user's own loop watched, every option in one
signature and one docstring. What it returns, and how the loop is watched, is job/monitor.py's
`Monitor`; see its module docstring for the loop.
"""

from __future__ import annotations

from pathlib import Path

import torch

from amp_tui.job.monitor import Monitor
from amp_tui.job.monitor_options import MonitorOptions

__all__ = ["monitor"]


def monitor(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scaler=None, scheduler=None,
            dtype: str | None = None, run_dir: str | Path | None = None, probe_every: int | str = "auto",
            probe_budget: float = 1.0, probe_alert_bits: float = 3.0, underflow_every: int = 10,
            checkpoint_every: int | None = None, control: bool = True, announce: bool = True,
            tensorboard_dir: str | Path | None = None, on_nonfinite: str = "skip",
            forecast_horizon: int = 500, min_scale: float | None = None,
            fp32_modules: str | list[str] = (), fp8_every: int | str | None = None,
            wandb: str | bool | None = None, mlflow: str | bool | None = None) -> Monitor:
    """Watch the user's own loop; see the module docstring (and docs/user-guide.md, "Your own loop").

    `dtype`: what `monitor.autocast()` applies to start with (fp16, bf16, fp32); by default what
    the loop already does: fp16 when an enabled GradScaler is given, else fp32 (autocast off until
    `d` or `ctl RUN dtype=...` switches it). `fp32_modules`: modules run in fp32 from the first
    step, as `amp-tui train --fp32-modules` does (a name or an fnmatch pattern such as
    'blocks.*.attn', or a list of them; `ctl RUN fp32=...` and the dashboard add more).
    `run_dir`: where the session goes (default: $AMP_TUI_RUN_DIR, set by `amp-tui run`, or
    runs/<time>-<script>). `probe_every`: "auto" (per-layer figures spaced so that they and the
    step records cost at most `probe_budget` percent of the training time, every step from the first sign of trouble,
    a layer within `probe_alert_bits` of the dtype's max among them) or N (every N steps).
    `announce`: print one line saying how to attach. `tensorboard_dir`: also write the recording
    there as TensorBoard event files, live (pip install 'amp-tui[tensorboard]'). `on_nonfinite`:
    "skip" (GradScaler's way) or "isolate" (the autopilot, job/steering/autopilot.py: an overflowing module in
    fp32 from the next step, the scale lowered and said). `forecast_horizon`: a layer whose headroom
    forecast says it reaches the dtype's max within this many steps raises an alert (see
    docs/session-format.md, "Forecasts"). `min_scale`: the loss scale's floor (default 2**-24): the
    loop's GradScaler is never let below it (at 0 it would apply NaN updates), with an alert when it
    binds. `fp8_every`: the fp8 what-if of a step (as `ctl RUN fp8`) every N steps, or "auto" (at most
    a quarter of `probe_budget`); None: only when asked (docs/fp8.md). `wandb`: also log the run to
    W&B, into the active run (`wandb.run`) or a new one in this project (True: $WANDB_PROJECT or
    "amp-tui"; pip install 'amp-tui[wandb]'). `mlflow`: the same to MLflow, at this tracking URI
    (True: MLflow's own), into the active run there or a new one (pip install 'amp-tui[mlflow]');
    see docs/trackers.md."""
    options = MonitorOptions.of(
        dtype=dtype, run_dir=run_dir, probe_every=probe_every, probe_budget=probe_budget,
        probe_alert_bits=probe_alert_bits, underflow_every=underflow_every, checkpoint_every=checkpoint_every,
        control=control, announce=announce, tensorboard_dir=tensorboard_dir, on_nonfinite=on_nonfinite,
        forecast_horizon=forecast_horizon, min_scale=min_scale, fp32_modules=fp32_modules, fp8_every=fp8_every,
        wandb=wandb, mlflow=mlflow)
    return Monitor(model, optimizer, options, scaler=scaler, scheduler=scheduler)
