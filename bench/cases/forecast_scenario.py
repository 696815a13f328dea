"""One scenario of the forecasts' family (bench/forecast_scenarios.py) as a script of the script
contract, for `amp-tui train`:

    amp-tui train bench/cases/forecast_scenario.py --dtype fp16 --steps 600 -- --model transformer --rate 0.03
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.forecast_scenarios import Scenario, build  # noqa: E402


def setup(ctx=None):
    model, batches, optimizer = build(Scenario.from_argv(getattr(ctx, "argv", None)))
    return {"model": model, "optimizer": optimizer, "batches": batches,
            "loss_fn": lambda model, batch: model.loss(batch)}
