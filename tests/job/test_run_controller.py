"""One run controller under every way of running: a command added once (`note`) works under
`amp-tui train` (at a step, live over ctl), in a loop with `amp_tui.monitor`, and under the Hugging
Face and Lightning callbacks (several ranks: tests/e2e/test_ddp.py); the session header and the
non-finite event are built the same; a monitored step counts the model's forward passes in it as
its micro-batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_tui
from amp_tui.cli import main
from amp_tui.core.commands import Command
from amp_tui.job.steering.control import send
from amp_tui.recording.reader import read_session

from frameworks import at_steps, command, hf_trainer, lightning_module_class, pl_trainer, regression_loader
from support import wait_for


def notes(run_dir) -> list[tuple[int, str, str]]:
    return [(e["step"], e["text"], e["source"]) for e in read_session(run_dir).events if e["kind"] == "note"]


def test_a_note_at_a_step_of_amp_tui_train(mlp_script, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", str(mlp_script), "--headless", "--steps", "8", "--run-dir", str(run_dir),
                 "--at", "5:note=changed the data shard: lr=1e-4"]) == 0
    assert notes(run_dir) == [(5, "changed the data shard: lr=1e-4", "at")]
    steps = read_session(run_dir).steps
    assert [s["step"] for s in steps] == list(range(8))   # a note changes nothing in the run


def test_a_note_sent_to_a_live_run_over_ctl(live_job):
    run, _ = live_job
    answer = send(run.run_dir, "note=changed the data shard")
    assert answer["ok"], answer
    assert wait_for(lambda: notes(run.run_dir), 30)
    [(step, text, source)] = notes(run.run_dir)
    assert text == "changed the data shard" and source.startswith("ctl") and step >= 2


def _loop(run_dir, steps=6, *, micro=1, before_step=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=run_dir, announce=False, control=False)
    for i in range(steps):
        if before_step is not None:
            before_step(i, monitor)
        with monitor.step() as step:
            # nanoGPT's shape: every micro-batch's forward and backward inside one monitored step
            for k in range(micro):
                x = torch.randn(4, 8) * (1 + k)
                with monitor.autocast():
                    loss = model(x).pow(2).mean() / micro
                scaler.scale(loss).backward()
            step.loss = loss
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    monitor.close()
    return monitor


def test_a_note_in_a_loop_with_the_monitor(tmp_path):
    def before_step(i, monitor):
        if i == 3:
            monitor.controller.submit(Command("note", "from the loop", "api"))
        if i == 4:   # submitted without the parser: checked by the handler all the same
            monitor.controller.submit(Command("note", "two\nlines", "api"))
    _loop(tmp_path / "run", before_step=before_step)
    assert notes(tmp_path / "run") == [(3, "from the loop", "api")]
    events = read_session(tmp_path / "run").events
    refused = [e for e in events if e["kind"] == "refused"]
    assert [(e["step"], e["action"], e["source"]) for e in refused] == [(4, "note", "api")]
    assert "one line" in refused[0]["reason"] and not [e for e in events if e["kind"] == "error"]


def test_a_note_under_the_hugging_face_trainer(tmp_path):
    from amp_tui.integrations.transformers import AmpTuiCallback
    trainer = hf_trainer(tmp_path, steps=4)
    callback = AmpTuiCallback(trainer, run_dir=tmp_path / "run", announce=False)
    trainer.add_callback(callback)
    trainer.add_callback(at_steps({2: "note=hf shard"}, lambda: callback.monitor))
    trainer.train()
    assert notes(tmp_path / "run") == [(2, "hf shard", "api")]


def test_a_note_under_lightning(tmp_path):
    from lightning.pytorch import Callback

    from amp_tui.integrations.lightning import AmpTuiCallback
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False)

    class NoteAtStep2(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and not notes(tmp_path / "run"):
                callback.monitor.controller.submit(command("note=lightning shard"))
    trainer = pl_trainer([callback, NoteAtStep2()], steps=4)
    torch.manual_seed(0)
    trainer.fit(lightning_module_class()(), regression_loader())
    assert notes(tmp_path / "run") == [(2, "lightning shard", "api")]


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_a_monitored_step_counts_the_forward_passes_in_it_as_its_micro_batches(tmp_path, micro):
    _loop(tmp_path / "run", steps=3, micro=micro)
    steps = read_session(tmp_path / "run").steps
    assert [s["micro_batches"] for s in steps] == [micro] * 3


def test_the_header_has_the_same_keys_in_the_same_order_whichever_drives_the_steps(mlp_script, tmp_path):
    assert main(["train", str(mlp_script), "--headless", "--steps", "2", "--run-dir", str(tmp_path / "t")]) == 0
    _loop(tmp_path / "m", steps=2)
    trained, watched = read_session(tmp_path / "t").header, read_session(tmp_path / "m").header
    assert list(trained) == list(watched)
