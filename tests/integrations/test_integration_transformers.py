"""The Hugging Face Trainer with AmpTuiCallback, on the CPU (bf16 and fp32; fp16 with the
GradScaler and autocast Accelerate gives it on a GPU, handed to it here): every optimizer step the
Trainer runs is recorded, with the loss as computed, skips judged by the scale, the first
non-finite layer; the keys apply at its step boundaries; misuse gets a line saying what to do."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from transformers import Trainer, TrainerCallback

from amp_tui.core.jsonsafe import read_float
from amp_tui.integrations.transformers import AmpTuiCallback
from amp_tui.job.steering.control import send
from amp_tui.recording.reader import read_session

from frameworks import at_steps, command, hf_trainer, tiny_gpt2
from support import recorded_steps, wait_for


def watched(tmp_path, **kwargs):
    trainer = hf_trainer(tmp_path, **kwargs)
    # Every step probed: the figures are compared step by step.
    callback = AmpTuiCallback(trainer, run_dir=tmp_path / "run", announce=False, probe_every=1)
    trainer.add_callback(callback)
    return trainer, callback


class Seen(TrainerCallback):
    """What the Trainer itself says: its end hooks, and Accelerate's skip flag per step."""

    def __init__(self, trainer):
        self.trainer, self.hooks, self.accelerate_skipped = trainer, [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.accelerate_skipped.append(self.trainer.accelerator.optimizer_step_was_skipped)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.hooks.append("on_epoch_end")

    def on_train_end(self, args, state, control, **kwargs):
        self.hooks.append("on_train_end")


@pytest.mark.parametrize("precision, accumulate", [("bf16", 1), ("bf16", 2), ("fp32", 1)])
def test_every_optimizer_step_the_trainer_runs_is_recorded_with_its_loss(tmp_path, precision, accumulate):
    trainer, _ = watched(tmp_path, precision=precision, accumulate=accumulate, steps=5)
    result = trainer.train()
    session = read_session(tmp_path / "run")
    assert result.global_step == 5 == len(session.steps) == session.end["updates"]
    assert [s["micro_batches"] for s in session.steps] == [accumulate] * 5
    assert {s["dtype"] for s in session.steps} == {"bfloat16" if precision == "bf16" else "float32"}
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert [s["loss"] for s in session.steps] == pytest.approx(logged, rel=1e-3)
    assert all(s["layers"]["grad"][0] is not None for s in session.steps)
    assert session.end["status"] == "finished"
    # left as it was: Accelerate's forward (or none of the instance's) and the Trainer's own methods
    assert "ForwardAutocast" not in getattr(vars(trainer.model).get("forward"), "__qualname__", "")
    assert "training_step" not in vars(trainer)


def test_the_gradients_recorded_are_the_backwards_not_what_the_trainers_clipping_left(tmp_path):
    """The Trainer clips (max_grad_norm) before on_pre_optimizer_step: after a clip to a total
    norm of 1e-4 no gradient element is above 1e-4, and the figures must not be those."""
    trainer, _ = watched(tmp_path, steps=3, max_grad_norm=1e-4)
    trainer.train()
    session = read_session(tmp_path / "run")
    assert all(max(g for g in s["layers"]["grad"] if g is not None) > 1e-3 for s in session.steps)
    assert "clip_grad_norm_" not in vars(trainer.accelerator)     # Accelerate's own again


def test_a_nan_planted_in_one_layer_is_named_as_the_origin_and_recorded_unfiltered(tmp_path):
    trainer, _ = watched(tmp_path, steps=4)
    layer = trainer.model.transformer.h[1].mlp.c_fc
    calls = []

    def plant(module, inputs, output):
        calls.append(1)
        return output * float("nan") if len(calls) == 3 else output
    layer.register_forward_hook(plant)
    trainer.train()
    session = read_session(tmp_path / "run")
    third = session.steps[2]
    assert third["nonfinite"] == "loss" and math.isnan(read_float(third["loss"]))
    event = [e for e in session.events if e["kind"] == "nonfinite"][0]
    assert event["step"] == 2 and event["layer"] == "transformer.h.1.mlp.c_fc"
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(logged[2])          # the Trainer's logs filter it (logging_nan_inf_filter)


def test_fp16_skips_are_judged_by_the_scale_with_the_trainers_fused_adamw(tmp_path):
    trainer, callback = watched(tmp_path, steps=8, cpu_fp16_scaler=2.0 ** 24)
    assert trainer.args.optim.value == "adamw_torch_fused"
    seen = Seen(trainer)
    trainer.add_callback(seen)
    trainer.add_callback(at_steps({5: "scale=1024"}, lambda: callback.monitor))
    trainer.train()
    steps = read_session(tmp_path / "run").steps
    skipped = [s for s in steps if s["skipped"]]
    assert skipped and steps[0]["skipped"]
    assert all(b["scale"] == a["scale"] / 2 for a, b in zip(skipped, skipped[1:]))
    assert not any(seen.accelerate_skipped)   # accelerate #4242: its flag misses them all
    assert steps[5]["scale"] == 1024 and trainer.accelerator.scaler.get_scale() == steps[-1]["next_scale"]
    assert steps[-1]["updates"] + steps[-1]["skipped_total"] == 8 == trainer.state.global_step


def test_the_keys_over_the_socket_apply_at_the_trainers_step_boundaries(tmp_path):
    trainer, callback = watched(tmp_path, steps=100_000)
    seen = Seen(trainer)
    trainer.add_callback(seen)
    dtypes = []
    trainer.model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", trainer.train()), daemon=True)
    thread.start()
    run_dir = tmp_path / "run"
    assert wait_for(lambda: len(recorded_steps(run_dir)) >= 2)
    answers = [send(run_dir, text) for text in ("dtype=fp32", "save", "pause")]
    def held():   # the steps before the pause, all on file (the Trainer waits at the boundary)
        session = read_session(run_dir)
        paused = [e["step"] for e in session.events if e.get("action") == "pause"]
        return paused and len(session.steps) == paused[0] and paused[0]
    assert wait_for(held)
    held = held()
    answers.append(send(run_dir, "step"))
    assert wait_for(lambda: len(recorded_steps(run_dir)) == held + 1)
    answers += [send(run_dir, text) for text in ("resume", "stop")]
    thread.join(120)
    assert not thread.is_alive() and all(a["ok"] for a in answers), answers
    session = read_session(run_dir)
    events = {e["action"]: e for e in session.events if e["kind"] == "intervention"}
    assert list(events) == ["dtype", "save", "pause", "step", "resume", "stop"]
    switch = events["dtype"]["step"]
    assert [s["dtype"] for s in session.steps] == ["bfloat16"] * switch + ["float32"] * (len(session.steps) - switch)
    assert dtypes[0] == torch.bfloat16 and dtypes[-1] == torch.float32
    assert events["resume"]["step"] - events["pause"]["step"] == 1          # exactly the single step
    assert events["pause"]["step"] == held
    assert seen.hooks[-2:] == ["on_epoch_end", "on_train_end"] and session.end["status"] == "stopped"
    assert result["out"].global_step == len(session.steps) == trainer.state.global_step
    assert [e["kind"] for e in session.events if e["kind"] == "checkpoint_saved"]


def test_a_checkpoint_saved_mid_run_restores_into_the_same_trainer_and_it_goes_on(tmp_path):
    trainer, callback = watched(tmp_path, steps=8)
    saved = {}

    class Snapshot(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            # after the boundary's commands: the save at step 3's start, the restore at step 6's
            state_now = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            if state.global_step == 3:
                saved["weights"], saved["lr"] = state_now, trainer.lr_scheduler.get_last_lr()
            if state.global_step == 6:
                saved["restored"], saved["restored_lr"] = state_now, trainer.lr_scheduler.get_last_lr()
    trainer.add_callback(at_steps({3: "save", 6: "restore=latest"}, lambda: callback.monitor))
    trainer.add_callback(Snapshot())
    result = trainer.train()
    assert all(torch.equal(saved["weights"][k], saved["restored"][k]) for k in saved["weights"])
    assert saved["restored_lr"] == saved["lr"]
    session = read_session(tmp_path / "run")
    restored = [e for e in session.events if e["kind"] == "checkpoint_restored"][0]
    assert restored["checkpoint_step"] == 3 and restored["step"] == 6
    assert result.global_step == 8 == len(session.steps) and session.end["status"] == "finished"
    assert all(math.isfinite(read_float(s["loss"])) for s in session.steps[6:])


def test_a_stop_ends_the_trainers_loop_with_its_own_end_hooks(tmp_path):
    trainer, callback = watched(tmp_path, steps=50)
    seen = Seen(trainer)
    trainer.add_callback(seen)
    trainer.add_callback(at_steps({3: "stop"}, lambda: callback.monitor))
    result = trainer.train()
    session = read_session(tmp_path / "run")
    assert result.global_step == 4 == len(session.steps)   # the stop applies at step 4's boundary
    assert seen.hooks == ["on_epoch_end", "on_train_end"]
    assert session.end["status"] == "stopped" and callback.monitor is None


# ---- what the Trainer leaves out, said plainly --------------------------------------------------

def test_fp16_on_the_cpu_is_said_to_train_in_fp32(tmp_path, capsys):
    trainer, _ = watched(tmp_path, precision="fp16", steps=2)
    trainer.train()
    line = "TrainingArguments(fp16=True), but Accelerate gave this run no GradScaler and no fp16 autocast"
    assert line in capsys.readouterr().err
    session = read_session(tmp_path / "run")
    alert = [e for e in session.events if e["kind"] == "alert"][0]
    assert alert["reason"] == "fp16_without_scaler" and line in alert["message"]
    assert session.header["dtype"] == "float32" and session.steps[0]["dtype"] == "float32"


def test_an_engine_that_owns_the_scale_turns_the_scale_keys_off_and_says_why(tmp_path, capsys):
    """DeepSpeed scales the loss in its own optimizer: the Trainer says so with is_deepspeed_enabled
    (driven by hand here: DeepSpeed is not installed)."""
    trainer = hf_trainer(tmp_path, steps=2)
    trainer.is_deepspeed_enabled = True
    callback = AmpTuiCallback(trainer, run_dir=tmp_path / "run", announce=False)
    model = trainer.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    args, state, control = trainer.args, trainer.state, trainer.control
    callback.on_train_begin(args, state, control, model=model, optimizer=optimizer, lr_scheduler=None)
    said = "DeepSpeed owns this run's loss scale: the scale keys (s, S), d and the checkpoint keys (c, r) are off"
    assert said in capsys.readouterr().err
    answers = []
    for text in ("scale=1024", "dtype=fp32", "save"):
        order = command(text)
        order.on_done = answers.append
        callback.monitor.controller.submit(order)
    callback.on_step_begin(args, state, control)
    callback.on_train_end(args, state, control)
    assert [a.ok for a in answers] == [False, False, False]
    assert "DeepSpeed owns the loss scale" in answers[0].message and "DeepSpeed" in answers[1].message
    assert "checkpoint save refused: DeepSpeed keeps the optimizer state" in answers[2].message
    assert not list((tmp_path / "run").rglob("*.safetensors"))
    alert = [e for e in read_session(tmp_path / "run").events if e["kind"] == "alert"][0]
    assert alert["reason"] == "scale_keys_off"


# ---- misuse --------------------------------------------------------------------------------------

def test_the_callback_without_its_trainer_says_to_pass_it(tmp_path):
    with pytest.raises(TypeError, match=r"pass the Trainer it watches, trainer\.add_callback\(AmpTuiCallback\(tr"):
        AmpTuiCallback()
    trainer = hf_trainer(tmp_path)
    with pytest.raises(TypeError, match="got a TrainingArguments, not a transformers.Trainer"):
        AmpTuiCallback(trainer.args)
    with pytest.raises(TypeError, match="pass the Trainer it watches"):
        Trainer(model=trainer.model, args=trainer.args, train_dataset=trainer.train_dataset,
                callbacks=[AmpTuiCallback])    # the class: the Trainer calls it with no argument
    with pytest.raises(TypeError, match=r"dtype= is the Trainer's choice here: set it with TrainingArguments"):
        AmpTuiCallback(trainer, dtype="fp16")


def test_an_attention_overflow_planted_in_fp16_is_traced_to_its_product_in_the_attention(tmp_path):
    """The Trainer's loss is the model's own (`labels`): the failing step is replayed from the
    inputs the Trainer gave the model, forward and backward from that loss, with its fix."""
    model = tiny_gpt2()
    model.config._attn_implementation = "eager"   # the matmuls themselves, not SDPA's kernel
    with torch.no_grad():   # the queries and keys of block 1 (c_attn's first two thirds) made huge
        model.transformer.h[1].attn.c_attn.weight[:, :64].mul_(2000.0)
    trainer, _ = watched(tmp_path, steps=2, cpu_fp16_scaler=1.0, model=model)
    trainer.train()
    session = read_session(tmp_path / "run")
    event = [e for e in session.events if e["kind"] == "nonfinite"][0]
    assert event["step"] == 0 and session.steps[0]["skipped"]
    assert event["op"] in ("aten.bmm", "aten.matmul", "aten.mm")
    assert (event["op_module"], event["op_phase"], event["op_output_dtype"]) == \
        ("transformer.h.1.attn", "forward", "float16")
    assert [i["dtype"] for i in event["op_inputs"]] == ["float16", "float16"]
    assert (event["op_replay_exact"], event["op_replay_from"]) == (True, "loss")
    assert event["fixes_tried"][0]["fix"] == "--fp32-modules 'transformer.h.1.attn'"
    assert event["fix_verified"] is True
