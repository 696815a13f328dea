"""Lightning with AmpTuiCallback, on the CPU (bf16-mixed and 32-true, under both import names;
16-mixed through its MixedPrecision plugin, the one way Lightning gives the CPU an fp16
GradScaler): every optimizer step is recorded with its own gradients, skips judged by the scale,
the first non-finite layer; the keys apply at its step boundaries; misuse says what to do."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.plugins.precision import DeepSpeedPrecision

from amp_tui.core.jsonsafe import read_float
from amp_tui.integrations.lightning import AmpTuiCallback
from amp_tui.job.steering.control import send
from amp_tui.recording.reader import read_session

from frameworks import command, lightning_module_class, pl_trainer, regression_loader
from support import ATTENTION_SCRIPT, recorded_steps, wait_for


class Seen(Callback):
    """What Lightning itself does: its end hooks, the gradients its optimizer step gets, the lr."""

    def __init__(self, plan=None, monitor_of=None):
        self.hooks, self.grads, self.weights, self.lrs = [], [], [], []
        self.plan, self.monitor_of = plan or {}, monitor_of

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(max(p.grad.abs().max().item() for p in pl_module.net[0].parameters()))
        self.weights.append(max(p.abs().max().item() for p in pl_module.net[0].parameters()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        text = self.plan.get(trainer.global_step)
        if text and batch_idx % trainer.accumulate_grad_batches == trainer.accumulate_grad_batches - 1:
            self.monitor_of().controller.submit(command(text))

    def on_train_end(self, trainer, pl_module):
        self.hooks.append("on_train_end")

    def on_fit_end(self, trainer, pl_module):
        self.hooks.append("on_fit_end")


def fit(tmp_path, *, steps=6, package="lightning", gain=1.0, optimizer="adamw", plan=None, probe_every=1,
        **trainer_kwargs):
    # Every step probed unless asked otherwise: the figures are compared step by step.
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False, probe_every=probe_every)
    seen = Seen(plan, lambda: callback.monitor)
    trainer = pl_trainer([callback, seen], package=package, steps=steps, **trainer_kwargs)
    torch.manual_seed(0)
    module = lightning_module_class(package)(gain=gain, optimizer=optimizer)
    trainer.fit(module, regression_loader())
    return trainer, module, seen, read_session(tmp_path / "run")


@pytest.mark.parametrize("package, precision, accumulate, clip", [
    ("lightning", "bf16-mixed", 1, None), ("lightning", "32-true", 2, 1e-3),
    ("pytorch_lightning", "bf16-mixed", 2, None)])
def test_every_optimizer_step_is_recorded_with_its_own_gradients(tmp_path, package, precision, accumulate, clip):
    trainer, module, seen, session = fit(tmp_path, package=package, precision=precision,
                                         accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    assert trainer.global_step == 6 == len(session.steps) == session.end["updates"]
    assert [s["micro_batches"] for s in session.steps] == [accumulate] * 6
    assert {s["dtype"] for s in session.steps} == {"bfloat16" if precision == "bf16-mixed" else "float32"}
    # The gradients of that step's backward, before Lightning clips them (it steps the optimizer
    # with a closure that runs the backward inside optimizer.step(), after the step's pre-hook).
    net0 = session.header["layers"].index("net.0")
    assert [s["layers"]["grad"][net0] for s in session.steps] == pytest.approx(seen.grads, rel=1e-2)
    assert [s["layers"]["weight"][net0] for s in session.steps] == pytest.approx(seen.weights, abs=2e-4)
    assert seen.hooks == ["on_train_end", "on_fit_end"] and session.end["status"] == "finished"
    assert "forward_context" not in vars(trainer.precision_plugin)   # left as it was


@pytest.mark.parametrize("optimizer", ["adamw", "fused"])
def test_fp16_skips_are_judged_by_the_scale_and_s_sets_it(tmp_path, optimizer):
    trainer, module, seen, session = fit(tmp_path, steps=10, gain=300.0, optimizer=optimizer,
                                         plugins=[MixedPrecision("16-mixed", "cpu")], plan={6: "scale=4"})
    steps = session.steps
    skipped = [s for s in steps if s["skipped"]]
    # The first skips at GradScaler's default scale are its calibration (training/step/calibration.py).
    assert steps[0]["skipped"] and steps[0]["calibration"] and "nonfinite" not in steps[0]
    assert all(b["scale"] == a["scale"] / 2 for a, b in zip(skipped, skipped[1:]))
    assert steps[6]["scale"] == 4 and trainer.precision_plugin.scaler.get_scale() == steps[-1]["next_scale"]
    assert trainer.global_step == 10 == steps[-1]["updates"] + steps[-1]["skipped_total"]
    assert seen.lrs[1] < seen.lrs[0] and steps[1]["skipped"]   # Lightning stepped its schedule anyway
    net0 = session.header["layers"].index("net.0")
    finite = [i for i, s in enumerate(steps) if not s["skipped"]]
    assert finite and all(steps[i]["layers"]["grad"][net0] < 1e4 for i in finite)   # unscaled figures


def test_the_keys_over_the_socket_apply_at_lightnings_step_boundaries(tmp_path):
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False)
    seen = Seen()
    trainer = pl_trainer([callback, seen], steps=-1, max_epochs=10_000, precision="bf16-mixed")
    torch.manual_seed(0)
    module = lightning_module_class()()
    dtypes = []
    module.net[0].register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    thread = threading.Thread(target=trainer.fit, args=(module, regression_loader()), daemon=True)
    thread.start()
    run_dir = tmp_path / "run"
    assert wait_for(lambda: len(recorded_steps(run_dir)) >= 2)
    answers = [send(run_dir, text) for text in ("dtype=fp32", "save", "pause")]

    def held():
        session = read_session(run_dir)
        paused = [e["step"] for e in session.events if e.get("action") == "pause"]
        return paused and len(session.steps) == paused[0] and paused[0]
    assert wait_for(held)
    count = held()
    answers.append(send(run_dir, "step"))
    assert wait_for(lambda: len(recorded_steps(run_dir)) == count + 1)
    answers += [send(run_dir, text) for text in ("resume", "stop")]
    thread.join(120)
    assert not thread.is_alive() and all(a["ok"] for a in answers), answers
    session = read_session(run_dir)
    events = {e["action"]: e for e in session.events if e["kind"] == "intervention"}
    assert list(events) == ["dtype", "save", "pause", "step", "resume", "stop"]
    switch = events["dtype"]["step"]
    assert [s["dtype"] for s in session.steps] == ["bfloat16"] * switch + ["float32"] * (len(session.steps) - switch)
    assert dtypes[0] == torch.bfloat16 and dtypes[-1] == torch.float32
    assert events["resume"]["step"] - events["pause"]["step"] == 1
    assert seen.hooks == ["on_train_end", "on_fit_end"] and trainer.state.status.value == "finished"
    assert trainer.global_step == len(session.steps) and session.end["status"] == "stopped"


def test_a_checkpoint_saved_mid_run_restores_into_the_same_trainer_and_it_goes_on(tmp_path):
    saved = {}

    class Snapshot(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # after the boundary's commands: the save at step 3's start, the restore at step 6's
            now = {k: v.clone() for k, v in pl_module.state_dict().items()}
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            if trainer.global_step == 3:
                saved["weights"], saved["lr"] = now, lr
            if trainer.global_step == 6:
                saved["restored"], saved["restored_lr"] = now, lr
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False)
    seen = Seen({3: "save", 6: "restore=latest"}, lambda: callback.monitor)
    trainer = pl_trainer([callback, seen, Snapshot()], steps=9, precision="bf16-mixed")
    torch.manual_seed(0)
    trainer.fit(lightning_module_class()(), regression_loader())
    assert all(torch.equal(saved["weights"][k], saved["restored"][k]) for k in saved["weights"])
    assert saved["restored_lr"] == saved["lr"]
    session = read_session(tmp_path / "run")
    restored = [e for e in session.events if e["kind"] == "checkpoint_restored"][0]
    assert restored["checkpoint_step"] == 3 and restored["step"] == 6
    assert trainer.global_step == 9 == len(session.steps) and session.end["status"] == "finished"


def test_a_stop_ends_lightnings_loop_with_its_own_end_hooks(tmp_path):
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False)
    seen = Seen({3: "stop"}, lambda: callback.monitor)
    trainer = pl_trainer([callback, seen], steps=50, precision="bf16-mixed")
    trainer.fit(lightning_module_class()(), regression_loader())
    session = read_session(tmp_path / "run")
    assert trainer.global_step == 4 == len(session.steps)    # the stop applies at step 4's boundary
    assert seen.hooks == ["on_train_end", "on_fit_end"] and trainer.state.status.value == "finished"
    assert session.end["status"] == "stopped"


def test_a_nan_planted_in_one_layer_is_named_as_the_origin(tmp_path):
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False)
    trainer = pl_trainer([callback], steps=4, precision="bf16-mixed")
    torch.manual_seed(0)
    module = lightning_module_class()()
    calls = []

    def plant(_module, _inputs, output):
        calls.append(1)
        return output * float("nan") if len(calls) == 3 else output
    module.net[2].register_forward_hook(plant)
    trainer.fit(module, regression_loader())
    session = read_session(tmp_path / "run")
    assert session.steps[2]["nonfinite"] == "loss" and math.isnan(read_float(session.steps[2]["loss"]))
    event = [e for e in session.events if e["kind"] == "nonfinite"][0]
    assert event["step"] == 2 and event["layer"] == "net.2"


# ---- what Lightning leaves out, said plainly ------------------------------------------------------

def test_fp16_weights_with_no_gradscaler_are_said_and_d_says_why_it_cant_switch(tmp_path, capsys):
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False)
    answers = []

    class Ask(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                order = command("dtype=bf16")
                order.on_done = answers.append
                callback.monitor.controller.submit(order)
    trainer = pl_trainer([callback, Ask()], steps=2, precision="16-true")
    trainer.fit(lightning_module_class()(), regression_loader())
    assert "precision='16-true' with no GradScaler: nothing scales the loss" in capsys.readouterr().err
    session = read_session(tmp_path / "run")
    assert [e["reason"] for e in session.events if e["kind"] == "alert"] == ["fp16_without_scaler"]
    assert session.header["dtype"] == "float16"
    assert answers and not answers[0].ok and "HalfPrecision (precision='16-true') fixes the dtype" in answers[0].message


def test_an_engine_that_owns_the_scale_turns_the_scale_keys_off_and_says_why(tmp_path, capsys):
    """DeepSpeed's precision plugin scales in its engine (driven by hand: DeepSpeed is not installed)."""
    module = lightning_module_class()()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    trainer = SimpleNamespace(precision_plugin=DeepSpeedPrecision("16-mixed"), strategy=object(), world_size=1,
                              is_global_zero=True, optimizers=[optimizer], lr_scheduler_configs=[],
                              accumulate_grad_batches=1, should_stop=False)
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False)
    callback.on_train_start(trainer, module)
    said = "DeepSpeed owns this run's loss scale: the scale keys (s, S), d and the checkpoint keys (c, r) are off"
    assert said in capsys.readouterr().err
    answers = []
    order = command("scale=half")
    order.on_done = answers.append
    callback.monitor.controller.submit(order)
    callback.on_train_batch_start(trainer, module, None, 0)
    callback.on_train_end(trainer, module)
    assert not answers[0].ok and "DeepSpeed owns the loss scale" in answers[0].message
    alert = [e for e in read_session(tmp_path / "run").events if e["kind"] == "alert"][0]
    assert alert["reason"] == "scale_keys_off"


