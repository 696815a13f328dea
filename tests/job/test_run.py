"""Runs through the CLI and the Run object: records, interventions, policies, errors."""

import json
import threading

import pytest

from amp_tui.cli import main
from amp_tui.core.commands import Command
from amp_tui.recording.reader import read_session

from support import OVERFLOW_SCRIPT, strict_lines, train_run


def run_cli(args, tmp_path, name="run"):
    run_dir = tmp_path / name
    status = main(["train", *args, "--headless", "--run-dir", str(run_dir)])
    return status, run_dir, strict_lines(run_dir / "session.jsonl")


def test_every_iteration_writes_one_strict_step_record(mlp_script, tmp_path):
    status, run_dir, lines = run_cli([str(mlp_script), "--steps", "7", "--probe-every", "1"], tmp_path)
    assert status == 0
    header = lines[0]
    assert header["type"] == "header" and header["format"] == "amp-tui-session" and header["version"] == 1
    assert header["device"]["backend"] == "CPU" and header["device"]["name"]
    assert header["layers"] == ["0", "2"] and header["dtype"] == "float16" and header["init_scale"] == 65536.0
    assert header["way"] == "train"   # what its fixes are worded for
    steps = [r for r in lines if r["type"] == "step"]
    assert [s["step"] for s in steps] == list(range(7))
    for s in steps:
        assert set(s) >= {"loss", "scale", "skipped", "skipped_total", "dtype", "layers"}
        assert len(s["layers"]["act"]) == 2
    assert lines[-1]["type"] == "end" and lines[-1]["status"] == "finished"


def test_skips_halve_the_scale_and_a_small_init_scale_skips_none(write_script, tmp_path):
    script = write_script(OVERFLOW_SCRIPT.replace("ACC", "1"))
    _, _, lines = run_cli([str(script), "--steps", "12"], tmp_path, "big")
    steps = [r for r in lines if r["type"] == "step"]
    skipped = [s for s in steps if s["skipped"]]
    assert len(skipped) >= 3
    for a, b in zip(skipped, skipped[1:]):
        if b["step"] == a["step"] + 1:
            assert b["scale"] == a["scale"] / 2
    assert steps[-1]["skipped_total"] == len(skipped)
    # The first four are GradScaler's calibration; every skip after them is a non-finite event.
    calibration = [r["step"] for r in lines if r["type"] == "event" and r["kind"] == "calibration"]
    assert calibration == [0, 1, 2, 3] and [s["step"] for s in steps if s.get("calibration")] == calibration
    events = [r for r in lines if r["type"] == "event" and r["kind"] == "nonfinite"]
    assert [e["step"] for e in events] == [s["step"] for s in skipped if not s.get("calibration")]
    _, _, lines = run_cli([str(script), "--steps", "12", "--init-scale", "4"], tmp_path, "small")
    assert not any(r["skipped"] for r in lines if r["type"] == "step")


def test_at_switches_dtype_mid_run(mlp_script, tmp_path):
    _, _, lines = run_cli([str(mlp_script), "--steps", "14", "--at", "10:dtype=bf16"], tmp_path)
    events = [r for r in lines if r["type"] == "event" and r["kind"] == "intervention"]
    assert len(events) == 1
    e = events[0]
    assert e["step"] == 10 and e["action"] == "dtype" and e["source"] == "at"
    assert e["before"]["dtype"] == "float16" and e["after"]["dtype"] == "bfloat16" and e["after"]["scale"] is None
    index = lines.index(e)
    after = [r for r in lines[index:] if r["type"] == "step"]
    assert [r["step"] for r in after] == [10, 11, 12, 13]
    assert all(r["dtype"] == "bfloat16" and r["scale"] is None for r in after)
    assert all(r["dtype"] == "float16" for r in lines[:index] if r["type"] == "step")


def test_accumulate_is_recorded(write_script, tmp_path):
    script = write_script(OVERFLOW_SCRIPT.replace("ACC", "3"))
    _, _, lines = run_cli([str(script), "--steps", "3", "--init-scale", "1"], tmp_path)
    assert [r["micro_batches"] for r in lines if r["type"] == "step"] == [3, 3, 3]
    assert lines[0]["accumulate"] == 3


