"""Demo: a LightningModule under amp-tui, with an fp16 overflow fixed from the dashboard.

A plain Lightning script (a LightningModule, a DataLoader, L.Trainer), plus the one line that
makes amp-tui record it and lets the dashboard steer it:

    L.Trainer(callbacks=[AmpTuiCallback()], precision="16-mixed")

What it reproduces
    One Linear layer, ``amplifier``, has weights ~2e5x the default init, so its outputs reach
    ~1e5..1e6; a LayerNorm right after brings them back to O(1). In fp16 (max 65504) they are
    inf, the LayerNorm makes NaN of them and every loss is NaN: GradScaler skips every update and
    halves its scale, which can't help (the forward overflows). Lightning has no skipped count,
    and its scheduler steps on every skipped update.

Fix it live
    amp-tui run -- python demos/lightning_module.py
    then press d in the dashboard: fp16 -> bf16 (fp32's range; the GradScaler scales by 1), and
    the loss falls from the next step on. The event log names the amplifier.

On the CPU, Lightning turns precision="16-mixed" into bf16-mixed (with a warning); its
MixedPrecision plugin gives the CPU real fp16 autocast and a GradScaler, so this demo uses it
there.

Options: --epochs (default 200), --precision (fp16, bf16 or fp32; default fp16), --gain (2e5;
1000 keeps fp16 finite), --batch-size (64), --lr (1e-3).
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from amp_tui.integrations.lightning import AmpTuiCallback


class OutlierClassifier(L.LightningModule):
    def __init__(self, gain: float, lr: float):
        super().__init__()
        self.inp = nn.Linear(32, 128)
        self.amplifier = nn.Linear(128, 128)
        self.post_norm = nn.LayerNorm(128)
        self.hidden = nn.Linear(128, 128)
        self.head = nn.Linear(128, 10)
        self.lr = lr
        with torch.no_grad():
            self.amplifier.weight.mul_(gain)
            self.amplifier.bias.mul_(gain)

    def forward(self, x):
        h = F.relu(self.inp(x))
        h = self.post_norm(self.amplifier(h))   # |amplifier(h)| ~ 1e5..1e6: inf in fp16
        return self.head(F.relu(self.hidden(h)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10_000)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 32, generator=g) * 4.0
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.add_argument("--gain", type=float, default=2e5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()

    torch.manual_seed(0)
    gpu = torch.cuda.is_available()
    precision = {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}[args.precision]
    if precision == "16-mixed" and not gpu:
        # Lightning would run bf16 on the CPU; its plugin gives fp16 a GradScaler there too.
        chosen = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    else:
        chosen = {"precision": precision}
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="gpu" if gpu else "cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                        callbacks=[AmpTuiCallback()], **chosen)
    loader = DataLoader(synthetic(1024, seed=1), batch_size=args.batch_size, shuffle=True)
    trainer.fit(OutlierClassifier(args.gain, args.lr), loader)


if __name__ == "__main__":
    main()
