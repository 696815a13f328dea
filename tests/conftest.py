import json
import math
import textwrap
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def strict_lines(path: Path) -> list[dict]:
    """Every line of a session, parsed with a parser that rejects NaN/Infinity tokens."""
    def reject(token):
        raise ValueError(f"non-standard token {token}")
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        out.append(json.loads(line, parse_constant=reject))
    return out


@pytest.fixture
def write_script(tmp_path):
    def write(body: str, name: str = "train_script.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(body), encoding="utf-8")
        return path
    return write


MLP_SCRIPT = '''
import torch
from torch import nn

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = torch.randn(64, 8)
    ys = xs.sum(1, keepdim=True)
    batches = [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, 64, 16)]
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches}
'''


# Regression targets ~300x the features: a loss of ~1e5-1e6 whose backward overflows fp16 at
# init_scale 65536. ACC is replaced by the micro-batch count.
OVERFLOW_SCRIPT = '''
import torch
from torch import nn

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    xs = torch.randn(64, 8)
    ys = xs.sum(1, keepdim=True) * 300          # a loss of ~1e5-1e6: overflows backward at 65536
    batches = [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, 64, 16)]
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches, "accumulate": ACC}
'''


@pytest.fixture
def mlp_script(write_script):
    return write_script(MLP_SCRIPT)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
