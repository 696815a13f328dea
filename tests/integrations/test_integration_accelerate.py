"""amp_tui.monitor inside an Accelerate-driven loop: the prepared optimizer and model passed as
they are, accelerator.backward, gradient accumulation with accelerator.accumulate, `d` switching
what the prepared forward runs in, and fp16 with a GradScaler (its skips, its scale, `s`)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn

import amp_tui
from amp_tui.recording.reader import read_session

from frameworks import command


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Accelerate keeps one state per process; each test starts its own Accelerator."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def prepared(precision: str, *, accumulate: int = 1, gain: float = 1.0, cpu_fp16_scale: float | None = None):
    accelerator = Accelerator(cpu=True, mixed_precision=precision, gradient_accumulation_steps=accumulate)
    if cpu_fp16_scale is not None:
        # What Accelerate gives fp16 on a GPU (on the CPU it gives none): a GradScaler, and
        # prepare() wrapping the forward in fp16 autocast.
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=cpu_fp16_scale)
        accelerator.native_amp = True
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True) * gain)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def train(accelerator, model, optimizer, loader, monitor, *, before=None, clip=False):
    """The loop of Accelerate's documentation, with the monitor's step around each batch."""
    for i, (x, y) in enumerate(loader):
        if before is not None:
            before(i)
        with accelerator.accumulate(model):
            with monitor.step() as step:
                loss = nn.functional.mse_loss(model(x), y)
                step.loss = loss
                accelerator.backward(loss)
                if clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        if monitor.should_stop:
            break


def test_an_accelerate_loop_with_accumulation_records_one_step_per_update(tmp_path):
    accelerator, model, optimizer, loader = prepared("bf16", accumulate=4)
    with amp_tui.monitor(model, optimizer, scaler=accelerator.scaler, run_dir=tmp_path / "run",
                         announce=False, probe_every=1) as monitor:
        train(accelerator, model, optimizer, loader, monitor)
    session = read_session(tmp_path / "run")
    assert [(s["step"], s["micro_batches"], s["updates"]) for s in session.steps] == \
        [(i, 4, i + 1) for i in range(len(loader) // 4)]
    assert all(s["dtype"] == "bfloat16" and s["layers"]["grad"][0] is not None for s in session.steps)
    assert session.end["status"] == "finished"


def test_d_switches_what_the_prepared_forward_runs_in_and_close_gives_back_accelerates_forward(tmp_path):
    accelerator, model, optimizer, loader = prepared("bf16")
    wrapped = model.forward
    seen = []
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    monitor = amp_tui.monitor(model, optimizer, scaler=accelerator.scaler, run_dir=tmp_path / "run", announce=False)
    answers = []

    def before(i):
        if i == 3:
            order = command("dtype=fp32")
            order.on_done = answers.append
            monitor.controller.submit(order)
    train(accelerator, model, optimizer, loader, monitor, before=before)
    monitor.close()
    assert answers and answers[0].ok, answers
    assert seen[:3] == [torch.bfloat16] * 3 and set(seen[3:]) == {torch.float32}
    steps = read_session(tmp_path / "run").steps
    assert [s["dtype"] for s in steps] == ["bfloat16"] * 3 + ["float32"] * (len(steps) - 3)
    assert model.forward == wrapped                       # Accelerate's own forward is back
    assert model(torch.ones(2, 8)).dtype == torch.float32  # and it converts its outputs, as before
    assert seen[-1] == torch.bfloat16


def test_fp16_with_a_gradscaler_counts_skips_halves_the_scale_and_s_sets_it(tmp_path):
    accelerator, model, optimizer, loader = prepared("fp16", gain=300.0, cpu_fp16_scale=2.0 ** 16, accumulate=2)
    scaler = accelerator.scaler
    monitor = amp_tui.monitor(model, optimizer, scaler=scaler, run_dir=tmp_path / "run", announce=False)

    def before(i):
        if i == 8:   # a boundary (the first micro-batch of the fifth update)
            monitor.controller.submit(command("scale=8"))
    train(accelerator, model, optimizer, loader, monitor, before=before, clip=True)
    monitor.close()
    session = read_session(tmp_path / "run")
    steps = session.steps
    assert len(steps) == len(loader) // 2 and all(s["micro_batches"] == 2 for s in steps)
    skipped = [s for s in steps[:4] if s["skipped"]]
    # The first skips at GradScaler's default scale are its calibration (training/step/calibration.py).
    assert skipped and steps[0]["skipped"] and steps[0]["calibration"] and "nonfinite" not in steps[0]
    assert all(b["scale"] == a["scale"] / 2 for a, b in zip(skipped, skipped[1:]))
    assert steps[4]["scale"] == 8 and not any(s["skipped"] for s in steps[4:])
    assert steps[-1]["updates"] + steps[-1]["skipped_total"] == len(steps)
    assert scaler.get_scale() == session.end["scale"]     # the accelerator's own scaler was set
    event = [e for e in session.events if e.get("action") == "scale"][0]
    assert event["step"] == 4 and event["after"]["scale"] == 8
