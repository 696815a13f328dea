"""Demo: your own training loop under amp-tui, with an fp16 overflow fixed from the dashboard.

A plain PyTorch script: argparse, a Dataset and a DataLoader, its own loop with torch.amp's
GradScaler, an evaluation pass every few epochs, its own logging. Three lines make amp-tui watch
it: `amp_tui.monitor(...)`, `with monitor.step() as step:` around a step and `monitor.autocast()`
around the forward (plus `step.loss = loss` and the `should_stop` check).

What it reproduces
    One Linear layer, ``amplifier``, has weights ~2e5x the default init, so its outputs reach
    ~1e5..1e6; a LayerNorm right after brings them back to O(1). In fp16 (max 65504) they are inf,
    the LayerNorm makes NaN of them and every loss is NaN: GradScaler skips every update and
    halves its scale each step, which can't help (it is the forward that overflows).

Fix it live
    amp-tui run -- python demos/own_loop.py
    then press d in the dashboard: fp16 -> bf16 (fp32's range), and the loss falls from the next
    step on. Without amp-tui, `python demos/own_loop.py` runs as any script does (it prints how to
    attach a dashboard to it: amp-tui attach RUN_DIR).

Options: --epochs (default 40), --batch-size (64), --lr (1e-3), --gain (2e5; 1000 keeps fp16
finite), --dtype (fp16, bf16 or fp32: what monitor.autocast() starts with).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import amp_tui


class OutlierMLP(nn.Module):
    def __init__(self, in_dim: int, width: int, classes: int, gain: float):
        super().__init__()
        self.inp = nn.Linear(in_dim, width)
        self.amplifier = nn.Linear(width, width)
        self.post_norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)
        with torch.no_grad():
            self.amplifier.weight.mul_(gain)
            self.amplifier.bias.mul_(gain)

    def forward(self, x):
        h = F.relu(self.inp(x))
        h = self.post_norm(self.amplifier(h))   # |amplifier(h)| ~ 1e5..1e6: inf in fp16
        return self.head(F.relu(self.hidden(h)))


def synthetic(n: int, in_dim: int, classes: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(in_dim, classes, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, in_dim, generator=g) * 4.0
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def evaluate(model, loader, dtype) -> float:
    model.eval()
    right = total = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for x, y in loader:
            right += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    model.train()
    return right / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gain", type=float, default=2e5)
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    args = p.parse_args()

    torch.manual_seed(0)
    train = DataLoader(synthetic(1024, 32, 10, seed=1), batch_size=args.batch_size, shuffle=True)
    held_out = DataLoader(synthetic(256, 32, 10, seed=2), batch_size=256)
    model = OutlierMLP(32, 128, 10, args.gain)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train))
    scaler = torch.amp.GradScaler("cpu", enabled=args.dtype == "fp16")

    with amp_tui.monitor(model, optimizer, scaler=scaler, scheduler=scheduler, dtype=args.dtype) as monitor:
        for epoch in range(args.epochs):
            for x, y in train:
                optimizer.zero_grad(set_to_none=True)
                with monitor.step() as step:
                    with monitor.autocast():
                        loss = F.cross_entropy(model(x), y)
                    step.loss = loss
                    scaler.scale(loss).backward()
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(optimizer)
                    scaler.update()
                if not monitor.last_skipped:   # a skipped update doesn't move the schedule on
                    scheduler.step()
                if monitor.should_stop:
                    break
            if monitor.should_stop:
                break
            if epoch % 5 == 4:
                print(f"epoch {epoch + 1}: loss {loss.item():.4f}, held-out accuracy "
                      f"{evaluate(model, held_out, torch.float32):.3f}", flush=True)


if __name__ == "__main__":
    main()
