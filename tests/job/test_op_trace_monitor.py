"""amp_tui.monitor on a failing step: the step replayed op by op from what the hooks kept (the
model's forward inputs by reference, the RNG state and autocast of each forward, the gradient that
reached the model's outputs) names the aten op, its module and phase, and the remedy tried on that
very step, in the same event fields as `amp-tui train`; a replay that can't be exact says so.
Small models on the CPU, in fp16 with a GradScaler."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

import amp_tui
from amp_tui.core.commands import Command
from amp_tui.recording.reader import read_session
from amp_tui.recording.report import summarize, summary_lines

from support import ATTENTION_SCRIPT


def attention_model() -> nn.Module:
    namespace: dict = {}
    exec(ATTENTION_SCRIPT, namespace)
    torch.manual_seed(0)
    model = namespace["TinyTransformer"]()
    with torch.no_grad():
        model.blocks[1].attn.q.weight.mul_(200.0)
        model.blocks[1].attn.k.weight.mul_(200.0)
    return model


def batches(n: int = 3):
    torch.manual_seed(1)
    return [(torch.randn(2, 8, 16), torch.randint(0, 4, (2, 8))) for _ in range(n)]


def nonfinite_events(run_dir) -> list[dict]:
    events = [e for e in read_session(run_dir).events if e["kind"] == "nonfinite"]
    for event in events:
        json.dumps(event, allow_nan=False)
    return events


def attention_loop(run_dir, *, scaler: bool = True, steps: int = 2, accumulate: int = 1, first_scale: float = 1.0):
    """The user's own loop: the loss is computed outside the model, where amp-tui can't call it.
    `first_scale` multiplies the first micro-batch's input (small: it stays finite)."""
    model = attention_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0 if scaler else 1e-3)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    monitor = amp_tui.monitor(model, opt, scaler=grad_scaler, dtype="fp16" if scaler else "bf16",
                              run_dir=run_dir, announce=False)
    data = batches(steps * accumulate)
    data[0] = (data[0][0] * first_scale, data[0][1])
    for i in range(steps):
        for j in range(accumulate):
            x, y = data[i * accumulate + j]
            with monitor.step() as step:
                with torch.autocast("cpu", dtype=torch.float16):   # the loop's own autocast
                    logits = model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / accumulate
                step.loss = loss
                (grad_scaler.scale(loss) if grad_scaler else loss).backward()
                if j == accumulate - 1:
                    if grad_scaler:
                        grad_scaler.step(opt)
                        grad_scaler.update()
                    else:
                        opt.step()
                    opt.zero_grad()
    monitor.close()
    return model


def test_attention_scores_overflowing_in_a_monitored_loop_name_the_product_and_a_verified_fix(tmp_path):
    attention_loop(tmp_path / "run")
    event = nonfinite_events(tmp_path / "run")[0]
    assert event["step"] == 0 and event["where"] == "loss"
    assert event["op"] in ("aten.bmm", "aten.matmul", "aten.mm")
    assert (event["op_module"], event["op_phase"], event["op_output_dtype"]) == \
        ("blocks.1.attn", "forward", "float16")
    assert [i["dtype"] for i in event["op_inputs"]] == ["float16", "float16"]
    assert all(100 < i["max"] < 65504 for i in event["op_inputs"])
    assert (event["fix"], event["fix_verified"]) == ("--fp32-modules 'blocks.1.attn'", True)
    # The GradScaler skipped the update: the weights are those the step ran on.
    assert event["op_replay_exact"] is True
    # The gradient into the logits came from the broken forward: the fix is checked on the forward.
    assert event["op_replay_from"] == "forward"
    assert f"{event['op']} in blocks.1.attn (forward, float16 inputs up to " in event["message"]
    assert "the fix is checked on the forward only" in event["message"]
    # Worded for the user's own loop: the monitor's argument and the live command, not amp-tui train's flag.
    assert event["message"].endswith(f"; fix: fp32_modules=['blocks.1.attn'], or live: amp-tui ctl "
                                     f"{tmp_path / 'run'} fp32=blocks.1.attn (verified on this step's forward)")
    assert "--fp32-modules" not in event["message"]
    session = read_session(tmp_path / "run")
    # `report` words it for the loop too: the session says how it was run
    assert session.header["way"] == "monitor"
    [op_row] = [text for name, text in summary_lines(summarize(session)) if name == "first bad op"]
    assert "fix: fp32_modules=['blocks.1.attn'] (verified)" in op_row and "--fp32-modules" not in op_row
    assert session.steps[0]["skipped"] and session.steps[0]["scale"] == 65536.0


def test_each_micro_batch_is_kept_and_the_failing_one_replayed(tmp_path):
    # The first micro-batch is finite, the second overflows: both kept, the second shows the op.
    attention_loop(tmp_path / "run", steps=1, accumulate=2, first_scale=0.01)
    [record] = read_session(tmp_path / "run").steps
    assert record["micro_batches"] == 2
    event = nonfinite_events(tmp_path / "run")[0]
    assert event["op_module"] == "blocks.1.attn" and event["fix_verified"] is True


