"""`amp-tui compare`: validate AMP dtypes against an fp32 reference, then measure what they buy.

The method is the one docs/compare.md describes: criteria fixed before the run (`criteria`), the
fp32 reference and each dtype on the same eval batches, judged on scores and on decisions with
near-ties kept apart (`decisions`, `validation`), then, for the dtypes that passed, lean timed
training steps and peak memory against fp32 (`speed`, `memory`). `results` holds what they find
and `render` prints it; the command line is amp_tui.cli.compare's.

As a library: `validate()` and `measure_speed()` take a `TrainSetup`. Importing this package
does not import torch; those two bring it in on first use.
"""

from amp_tui.compare.criteria import Criteria, MaxFlips

__all__ = ["Criteria", "DtypeResult", "MaxFlips", "Reference", "Speed", "SpeedRun", "Validation",
           "measure_speed", "validate"]

_LAZY = {"validate": "amp_tui.compare.validation", "measure_speed": "amp_tui.compare.speed",
         **dict.fromkeys(("DtypeResult", "Reference", "Speed", "SpeedRun", "Validation"), "amp_tui.compare.results")}


def __getattr__(name: str):
    # Lazy, so that building the CLI's parser (which imports compare.criteria) stays torch-free,
    # and every command (train too) builds it without importing the results' classes.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'amp_tui.compare' has no attribute {name!r}")