def test_checkpoint_restore_and_refusals_keep_the_run_going(mlp_script, tmp_path):
    """A saved checkpoint restores; truncated, bit-flipped-header and wrong-shape copies are refused."""
    run_dir = tmp_path / "run"
    run = train_run(mlp_script, run_dir, steps=12, at=["4:save", "10:restore=latest"])
    done = threading.Event()

    def corrupt_when_saved(record):
        if record.get("kind") == "checkpoint_saved" and not done.is_set():
            done.set()
            good = run_dir / record["path"]
            data = good.read_bytes()
            (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) // 2])
            header_len = int.from_bytes(data[:8], "little")
            flipped = bytearray(data)
            flipped[8 + header_len // 2] ^= 0x55
            (tmp_path / "flipped.safetensors").write_bytes(bytes(flipped))
            for name in ("truncated", "flipped", "wrong_shape"):
                run.submit(Command("restore", str(tmp_path / f"{name}.safetensors"), "test"))
    run.observers.append(corrupt_when_saved)
    # a checkpoint of a differently shaped model
    import torch
    from torch import nn

    from amp_tui.training.checkpoint import save_checkpoint
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    save_checkpoint(tmp_path / "wrong_shape.safetensors", model=other,
                    optimizer=torch.optim.SGD(other.parameters(), lr=0.01), scaler_state=None,
                    step=0, dtype="float32")
    assert run.run() == 0
    session = read_session(run_dir)
    refusals = [e for e in session.events if e["kind"] == "refused" and e.get("action") == "restore"]
    assert len(refusals) == 3
    text = " | ".join(e["message"] for e in refusals)
    assert "truncated.safetensors" in text and "flipped.safetensors" in text and "wrong_shape.safetensors" in text
    assert "shape" in refusals[2]["message"]
    restored = [e for e in session.events if e["kind"] == "checkpoint_restored"]
    assert len(restored) == 1 and restored[0]["step"] == 10 and restored[0]["checkpoint_step"] == 4
    assert [s["step"] for s in session.steps] == list(range(12)), "the run went on through every refusal"


def test_nonfinite_policy_stop_and_pause(write_script, tmp_path):
    script = write_script('''
import torch
from torch import nn
def setup():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e5)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "loss_fn": lambda m, b: m(b).float().mean(), "batches": [torch.ones(2, 4)]}
''')
    status, _, lines = run_cli([str(script), "--steps", "5", "--on-nonfinite", "stop"], tmp_path, "stop")
    assert status == 3
    assert [r["step"] for r in lines if r["type"] == "step"] == [0]
    assert lines[-1]["status"] == "stopped"
    nonfinite = [r for r in lines if r.get("kind") == "nonfinite"][0]
    assert nonfinite["where"] == "loss" and nonfinite["layer"] == "0" and nonfinite["loss"] in ("Infinity", "NaN")

    # pause holds the run until a command arrives
    run = train_run(script, tmp_path / "p", steps=3, on_nonfinite="pause")
    paused = threading.Event()
    run.observers.append(lambda r: r.get("kind") == "paused" and paused.set())
    thread = threading.Thread(target=run.run)
    thread.start()
    assert paused.wait(30)
    assert run.step == 1 and run.state == "paused"
    run.submit(Command("dtype", "bfloat16", "test"))
    run.submit(Command("resume", None, "test"))
    thread.join(60)
    steps = read_session(tmp_path / "p").steps
    assert [s["dtype"] for s in steps] == ["float16", "bfloat16", "bfloat16"]


def test_exception_at_step_k_is_recorded_not_dumped(write_script, tmp_path, capsys):
    script = write_script('''
import torch
from torch import nn
calls = {"n": 0}
def setup():
    model = nn.Linear(4, 1)
    def loss_fn(m, b):
        calls["n"] += 1
        if calls["n"] == 4:   # step 3 (the pre-flight check is step 0's own call)
            raise ValueError("bad batch 3")
        return m(b).pow(2).mean()
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "loss_fn": loss_fn, "batches": [torch.ones(2, 4)]}
''')
    status, run_dir, lines = run_cli([str(script), "--steps", "10", "--checkpoint-every", "2", "--init-scale", "1"],
                                   tmp_path)
    assert status == 1
    error = [r for r in lines if r.get("kind") == "error"][0]
    assert error["step"] == 3 and error["during"] == "step"
    assert "ValueError: bad batch 3 (train_script.py line 10)" in error["message"]
    assert "Traceback" in error["traceback"]
    assert lines[-1] == {**lines[-1], "type": "end", "status": "error"}
    assert (run_dir / "checkpoints" / "step-0000002.safetensors").exists()
    assert "Traceback (most recent call last)" not in capsys.readouterr().err


def test_commands_from_another_thread_apply_at_step_boundaries(mlp_script, tmp_path):
    run = train_run(mlp_script, tmp_path / "r")
    outcomes = []
    seen = {"steps": 0}

    def drive(record):
        if record["type"] == "step":
            seen["steps"] += 1
            if seen["steps"] == 2:
                threading.Thread(target=lambda: [
                    run.submit(Command("scale", "half", "test", on_done=outcomes.append)),
                    run.submit(Command("dtype", "float32", "test", on_done=outcomes.append)),
                    run.submit(Command("save", None, "test", on_done=outcomes.append)),
                    run.submit(Command("stop", None, "test", on_done=outcomes.append))]).start()
    run.observers.append(drive)
    assert run.run() == 0
    assert [o.ok for o in outcomes] == [True, True, True, True]
    session = read_session(tmp_path / "r")
    actions = [e["action"] for e in session.events if e["kind"] == "intervention"]
    assert actions == ["scale", "dtype", "save", "stop"]
    scale_event = next(e for e in session.events if e.get("action") == "scale")
    assert scale_event["before"]["scale"] == 2 * scale_event["after"]["scale"]
    assert session.end["status"] == "stopped"


def test_report_prints_the_summary(mlp_script, tmp_path, capsys):
    run_cli([str(mlp_script), "--steps", "4", "--at", "2:dtype=bf16"], tmp_path)
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == 4 and data["updates_applied"] + data["skipped"] == 4
    assert data["final_dtype"] == "bfloat16" and data["final_scale"] is None and data["interventions"] == 1
    assert main(["report", str(tmp_path / "run" / "session.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "updates applied" in out and "bfloat16" in out
    assert main(["report", str(tmp_path / "nothing")]) == 2


def test_headless_prints_events_and_a_summary(write_script, tmp_path, capsys):
    script = write_script(OVERFLOW_SCRIPT.replace("ACC", "1"))
    run_cli([str(script), "--steps", "6"], tmp_path)
    out = capsys.readouterr().out
    assert "calibration" in out and "the gradients overflowed at scale 65536, update skipped" in out
    assert "nonfinite" in out and "gradients overflowed at scale 4096" in out
    assert "updates applied" in out and "run dir" in out


WARMUP_SCRIPT = '''
import torch
from torch import nn

BASE_LR, WARMUP = 0.01, 4

def parts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    # Linear warm-up from 0: the update of step k uses BASE_LR * k / WARMUP.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, k / WARMUP))
    xs = torch.randn(64, 8)
    ys = xs.sum(1, keepdim=True) * SCALE_UP
    batches = [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, 64, 16)]
    def loss_fn(model, batch):
        return nn.functional.mse_loss(model(batch[0]), batch[1])
    return model, opt, sched, loss_fn, batches

def setup():
    model, opt, sched, loss_fn, batches = parts()
    return {"model": model, "optimizer": opt, "scheduler": sched, "loss_fn": loss_fn, "batches": batches}

def plain_loop_lrs(steps):
    """The lr each update of a plain loop uses: read when optimizer.step() runs."""
    model, opt, sched, loss_fn, batches = parts()
    used = []
    for k in range(steps):
        opt.zero_grad()
        loss_fn(model, batches[k % len(batches)]).backward()
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return used
'''


def test_recorded_lr_is_the_one_the_step_used(write_script, tmp_path):
    script = write_script(WARMUP_SCRIPT.replace("SCALE_UP", "1"))
    _, _, lines = run_cli([str(script), "--steps", "7", "--dtype", "fp32"], tmp_path)
    recorded = [r["lr"] for r in lines if r["type"] == "step"]
    namespace = {}
    exec(script.read_text(), namespace)
    assert recorded == namespace["plain_loop_lrs"](7)
    assert recorded[0] == 0.0  # the warm-up's first update moves nothing


def test_recorded_lr_means_the_same_on_skipped_and_applied_steps(write_script, tmp_path):
    # Targets 300x the features overflow fp16's backward at 65536: the first steps are skipped,
    # and the scheduler only moves after an applied update.
    script = write_script(WARMUP_SCRIPT.replace("SCALE_UP", "300"))
    _, _, lines = run_cli([str(script), "--steps", "14"], tmp_path)
    steps = [r for r in lines if r["type"] == "step"]
    assert any(s["skipped"] for s in steps) and not all(s["skipped"] for s in steps)
    namespace = {}
    exec(script.read_text(), namespace)
    base, warmup = namespace["BASE_LR"], namespace["WARMUP"]
    for s in steps:
        applied_before = s["updates"] - (0 if s["skipped"] else 1)
        assert s["lr"] == pytest.approx(base * min(1.0, applied_before / warmup), rel=1e-12), s["step"]


UNTRAINED_SCRIPT = '''
import torch
from torch import nn

class Blow(torch.autograd.Function):
    """Identity forward; the gradient through it is multiplied by BLOW (inf: a non-finite one)."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        return g * BLOW

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
        self.aux = nn.Linear(16, 1)          # reachable from the model, in no param group
    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h), Blow.apply(self.aux(h.detach()).float())

def setup():
    torch.manual_seed(0)
    model = Net()
    # lr=0: nothing moves, so every step's true gradient is the same.
    opt = torch.optim.SGD([*model.body.parameters(), *model.head.parameters()], lr=0.0)
    x = torch.randn(16, 8)
    def loss_fn(model, batch):
        out, aux = model(batch)
        return nn.functional.mse_loss(out, batch.sum(1, keepdim=True)) + 0.01 * aux.mean()
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": [x]}
'''


def _layer_grads(lines, layer):
    index = lines[0]["layers"].index(layer)
    return [r["layers"]["grad"][index] for r in lines if r["type"] == "step"]


def test_untrained_parameters_are_named_once_and_their_gradients_unscaled(write_script, tmp_path, capsys):
    script = write_script(UNTRAINED_SCRIPT.replace("BLOW", "1.0"))
    figures = {}
    for dtype in ("fp16", "bf16"):
        _, _, lines = run_cli([str(script), "--steps", "4", "--dtype", dtype, "--probe-every", "1"], tmp_path, dtype)
        out = capsys.readouterr().out
        assert out.count("warning:") == 1 and "train nothing: aux.weight, aux.bias" in " ".join(out.split())
        figures[dtype] = _layer_grads(lines, "aux")
        assert all(g == pytest.approx(figures[dtype][0], rel=1e-6) for g in figures[dtype])  # per step
        assert not any(r["skipped"] for r in lines if r["type"] == "step")
    # Unscaled like every other gradient: fp16 at scale 65536 shows what bf16 shows.
    assert figures["fp16"][0] == pytest.approx(figures["bf16"][0], rel=0.05)


def test_a_nonfinite_gradient_of_an_untrained_parameter_skips_nothing(write_script, tmp_path):
    script = write_script(UNTRAINED_SCRIPT.replace("BLOW", "float('inf')"))
    for dtype in ("fp16", "bf16"):
        _, _, lines = run_cli([str(script), "--steps", "3", "--dtype", dtype], tmp_path, dtype)
        steps = [r for r in lines if r["type"] == "step"]
        assert not any(s["skipped"] for s in steps), dtype
        assert all(g in ("Infinity", "NaN") for g in _layer_grads(lines, "aux")), dtype  # still shown
