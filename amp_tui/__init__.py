"""amp-tui: see and steer mixed-precision training live in the terminal.

The engine (guarded step, precision policy, probes, checkpoints, commands) is usable as a library
from a user's own loop and never imports Textual::

    from amp_tui import GuardedTrainer
    trainer = GuardedTrainer(model, optimizer, loss_fn, device="cpu", dtype="float16")
    for batch in batches:
        result = trainer.step([batch])
"""

import warnings

__version__ = "0.1.0"

# The CPU build of torch warns at import when NumPy is absent; amp-tui never needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from amp_tui.engine import GuardedTrainer, StepResult  # noqa: E402
from amp_tui.script import TrainSetup  # noqa: E402

__all__ = ["GuardedTrainer", "StepResult", "TrainSetup", "__version__"]
