"""amp-tui: see and steer mixed-precision training live in the terminal.

In a training loop of your own, `amp_tui.monitor` records every step and lets the dashboard
(`amp-tui attach RUN_DIR`) steer it::

    monitor = amp_tui.monitor(model, optimizer, scaler=scaler)
    for batch in loader:
        with monitor.step() as step:
            with monitor.autocast():
                loss = compute_loss(model, batch)
            step.loss = loss
            ...                       # backward, unscale_, clip, scaler.step, scaler.update
        if monitor.should_stop:
            break
    monitor.close()

The guarded step itself (what `amp-tui train` runs) is `amp_tui.GuardedTrainer`. Neither imports
Textual.
"""

__version__ = "0.1.0"

__all__ = ["GuardedTrainer", "Monitor", "MonitorError", "StepResult", "TrainSetup", "__version__", "monitor"]

_LAZY = {"GuardedTrainer": "amp_tui.training.step.engine", "StepResult": "amp_tui.training.step.engine",
         "TrainSetup": "amp_tui.training.script", "monitor": "amp_tui.job.monitor_api",
         "Monitor": "amp_tui.job.monitor", "MonitorError": "amp_tui.job.monitor"}


def __getattr__(name: str):
    # Lazy, so that `amp-tui replay`, `ls` and `report` start without importing torch.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'amp_tui' has no attribute {name!r}")
