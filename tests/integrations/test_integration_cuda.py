"""The frameworks' own fp16 on a GPU, where they do give it a GradScaler (on the CPU neither does):
the Hugging Face Trainer with fp16=True and Lightning with precision="16-mixed", watched by
AmpTuiCallback. Skipped where no GPU is present; `pytest -m cuda` (bench/gpu_check.sh) runs them.
The same paths run on the CPU in test_integration_transformers.py and test_integration_lightning.py
with a GradScaler handed to the framework by hand."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Callback

from amp_tui.core.jsonsafe import read_float
from amp_tui.integrations import lightning as lightning_integration
from amp_tui.integrations.transformers import AmpTuiCallback
from amp_tui.recording.reader import read_session

from frameworks import at_steps, command, hf_trainer, lightning_module_class, pl_trainer, regression_loader

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")]


def test_the_trainers_fp16_on_a_gpu_has_its_gradscaler_watched_and_s_sets_it(tmp_path):
    trainer = hf_trainer(tmp_path, steps=8, precision="fp16", device="cuda")
    callback = AmpTuiCallback(trainer, run_dir=tmp_path / "run", announce=False)
    trainer.add_callback(callback)
    trainer.add_callback(at_steps({3: "scale=1024"}, lambda: callback.monitor))
    result = trainer.train()
    session = read_session(tmp_path / "run")
    assert isinstance(trainer.accelerator.scaler, torch.amp.GradScaler)   # Accelerate's own
    assert result.global_step == 8 == len(session.steps)
    assert {s["dtype"] for s in session.steps} == {"float16"}
    assert session.steps[3]["scale"] == 1024
    assert not [e for e in session.events if e.get("reason") == "fp16_without_scaler"]


def test_the_trainers_fp16_overflow_on_a_gpu_is_skipped_named_and_fixed_by_d(tmp_path):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16, the fix d switches to")
    overflow_fixed_by_d(tmp_path, hf_trainer(tmp_path, steps=8, precision="fp16", device="cuda"))


def overflow_fixed_by_d(tmp_path, trainer):
    with torch.no_grad():
        trainer.model.transformer.h[0].mlp.c_fc.weight.mul_(1e6)       # the demo's outlier
    callback = AmpTuiCallback(trainer, run_dir=tmp_path / "run", announce=False)
    trainer.add_callback(callback)
    trainer.add_callback(at_steps({3: "dtype=bf16"}, lambda: callback.monitor))
    trainer.train()
    session = read_session(tmp_path / "run")
    steps, events = session.steps, session.events
    assert all(s["skipped"] for s in steps[:3])
    assert all(b["scale"] == a["scale"] / 2 for a, b in zip(steps[:3], steps[1:3]))
    assert [e for e in events if e["kind"] == "nonfinite"][0]["layer"] == "transformer.h.0.mlp.c_fc"
    assert all(s["dtype"] == "bfloat16" and math.isfinite(read_float(s["loss"])) for s in steps[3:])


@pytest.mark.parametrize("optimizer", ["adamw", "fused"])
def test_lightnings_16_mixed_on_a_gpu_skips_by_the_scale_and_s_sets_it(tmp_path, optimizer):
    callback = lightning_integration.AmpTuiCallback(run_dir=tmp_path / "run", announce=False)

    class Plan(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 6:
                callback.monitor.controller.submit(command("scale=4"))
    trainer = pl_trainer([callback, Plan()], steps=10, accelerator="gpu", precision="16-mixed")
    torch.manual_seed(0)
    trainer.fit(lightning_module_class()(gain=300.0, optimizer=optimizer), regression_loader())
    steps = read_session(tmp_path / "run").steps
    assert isinstance(trainer.precision_plugin.scaler, torch.amp.GradScaler)
    skipped = [s for s in steps if s["skipped"]]
    assert steps[0]["skipped"] and {s["dtype"] for s in steps} == {"float16"}
    assert all(b["scale"] == a["scale"] / 2 for a, b in zip(skipped, skipped[1:]))
    assert steps[6]["scale"] == 4
    assert trainer.global_step == 10 == len(steps) == steps[-1]["updates"] + steps[-1]["skipped_total"]
