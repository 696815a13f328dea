"""A model sharded with FSDP2 by a framework, watched by its callback: Lightning's
ModelParallelStrategy (`configure_model` calling `fully_shard`) in 2 ranks on the CPU with gloo.

The Hugging Face Trainer's FSDP2 (Accelerate's plugin) is not tested here: on the CPU Accelerate
keeps its FSDP plugin only for GPU-like distributed types, so a CPU run under torchrun trains in
DDP instead (docs/integrations.md says so). The job is bounded by a timeout: a hang fails the test.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from amp_tui.recording.reader import read_session

from support import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

# fp16 through Lightning's MixedPrecision plugin with a GradScaler whose first scales overflow the
# backward (ModelParallelStrategy refuses precision="16-mixed" by name, not the plugin). Each
# rank's data differs; each rank prints the skips and scales its own GradScaler saw.
LIGHTNING_FSDP_SCRIPT = '''
import json, sys
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
import lightning as L
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from amp_tui.integrations.lightning import AmpTuiCallback


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(8, 16), nn.Linear(16, 1)

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.first, mesh=mesh)
        fully_shard(self.last, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.last(torch.relu(self.first(x))).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Scales(L.Callback):
    """Each step's scale after it, and each layer's whole gradient and weight maxima as the
    optimizer gets them (full_tensor(): a collective every rank joins)."""

    def __init__(self):
        self.seen, self.whole = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        layers = [pl_module.first, pl_module.last]
        self.whole.append({kind: [max(t.full_tensor().abs().max().item() for t in tensors) for tensors in
                                  ([p.grad for p in m.parameters()] if kind == "grad" else list(m.parameters())
                                   for m in layers)]
                           for kind in ("grad", "weight")})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(trainer.precision_plugin.scaler.get_scale())


torch.manual_seed(0)
xs = torch.randn(64, 8)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, xs.sum(1)), batch_size=4)
scales = Scales()
trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=8, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**20))],
                    callbacks=[AmpTuiCallback(run_dir=sys.argv[1], probe_every=1, control=False), scales])
trainer.fit(Net(), loader)
print(f"rank {trainer.global_rank} scales {json.dumps(scales.seen)}", flush=True)
if trainer.global_rank == 0:
    print(f"whole {json.dumps(scales.whole)}", flush=True)
'''


def test_lightning_model_parallel_strategy_is_watched_on_both_ranks(write_script, tmp_path):
    script = write_script(LIGHTNING_FSDP_SCRIPT, "train_lightning.py")
    run_dir = tmp_path / "run"
    done = torchrun(str(script), str(run_dir), cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "not watching" not in out
    session = read_session(run_dir)
    header = session.header
    assert header["world_size"] == 2 and header["dtype"] == "float16"
    assert header["coordination"] == "collectives: the model is sharded with FSDP2 (fully_shard)"
    assert header["layers"] == ["first", "last"] and len(session.steps) == 8
    for r in session.steps:
        assert len(r["rank_loss"]) == 2
        assert all(len(r["layers"][kind]) == 2 for kind in ("act", "grad", "weight"))
    skipped = [r["skipped"] for r in session.steps]
    assert any(skipped) and not all(skipped), skipped   # the first scales overflow, then it trains
    updated = [r for r in session.steps if not r["skipped"]]
    assert all(math.isfinite(g) and g > 0 for r in updated for g in r["layers"]["grad"] + r["layers"]["weight"])
    # Both ranks' GradScalers skipped and halved together (found_inf reduced through the DTensors),
    # and the recorded scales are theirs.
    scales = {rank: json.loads(seen) for rank, seen in re.findall(r"rank (\d) scales (\[[^\]]*\])", out)}
    assert set(scales) == {"0", "1"} and scales["0"] == scales["1"], out
    assert [r["next_scale"] for r in session.steps] == scales["0"]
    # Each layer's figures over the shards are the whole layer's, as the optimizer got it.
    whole = json.loads(re.search(r"^whole (.*)$", out, flags=re.M).group(1))
    assert len(whole) == len(session.steps)
    for r, seen in zip(session.steps, whole):
        if not r["skipped"]:
            for kind in ("grad", "weight"):
                assert all(math.isclose(a, b, rel_tol=2e-3) for a, b in zip(r["layers"][kind], seen[kind])), (r, seen)
