"""The case the whole-process benchmark trains, as a script of the script contract.

    amp-tui train bench/cases/train_case.py --headless --dtype bf16 --steps 400 -- --model blocks
    python bench/bare_loop.py bench/cases/train_case.py --dtype bf16 --steps 400 -- --model blocks

Both build the same model (`bench/models.py`, from a seed) with the same AdamW and the same
batches. With AMP_TUI_BENCH_STAMP set to a file name, the first call of loss_fn writes the wall
clock there: the moment the first step's forward starts, in either process (amp-tui's pre-flight
check is that forward).
"""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.models import GPT2_SMALL, BlocksSpec, MlpSpec, build  # noqa: E402

MODELS = {
    "blocks": BlocksSpec(),                              # 24 x (LayerNorm + Linear), width 128
    "mlp": MlpSpec(depth=24, width=256, batch=128),
    "gpt2-small": GPT2_SMALL,
}


def _stamped(loss_fn, path: str):
    """loss_fn, writing the wall clock to `path` on its first call."""
    pending = [True]

    def first_call_stamped(model, batch):
        if pending:
            pending.clear()
            Path(path).write_text(repr(time.time()))
        return loss_fn(model, batch)

    return first_call_stamped


def setup(ctx=None):
    parser = argparse.ArgumentParser(prog="train_case.py")
    parser.add_argument("--model", choices=sorted(MODELS), default="blocks")
    args = parser.parse_args(list(getattr(ctx, "argv", None) or []))
    model, batches, loss_fn, _ = build(MODELS[args.model], "cpu", n_batches=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stamp = os.environ.get("AMP_TUI_BENCH_STAMP")
    return {"model": model, "optimizer": optimizer, "batches": batches,
            "loss_fn": _stamped(loss_fn, stamp) if stamp else loss_fn}
