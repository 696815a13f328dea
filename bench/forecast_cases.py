"""Models that show the patterns the forecasts are for (the acceptance cases of the tests and of
bench/forecast_false_alarms.py), trained in a monitored loop of their own:

- `near_half`: a linear loss whose gradient times the scale sits just under half of fp16's max
  (a fixed gradient: 64 rows of ones times 0.6, at a scale of 1024: 39,322 of 65,504). GradScaler
  grows the scale every GROWTH_INTERVAL clean steps, and each growth overflows: one skip.
- `ample`: the same at a scale 64 times lower: every growth fits.
- `growing_logits`: one attention layer without qk normalisation, trained in fp16 with a high
  learning rate to make the attention scores of fixed tokens large: the logits (the scores'
  matmul, q @ k^T, measured as the output of a module of their own) grow steadily until fp16's max.

Each returns the monitor's records.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import amp_tui
from amp_tui.core.commands import parse_action

GROWTH_INTERVAL = 20


def session_records(run_dir) -> list[dict]:
    """The records of a monitored loop's session, parsed strictly (no bare NaN token)."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    lines = (Path(run_dir) / "session.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines if line]


class LinearLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 1, bias=False)

    def forward(self, x):
        return self.head(x)


def scaled_run(run_dir, *, init_scale: float, steps: int, horizon: int | None = None,
               commands: dict[int, str] | None = None, probe_every: int | str = 1) -> list[dict]:
    """A constant gradient (0.6 times 64 rows of ones) under a GradScaler starting at `init_scale`;
    `commands`: a command (`scale=512`) submitted before the step of each key."""
    torch.manual_seed(0)
    model = LinearLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
    x = torch.ones(64, 4)
    extra = {} if horizon is None else {"forecast_horizon": horizon}
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=run_dir, announce=False,
                              probe_every=probe_every, control=False, dtype="fp16", **extra)
    for i in range(steps):
        if i in (commands or {}):
            monitor.controller.submit(parse_action(commands[i]))
        opt.zero_grad()
        with monitor.step() as step:
            with monitor.autocast():
                loss = model(x).float().sum() * 0.6
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    monitor.close()
    return session_records(run_dir)


def near_half(run_dir, steps: int = 70) -> list[dict]:
    return scaled_run(run_dir, init_scale=1024.0, steps=steps)


def ample(run_dir, steps: int = 70) -> list[dict]:
    return scaled_run(run_dir, init_scale=16.0, steps=steps)


class Scores(nn.Module):
    """q @ k^T as a module of its own, so the probes measure the logits (its weight: a temperature
    the optimizer leaves alone)."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()), requires_grad=False)

    def forward(self, q, k):
        return (q @ k.transpose(-1, -2)) * self.temperature


class Attention(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.scores = Scores()

    def forward(self, x):
        logits = self.scores(self.q(x), self.k(x))
        return torch.softmax(logits.float(), dim=-1).to(x.dtype) @ self.v(x)


def growing_logits(run_dir, *, steps: int = 195, lr: float = 3e-3, horizon: int = 100) -> list[dict]:
    """The logits of fixed tokens pushed up by a loss that rewards confident attention (each
    token attends to itself): under SGD, q's weights grow with k's and k's with q's, so q·k grows
    by a steady factor a step until it passes fp16's max."""
    torch.manual_seed(0)
    model = Attention()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    x = torch.randn(1, 8, 16) * 4
    target = torch.arange(8)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=run_dir, announce=False, probe_every=1,
                              control=False, dtype="fp16", forecast_horizon=horizon)
    for _ in range(steps):
        opt.zero_grad()
        with monitor.step() as step:
            with monitor.autocast():
                logits = model.scores(model.q(x), model.k(x))[0].float()
                loss = nn.functional.cross_entropy(logits, target) - 0.1 * logits.diagonal().mean()
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if monitor.should_stop:
            break
    monitor.close()
    return session_records(run_dir)


# The same attention for `amp-tui train` (run with init_scale=256 and every step probed).
GROWING_SCRIPT = '''
import sys
import torch
from torch import nn

sys.path.insert(0, ROOT)
from bench.forecast_cases import Attention

def setup(ctx=None):
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(1, 8, 16) * 4
    target = torch.arange(8)
    def loss_fn(model, batch):
        logits = model.scores(model.q(batch), model.k(batch))[0].float()
        return nn.functional.cross_entropy(logits, target) - 0.1 * logits.diagonal().mean()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": [x]}
'''


def growing_script(folder) -> Path:
    path = Path(folder) / "growing_logits.py"
    path.write_text(GROWING_SCRIPT.replace("ROOT", repr(str(Path(__file__).resolve().parents[1]))),
                    encoding="utf-8")
    return path