def test_manual_optimization_is_left_alone_and_said(tmp_path, capsys):
    """training_step steps the optimizer itself: no batch hook sees its loss or its update, so the
    run is not watched (rather than recorded as nothing)."""
    module = lightning_module_class()()
    module.automatic_optimization = False
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(precision="bf16-mixed"), strategy=object(),
                              world_size=1, is_global_zero=True, optimizers=[optimizer], lr_scheduler_configs=[],
                              accumulate_grad_batches=1, should_stop=False)
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False)
    callback.on_train_start(trainer, module)
    assert "not watching this run: automatic_optimization is False" in capsys.readouterr().err
    assert callback.monitor is None and not (tmp_path / "run").exists()


def test_misuse_says_what_to_do(tmp_path):
    with pytest.raises(TypeError, match=r"give it to the Trainer: L\.Trainer\(callbacks=\[AmpTuiCallback\(\)\]\)"):
        AmpTuiCallback(pl_trainer([]))
    with pytest.raises(TypeError, match=r'dtype= is Lightning\'s choice here: set it with L\.Trainer\(precision='):
        AmpTuiCallback(dtype="bf16")


def test_an_attention_overflow_planted_in_16_mixed_is_traced_to_its_product_in_the_attention(tmp_path):
    """The loss is computed in training_step, outside the model's forward: the failing step is
    replayed from the inputs Lightning gave the forward, under the autocast it ran in."""
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
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False)
    trainer = pl_trainer([callback], steps=2, plugins=[MixedPrecision("16-mixed", "cpu")])
    torch.manual_seed(0)
    trainer.fit(Attending(), torch.utils.data.DataLoader(data, batch_size=2))
    session = read_session(tmp_path / "run")
    event = [e for e in session.events if e["kind"] == "nonfinite"][0]
    assert event["step"] == 0 and session.steps[0]["skipped"]
    assert event["op"] in ("aten.bmm", "aten.matmul", "aten.mm")
    assert (event["op_module"], event["op_phase"], event["op_output_dtype"]) == \
        ("net.blocks.1.attn", "forward", "float16")
    assert [i["dtype"] for i in event["op_inputs"]] == ["float16", "float16"]
    assert event["op_replay_exact"] is True
    assert (event["fix"], event["fix_verified"]) == ("--fp32-modules 'net.blocks.1.attn'", True)


