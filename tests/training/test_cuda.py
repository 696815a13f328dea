"""CUDA/ROCm checks (device "cuda"); skipped where no GPU is present. `pytest -m cuda` runs them."""

import math

import pytest
import torch
from torch import nn

from amp_tui.training.checkpoint import read_checkpoint, save_checkpoint
from amp_tui.training.devices import describe_device
from amp_tui.training.step.engine import GuardedTrainer

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")]


def mse(m, b):
    return nn.functional.mse_loss(m(b[0]), b[1])


def model_on_gpu():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()


def batch(target=1.0):
    return torch.randn(32, 64, device="cuda"), torch.full((32, 1), target, device="cuda")


def test_header_names_the_backend():
    info = describe_device(torch.device("cuda"))
    assert info["type"] == "cuda" and info["name"]
    assert info["backend"] == ("ROCm/HIP" if torch.version.hip else "CUDA")


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_overflow_skips_on_cuda(fused):
    model = model_on_gpu()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    trainer = GuardedTrainer(model, opt, mse, device="cuda", dtype="fp16", init_scale=2.0**40)
    before = [p.detach().clone() for p in model.parameters()]
    result = trainer.step([batch(300.0)])
    assert result.skipped and trainer.scale == 2.0**39
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    trainer.set_scale(16.0)
    assert not trainer.step([batch(300.0)]).skipped


def test_bf16_when_supported():
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    model = model_on_gpu()
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), mse, device="cuda", dtype="bf16")
    result = trainer.step([batch()])
    assert result.scale is None and math.isfinite(result.loss)
    assert all(v is not None for v in result.figures.act)


def test_one_host_transfer_per_probed_step_on_cuda(monkeypatch):
    import sys
    model = model_on_gpu()
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), mse, device="cuda",
                             dtype="fp16", init_scale=256.0)
    trainer.step([batch()])
    counts = {"n": 0}
    for attr in ("tolist", "item", "__float__"):
        real = getattr(torch.Tensor, attr)

        def counted(self, *a, _real=real, **k):
            if "amp_tui" in sys._getframe(1).f_code.co_filename:
                counts["n"] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, attr, counted)
    trainer.step([batch()])
    assert counts["n"] == 2  # the finite-loss check, and every figure at once


def test_checkpoint_round_trip_with_cuda_rng(tmp_path):
    model = model_on_gpu()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    trainer = GuardedTrainer(model, opt, mse, device="cuda", dtype="fp16", init_scale=1024.0)
    trainer.step([batch()])
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scaler_state=trainer.scaler_state(), step=1,
                    dtype="float16")
    expected = torch.rand(3, device="cuda")
    loaded = read_checkpoint(path, model=model, optimizer=opt)
    loaded.apply(model, opt)
    assert torch.equal(torch.rand(3, device="cuda"), expected)
    assert loaded.scaler_state["scale"] == trainer.scaler_state()["scale"]


def test_train_on_cuda_with_a_model_built_on_the_cpu(mlp_script, tmp_path):
    # The contract: setup() builds on the CPU and amp-tui moves the model; the pre-flight check
    # runs on the moved model, with the batch on the device, on the main thread, and step 0's
    # backward on the training thread.
    from amp_tui.cli import main
    from amp_tui.recording.reader import read_session
    run_dir = tmp_path / "run"
    assert main(["train", str(mlp_script), "--headless", "--device", "cuda", "--steps", "3",
                 "--run-dir", str(run_dir)]) == 0
    assert [r["step"] for r in read_session(run_dir).steps] == [0, 1, 2]
