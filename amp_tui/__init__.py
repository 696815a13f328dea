"""amp-tui: see and steer mixed-precision training live in the terminal.

The engine (guarded step, precision policy, probes, checkpoints, commands) is usable as a library
from a user's own loop and never imports Textual::

    from amp_tui import GuardedTrainer
    trainer = GuardedTrainer(model, optimizer, loss_fn, device="cpu", dtype="float16")
    for batch in batches:
        result = trainer.step([batch])
"""

__version__ = "0.1.0"

__all__ = ["GuardedTrainer", "StepResult", "TrainSetup", "__version__"]

_LAZY = {"GuardedTrainer": "amp_tui.training.engine", "StepResult": "amp_tui.training.engine",
         "TrainSetup": "amp_tui.training.script"}


def __getattr__(name: str):
    # Lazy, so that `amp-tui replay`, `ls` and `report` start without importing torch.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'amp_tui' has no attribute {name!r}")