def test_an_activation_a_tanh_hides_in_16_mixed_is_said_at_the_first_probed_step_that_shows_it(tmp_path):
    """A Linear whose fp16 output passes 65504, then a tanh: the loss and the gradients stay finite.
    Step 1 overflows unprobed (nothing to tell), step 2 is probed: the event is there."""

    class Saturated(LightningModule):
        def __init__(self):
            super().__init__()
            self.big, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
            with torch.no_grad():
                self.big.weight.fill_(1000.0)   # 8 x 10 x 1000 = 80000: past fp16's 65504
                self.big.bias.zero_()

        def forward(self, x):
            return self.head(torch.tanh(self.big(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    x = torch.cat([torch.full((2, 8), 0.1), torch.full((4, 8), 10.0)])
    data = torch.utils.data.TensorDataset(x, torch.zeros(6, 1))
    callback = AmpTuiCallback(run_dir=tmp_path / "run", announce=False, probe_every=2)
    trainer = pl_trainer([callback], steps=3, plugins=[MixedPrecision("16-mixed", "cpu")])
    trainer.fit(Saturated(), torch.utils.data.DataLoader(data, batch_size=2))
    session = read_session(tmp_path / "run")
    assert [s.get("nonfinite") for s in session.steps] == [None, None, "activations"]
    [event] = [e for e in session.events if e["kind"] == "nonfinite"]
    assert (event["step"], event["where"], event["layer"]) == (2, "activations", "big")
    assert event["op"] in ("aten.addmm", "aten.mm", "aten.linear")
    assert (event["op_module"], event["op_phase"], event["op_output_dtype"]) == ("big", "forward", "float16")
    assert (event["fix"], event["fix_verified"]) == ("--fp32-modules 'big'", True)