def test_a_loop_without_a_gradscaler_has_the_update_held_back_and_replayed_exactly(tmp_path):
    """Without a GradScaler, amp-tui holds back an update whose gradients hold inf/NaN
    (training/step/update_guard.py), so the replay runs on the weights the step ran on. (The loop used
    to apply it, and the replay said it ran on the weights after the update: not exact.)"""
    model = attention_loop(tmp_path / "run", scaler=False, steps=1)
    event = nonfinite_events(tmp_path / "run")[0]
    assert event["held_back"] is True and event.get("op_replay_exact") is not False
    assert "held the update back" in event["message"] and "not exact" not in event["message"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_input_changed_in_place_after_the_forward_makes_the_replay_not_exact(tmp_path):
    model = attention_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_tui.monitor(model, opt, scaler=scaler, dtype="fp16", run_dir=tmp_path / "run", announce=False)
    x, y = batches(1)[0]
    with monitor.step() as step:
        with monitor.autocast():
            logits = model(x)
        x.mul_(0.0)   # the loop reuses its input buffer
        step.loss = loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    monitor.close()
    event = nonfinite_events(tmp_path / "run")[0]
    assert event["op_replay_exact"] is False
    assert "not exact: the loop changed an input of the forward in place" in event["message"]


class MseHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, h, target):
        return F.mse_loss(self.proj(h), target)


class Regressor(nn.Module):
    """Returns its own loss (~1e5, finite in fp16 too); times the scale its gradient is not."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = MseHead()

    def forward(self, x, target=None):
        return self.head(torch.relu(self.body(x)), target)


def test_a_backward_overflow_in_a_monitored_loop_is_replayed_from_the_models_own_loss(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # A start above GradScaler's default: the first skip is the overflow, not its calibration.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", announce=False)
    for _ in range(2):
        with monitor.step() as step:
            with monitor.autocast():
                loss = model(torch.randn(4, 16), target=torch.full((4, 16), 316.0))
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    monitor.close()
    event = nonfinite_events(tmp_path / "run")[0]
    assert event["where"] == "gradients"
    assert (event["op_phase"], event["op_module"], event["op_replay_from"]) == ("backward", "head", "loss")
    assert event["op"].startswith("aten.") and event["op_replay_exact"] is True
    assert (event["fix"], event["fix_verified"]) == ("--dtype bf16", True)


def asked_in_own_loop(run_dir, action: str, x: torch.Tensor, steps: int = 2) -> tuple[list, list[float]]:
    """A monitored bf16 loop of the Regressor, `action` asked over ctl before its first step: the
    command's answers and the loop's own losses."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = amp_tui.monitor(model, opt, dtype="bf16", run_dir=run_dir, announce=False)
    answers = []
    command = Command(action, None, "ctl pid=1 user=me", client={"pid": 1, "uid": 1000, "user": "me"})
    command.on_done = answers.append
    monitor.controller.submit(command)
    losses = []
    for _ in range(steps):
        with monitor.step() as step:
            with monitor.autocast():
                loss = model(x, target=torch.zeros(4, 16))
            step.loss = loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    monitor.close()
    return answers, losses


def test_xray_in_the_users_own_loop_traces_the_next_forward_and_names_who_asked(tmp_path):
    answers, losses = asked_in_own_loop(tmp_path / "run", "xray", torch.ones(4, 16))
    assert answers and answers[0].ok, answers
    session = read_session(tmp_path / "run")
    [event] = [e for e in session.events if e["kind"] == "xray"]
    assert (event["step"], event["source"], event["client"]["user"]) == (0, "ctl pid=1 user=me", "me")
    xray = json.loads((tmp_path / "run" / event["path"]).read_text(encoding="utf-8"))
    assert xray["backward_from"] == "loss" and xray["dtype"] == "bfloat16"
    phases = {(m["module"], op["phase"]) for m in xray["modules"] for op in m["ops"]}
    assert ("body", "forward") in phases and ("head.proj", "backward") in phases
    # The X-ray moved nothing: the step's own loss is the one recorded.
    assert session.steps[0]["loss"] == losses[0]


class Amplifier(nn.Module):
    """A head with large weights: its forward stays in fp16's range, the gradient through it
    (its weights times the loss scale) does not."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)
        with torch.no_grad():
            self.head.weight.mul_(2000.0)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def test_a_backward_overflow_is_replayed_from_the_gradient_that_reached_the_outputs(tmp_path):
    torch.manual_seed(0)
    model = Amplifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # A start above GradScaler's default: the first skip is the overflow, not its calibration.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", announce=False)
    with monitor.step() as step:
        with monitor.autocast():
            out = model(torch.randn(4, 16))
        step.loss = loss = out.float().mean()   # the loss code: outside the model
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    monitor.close()
    event = nonfinite_events(tmp_path / "run")[0]
    assert event["where"] == "gradients" and event["op_replay_from"] == "outputs"
    assert (event["op_phase"], event["op_module"], event["op_output_dtype"]) == ("backward", "head", "float16")
    assert event["op_replay_exact"] is True
    assert (event["fix"], event["fix_verified"]) == ("--dtype bf16", True)


def test_fp8_in_the_users_own_loop_casts_the_next_forwards_layers(tmp_path):
    answers, losses = asked_in_own_loop(tmp_path / "run", "fp8", torch.randn(4, 16))
    assert answers and answers[0].ok, answers
    session = read_session(tmp_path / "run")
    [event] = [e for e in session.events if e["kind"] == "fp8"]
    assert (event["step"], event["source"], event["filter"]) == (0, "ctl pid=1 user=me", "fp8-filter-step-0000000.py")
    whatif = json.loads((tmp_path / "run" / event["path"]).read_text(encoding="utf-8"))
    assert whatif["backward_from"] == "loss" and whatif["dtype"] == "bfloat16"
    # Both Linear layers, the gradient of their outputs too (from the model's own loss).
    tensors = {(r["module"], r["tensor"]) for r in whatif["rows"]}
    assert {("body", "input"), ("body", "grad_output"), ("head.proj", "weight"),
            ("head.proj", "grad_output")} <= tensors
    assert set(whatif["verdict"]) == {"body", "head.proj"}
    assert session.steps[0]["loss"] == losses[0]
    lines = summary_lines(summarize(session))
    assert any("last fp8 what-if" in label and "fp8-step-0000000.json" in value for label, value in lines)
