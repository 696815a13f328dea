"""The autopilot through a framework's callback (`on_nonfinite="isolate"`): Lightning's 16-mixed
on the CPU, the attention overflow of tests/support.py planted in the second block. The loop is
Lightning's: the module goes into fp32 from the next step, verified by the callback's replay."""

from __future__ import annotations

import math

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins import MixedPrecision

from amp_tui.core.jsonsafe import read_float
from amp_tui.integrations.lightning import AmpTuiCallback
from amp_tui.recording.reader import read_session

from frameworks import pl_trainer
from support import ATTENTION_SCRIPT


def test_lightning_isolates_the_attention_from_the_next_step(tmp_path):
    namespace: dict = {}
    exec(ATTENTION_SCRIPT, namespace)

    class Attending(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = namespace["TinyTransformer"]()
            with torch.no_grad():
                self.net.blocks[1].attn.q.weight.mul_(200.0)
                self.net.blocks[1].attn.k.weight.mul_(200.0)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x).float().flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8, 16, generator=g), torch.randint(0, 4, (8, 8), generator=g))
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False, on_nonfinite="isolate")
    trainer = pl_trainer([callback], steps=4, plugins=[MixedPrecision("16-mixed", "cpu")])
    torch.manual_seed(0)
    trainer.fit(Attending(), torch.utils.data.DataLoader(data, batch_size=2))
    session = read_session(tmp_path / "run")
    decisions = [e for e in session.events if e["kind"] == "intervention" and e["source"] == "autopilot"]
    assert [(d["step"], d["action"], d["value"], d["verified"]) for d in decisions] == \
        [(1, "fp32", "net.blocks.1.attn", True)]
    steps = session.steps
    assert [s["skipped"] for s in steps] == [True, False, False, False]
    assert {s["dtype"] for s in steps} == {"float16"}
    assert all(math.isfinite(read_float(s["loss"])) for s in steps[1:])
