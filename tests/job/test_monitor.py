"""amp_tui.monitor in a loop of the user's own: the records equal `amp-tui train`'s for the same
model and batches, every key applies at a step boundary, checkpoints continue exactly, and misuse
gets a message that says what to change."""

from __future__ import annotations

import importlib.util
import math
import sys
import threading

import pytest
import torch
from torch import nn

import amp_tui
from amp_tui.cli import main
from amp_tui.core.commands import Command
from amp_tui.job.monitor import MonitorError
from amp_tui.job.steering.control import send
from amp_tui.recording.reader import read_session

from support import recorded_steps, wait_for

# One file, two ways to train it: setup() for `amp-tui train`, loop() with the monitor. The
# regression targets are large, so fp16 at init_scale 65536 overflows its first backwards.
TWIN = '''
import torch
from torch import nn
import amp_tui

STEPS = 12

def build(optimizer_kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    params = model.parameters()
    if optimizer_kind == "fused":
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    elif optimizer_kind == "foreach":
        opt = torch.optim.Adam(params, lr=1e-3, foreach=True)
    else:
        opt = torch.optim.SGD(params, lr=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    xs = torch.randn(64, 8)
    batches = [(xs[i:i + 16], xs[i:i + 16].sum(1, keepdim=True) * 300) for i in range(0, 64, 16)]
    return model, opt, sched, batches

def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)

OPTIMIZER = "sgd"

def setup(ctx=None):
    model, opt, sched, batches = build(OPTIMIZER)
    return {"model": model, "optimizer": opt, "scheduler": sched, "batches": batches,
            "loss_fn": loss_fn, "max_grad_norm": 1.0}

def loop(run_dir, dtype, zero_grad_at="top", steps=STEPS, monitor_kw=None, before_step=None):
    model, opt, sched, batches = build(OPTIMIZER)
    # The snippet as written: bf16 keeps a GradScaler, disabled.
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == "fp16")
    # Every step probed, as `amp-tui train --probe-every 1` does: the two records compare step by step.
    # The dtype said, as the loop's autocast would say it: by default a loop with no enabled
    # GradScaler stays in fp32.
    monitor = amp_tui.monitor(model, opt, scaler=scaler, scheduler=sched, run_dir=run_dir, dtype=dtype,
                              announce=False, **{"probe_every": 1, **(monitor_kw or {})})
    for i in range(steps):
        batch = batches[i % len(batches)]
        if before_step is not None:
            before_step(i, monitor)
        if zero_grad_at == "top":
            opt.zero_grad()
        with monitor.step() as step:
            with monitor.autocast():
                loss = loss_fn(model, batch)
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if zero_grad_at == "after step":
                opt.zero_grad()
        # amp-tui train steps the scheduler only after an applied update
        if not monitor.last_skipped:
            sched.step()
        if monitor.should_stop:
            break
    monitor.close()
    return model, monitor
'''


def load_twin(tmp_path, optimizer="sgd"):
    path = tmp_path / "twin.py"
    path.write_text(TWIN.replace('OPTIMIZER = "sgd"', f'OPTIMIZER = "{optimizer}"'), encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"twin_{optimizer}_{tmp_path.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def comparable(record: dict) -> dict:
    kept = ("step", "loss", "scale", "skipped", "skipped_total", "updates", "dtype", "next_scale", "lr")
    out = {k: record.get(k) for k in kept}
    out["layers"] = {k: record["layers"][k] for k in ("act", "grad", "weight")} if "layers" in record else None
    return out


@pytest.mark.parametrize("dtype, optimizer", [("fp16", "sgd"), ("fp16", "foreach"), ("fp16", "fused"),
                                              ("bf16", "sgd"), ("bf16", "fused")])
def test_the_snippet_records_what_amp_tui_train_records(tmp_path, dtype, optimizer):
    script, twin = load_twin(tmp_path, optimizer)
    assert main(["train", str(script), "--headless", "--dtype", dtype, "--steps", str(twin.STEPS),
                 "--run-dir", str(tmp_path / "train"), "--device", "cpu", "--probe-every", "1"]) == 0
    twin.loop(tmp_path / "monitor", dtype)
    trained = read_session(tmp_path / "train")
    watched = read_session(tmp_path / "monitor")
    assert len(watched.steps) == len(trained.steps) == twin.STEPS
    for a, b in zip(trained.steps, watched.steps):
        assert comparable(a) == comparable(b), (a["step"], comparable(a), comparable(b))
    if dtype == "fp16":
        assert watched.steps[-1]["skipped_total"] > 0           # the overflow was seen and skipped
    assert [e["kind"] for e in watched.events if e["kind"] == "nonfinite"] == \
        [e["kind"] for e in trained.events if e["kind"] == "nonfinite"]
    assert watched.end["status"] == "finished" and watched.end["updates"] == trained.end["updates"]
    assert watched.header["layers"] == trained.header["layers"]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_zero_grad_before_the_step_or_right_after_the_update_gives_the_same_figures(tmp_path, dtype):
    _, twin = load_twin(tmp_path)
    twin.loop(tmp_path / "top", dtype, zero_grad_at="top")
    twin.loop(tmp_path / "after", dtype, zero_grad_at="after step")
    top, after = read_session(tmp_path / "top").steps, read_session(tmp_path / "after").steps
    assert [comparable(r) for r in top] == [comparable(r) for r in after]
    assert all(r["layers"]["grad"][0] is not None for r in top)   # skipped steps measured too


def test_a_skipped_step_is_measured_and_names_the_first_non_finite_gradient(tmp_path):
    _, twin = load_twin(tmp_path)
    # The twin's loss overflows far past GradScaler's calibration: its first four skips are the
    # calibration's (training/step/calibration.py), the fifth is trouble.
    twin.loop(tmp_path / "run", "fp16", steps=6)
    session = read_session(tmp_path / "run")
    assert [s.get("calibration", False) for s in session.steps[:5]] == [True] * 4 + [False]
    first = session.steps[4]
    assert first["skipped"] and first["nonfinite"] == "gradients"
    assert any(not math.isfinite(float(g)) for g in first["layers"]["grad"])
    event = [e for e in session.events if e["kind"] == "nonfinite"][0]
    assert event["step"] == 4 and event["backward_origin"] in session.header["layers"]


def test_ctl_status_never_counts_a_step_the_counter_has_not_passed(tmp_path):
    # `ctl status` is read from another thread at any time; here, while each step is recorded
    # (a skipped step at once, after its replay under the op tracer): the step counter has passed
    # every step the counts hold, so that applied + skipped is the step (no restore in this run).
    _, twin = load_twin(tmp_path)
    seen = []

    def watch(i, monitor):
        if i == 0:
            monitor.controller.observers.append(lambda record: seen.append((record, monitor.controller.status()))
                                     if record.get("type") == "step" else None)
    twin.loop(tmp_path / "run", "fp16", steps=6, before_step=watch)
    assert len(seen) == 6 and seen[0][0]["skipped"]   # the overflow was there to count
    for record, status in seen:
        assert status["step"] > record["step"]
        assert status["updates"] + status["skipped"] == status["step"], (record["step"], status)


def test_gradient_accumulation_folds_micro_batches_into_one_step(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = amp_tui.monitor(model, opt, run_dir=tmp_path / "run", announce=False)
    for i in range(8):
        with monitor.step() as step:
            with monitor.autocast():
                loss = model(torch.randn(2, 4)).pow(2).mean()
            step.loss = loss
            (loss / 4).backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()
    monitor.close()
    steps = read_session(tmp_path / "run").steps
    assert [(s["step"], s["micro_batches"], s["updates"]) for s in steps] == [(0, 4, 1), (1, 4, 2)]


def run_in_background(twin, run_dir, dtype="fp16", steps=10_000):
    done = {}

    def target():
        done["model"], done["monitor"] = twin.loop(run_dir, dtype, steps=steps)
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, done


def test_every_key_over_the_socket_applies_at_a_boundary_and_is_recorded(tmp_path):
    _, twin = load_twin(tmp_path)
    run_dir = tmp_path / "run"
    thread, done = run_in_background(twin, run_dir)
    assert wait_for(lambda: len(recorded_steps(run_dir)) >= 2)
    answers = []
    for command in ("scale=1024", "scale=half", "dtype=bf16", "save", "restore=latest", "fp32=0",
                    "pause", "step", "resume", "stop"):
        answer = send(run_dir, command)
        answers.append((command, answer["ok"], answer["message"]))
        if command == "pause":
            held = len(read_session(run_dir).steps)
            paused_at = send(run_dir, "status")["status"]["step"]
        if command == "step":   # taken before "resume" goes, which would cancel a step still to come
            assert wait_for(lambda at=paused_at + 1: send(run_dir, "status")["status"]["step"] == at)
    thread.join(60)
    assert not thread.is_alive(), "stop ended the loop (monitor.should_stop)"
    assert all(ok for _, ok, _ in answers), answers
    session = read_session(run_dir)
    actions = [e["action"] for e in session.events if e["kind"] == "intervention"]
    assert actions == ["scale", "scale", "dtype", "save", "fp32", "pause", "step", "resume", "stop"]
    assert [e["kind"] for e in session.events if e["kind"].startswith("checkpoint")] == \
        ["checkpoint_saved", "checkpoint_restored"]
    scales = [e for e in session.events if e.get("action") == "scale"]
    assert scales[0]["after"]["scale"] == 1024
    assert scales[1]["after"]["scale"] == scales[1]["before"]["scale"] / 2   # the loop stepped in between
    after_switch = [s for s in session.steps if s["step"] >= [e for e in session.events
                                                              if e.get("action") == "dtype"][0]["step"]]
    assert after_switch and all(s["dtype"] == "bfloat16" for s in after_switch)
    steps_while_paused = [e["step"] for e in session.events if e.get("action") in ("pause", "resume")]
    assert steps_while_paused[1] - steps_while_paused[0] == 1        # exactly the one single step
    assert held <= len(session.steps)
    assert session.end["status"] == "stopped"


def test_steps_recorded_a_few_at_a_time_keep_their_order_and_reach_the_file_when_held(tmp_path, monkeypatch):
    """Measured steps wait to be recorded (here: until something else is), yet every event comes
    after the steps before it, a pause puts them on file before holding the loop (so an attached
    dashboard sees where it stopped), and close() records the rest."""
    import amp_tui.job.controller as controller_module
    monkeypatch.setattr(controller_module, "PUBLISH_INTERVAL", 1e9)
    _, twin = load_twin(tmp_path)
    run_dir = tmp_path / "run"
    seen_when_held = []

    def before_step(i, monitor):
        if i == 3:
            monitor.controller.submit(Command("save", None, "test"))
        if i == 6:
            monitor.controller.submit(Command("pause", None, "test"))
            threading.Thread(target=lambda: seen_when_held.append(_steps_on_file_when_held(monitor)),
                             daemon=True).start()
    twin.loop(run_dir, "bf16", steps=9, before_step=before_step)   # no overflow: nothing published early
    session = read_session(run_dir)
    assert [s["step"] for s in session.steps] == list(range(9))
    lines = [r for r in _records(run_dir) if r["type"] in ("step", "event")]
    for i, record in enumerate(lines):
        if record["type"] == "event" and record["kind"] in ("intervention", "checkpoint_saved"):
            before = [r["step"] for r in lines[:i] if r["type"] == "step"]
            assert before == list(range(record["step"])), (record["kind"], before)
    assert seen_when_held == [list(range(7))]


def _steps_on_file_when_held(monitor) -> list[int]:
    """Once the loop is held, single-step it: the step it runs is on file while the loop is held
    again (the single step's own event came before that step), then let it go on."""
    try:
        assert wait_for(lambda: monitor.controller.state == "paused", timeout=60)
        monitor.controller.submit(Command("step", None, "test"))
        assert wait_for(lambda: len(recorded_steps(monitor.run_dir)) >= 7, timeout=60)
        return [s["step"] for s in read_session(monitor.run_dir).steps]
    finally:
        monitor.controller.submit(Command("resume", None, "test"))


def _records(run_dir) -> list[dict]:
    import json
    return [json.loads(line) for line in (run_dir / "session.jsonl").read_text().splitlines()]


def test_a_checkpoint_saved_in_the_monitor_restores_in_the_monitor_and_continues_exactly(tmp_path):
    """Run A saves at step 5 and goes on to 10; run B, fresh objects, restores that checkpoint and
    runs steps 5-9 on the same batches: the same weights, bit for bit (dropout's RNG included)."""
    _, twin = load_twin(tmp_path, "foreach")
    model_a, _ = twin.loop(tmp_path / "a", "fp16", steps=10, monitor_kw={"checkpoint_every": 5})
    saved = sorted((tmp_path / "a" / "checkpoints").glob("step-0000005*.safetensors"))
    assert saved
    model_b, _ = twin_loop_from(twin, tmp_path / "b", start=5, steps=10, restore=saved[0])
    for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()):
        assert torch.equal(a, b)
    restored = [e for e in read_session(tmp_path / "b").events if e["kind"] == "checkpoint_restored"]
    assert restored and restored[0]["checkpoint_step"] == 5


def twin_loop_from(twin, run_dir, *, start, steps, restore):
    """The twin's loop, but feeding batches `start`..`steps`-1 after restoring `restore` first."""
    model, opt, sched, batches = twin.build("foreach")
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_tui.monitor(model, opt, scaler=scaler, scheduler=sched, run_dir=run_dir, announce=False)
    monitor.controller.submit(Command("restore", str(restore), "test"))
    for i in range(start, steps):
        batch = batches[i % len(batches)]
        opt.zero_grad()
        with monitor.step() as step:
            with monitor.autocast():
                loss = twin.loss_fn(model, batch)
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        if not monitor.last_skipped:
            sched.step()
    monitor.close()
    return model, monitor


# ---- misuse -------------------------------------------------------------------------------------

def tiny(tmp_path, **kwargs):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, amp_tui.monitor(model, opt, run_dir=tmp_path / "run", announce=False, **kwargs)


def test_a_step_whose_loss_was_never_set_is_a_clear_error(tmp_path):
    model, opt, monitor = tiny(tmp_path)
    with pytest.raises(MonitorError, match=r"step\.loss was never set"):
        with monitor.step():
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    monitor.close()
    assert read_session(tmp_path / "run").end is not None


def test_a_nested_step_and_a_step_after_close_are_clear_errors(tmp_path):
    model, opt, monitor = tiny(tmp_path)
    with pytest.raises(MonitorError, match="inside another monitor.step"):
        with monitor.step():
            with monitor.step():
                pass
    monitor.close()
    with pytest.raises(MonitorError, match="after monitor.close"):
        with monitor.step():
            pass


def test_a_second_monitor_in_the_same_process_is_refused_until_the_first_is_closed(tmp_path):
    model, opt, first = tiny(tmp_path)
    with pytest.raises(MonitorError, match="already watches a loop"):
        amp_tui.monitor(model, opt, run_dir=tmp_path / "second", announce=False)
    first.close()
    second = amp_tui.monitor(model, opt, run_dir=tmp_path / "second", announce=False)
    second.close()


def test_closing_leaves_the_users_objects_as_they_were(tmp_path):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", announce=False)
    assert "unscale_" in vars(scaler)
    monitor.close()
    assert "unscale_" not in vars(scaler) and "step" not in vars(scaler)
    assert not opt._optimizer_step_pre_hooks and not model._forward_hooks


def test_d_is_refused_when_the_loop_runs_its_own_autocast(tmp_path):
    """(The monitor starts in fp32, its default for a loop without a GradScaler: `d` asks bf16.)"""
    model, opt, monitor = tiny(tmp_path)
    answer = []
    for i in range(2):
        if i == 1:   # after a step whose forward ran under the loop's own autocast
            command = Command("dtype", "bfloat16", "test")
            command.on_done = answer.append
            monitor.controller.submit(command)
        with monitor.step() as step:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.ones(1, 2)).sum()
            step.loss = loss
            loss.backward()
            opt.step()
    monitor.close()
    assert answer and not answer[0].ok and "monitor.autocast()" in answer[0].message
    assert monitor.dtype == "float32"


def test_wrong_arguments_say_what_is_wrong(tmp_path):
    model = nn.Linear(2, 1)
    with pytest.raises(MonitorError, match="not a torch.optim.Optimizer"):
        amp_tui.monitor(model, "adam", run_dir=tmp_path / "a", announce=False)
    assert "amp_tui" in sys.modules


def test_a_monitored_step_costs_one_transfer_to_the_host(tmp_path, monkeypatch):
    """The loss, the scale, GradScaler's verdict and every per-layer figure come over together:
    one sync per step of amp-tui's own (the loop's own GradScaler syncs are its business). An
    unprobed step's few scalars come through `to_host`, one transfer on an accelerator (on the
    CPU it reads them one by one, which moves nothing). A failing step's replay under the op
    tracer reads its own figures back, and is counted apart: it runs on failing steps only."""
    import traceback as tb

    import amp_tui.job.drivers.hook_driver as driver_module
    _, twin = load_twin(tmp_path)
    ours = []
    replays = []
    for name in ("tolist", "item", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            *callers, _ = tb.extract_stack(limit=3)   # (a comprehension is a frame of its own)
            caller = callers[-1]
            inside_to_host = any(frame.name == "to_host" for frame in callers)
            if "amp_tui" in caller.filename and "tests" not in caller.filename and not inside_to_host \
                    and not replays[-1:] == ["running"]:
                ours.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    to_host = driver_module.to_host

    def counted_to_host(tensors):
        ours.append("to_host")
        return to_host(tensors)
    monkeypatch.setattr(driver_module, "to_host", counted_to_host)
    trace_kept_step = driver_module.trace_kept_step

    def counted_replay(*args, **kwargs):
        replays.append("running")
        try:
            return trace_kept_step(*args, **kwargs)
        finally:
            replays.append("done")
    monkeypatch.setattr(driver_module, "trace_kept_step", counted_replay)
    twin.loop(tmp_path / "run", "fp16", steps=12, monitor_kw={"probe_every": 2})
    # One transfer a step: the figures' (a probed step, or a skipped one measured after the
    # fact) or the few scalars'.
    steps = read_session(tmp_path / "run").steps
    assert sum(1 for r in steps if "layers" not in r) >= 1
    assert sorted(ours) == sorted("tolist" if "layers" in r else "to_host" for r in steps), ours
    assert replays.count("done") == sum(1 for r in steps if r.get("nonfinite"))   # the failing ones only


def test_a_loop_without_a_grad_scaler_stays_in_fp32_until_d(tmp_path):
    """The default dtype is what the loop already does: no GradScaler, no autocast of its own
    enabled: fp32 (not bf16), and `d` switches it; an enabled GradScaler: fp16."""
    model, opt, monitor = tiny(tmp_path)
    assert monitor.dtype == "float32"
    seen = []
    for i in range(3):
        if i == 2:
            monitor.controller.submit(Command("dtype", "bfloat16", "test"))
        with monitor.step() as step:
            with monitor.autocast():
                out = model(torch.ones(1, 2))
                seen.append(out.dtype)
                loss = out.float().sum()
            step.loss = loss
            loss.backward()
            opt.step()
    monitor.close()
    assert seen == [torch.float32, torch.float32, torch.bfloat16]
    assert [s["dtype"] for s in read_session(tmp_path / "run").steps] == ["float32", "float32", "bfloat16"]
    model = nn.Linear(2, 1)
    scaled = amp_tui.monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu"),
                             run_dir=tmp_path / "fp16", announce=False)
    assert scaled.dtype == "float16"
    scaled.close()


def test_fp32_modules_run_in_fp32_from_the_first_step_and_are_let_go_on_close(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(MonitorError, match=r"fp32_modules='nope' matches no module.*'0'"):
        amp_tui.monitor(model, opt, dtype="bf16", fp32_modules="nope", run_dir=tmp_path / "bad", announce=False)
    monitor = amp_tui.monitor(model, opt, dtype="bf16", fp32_modules=["1"], run_dir=tmp_path / "run",
                              announce=False)
    seen = {}

    def output_dtype(name):
        def hook(_module, _inputs, output):
            seen.setdefault(name, output.dtype)
        return hook
    hooks = [model[0].register_forward_hook(output_dtype("0")), model[1].register_forward_hook(output_dtype("1"))]
    with monitor.step() as step:
        with monitor.autocast():
            loss = model(torch.ones(3, 2)).float().sum()
        step.loss = loss
        loss.backward()
        opt.step()
    monitor.close()
    assert seen == {"0": torch.bfloat16, "1": torch.float32}
    assert read_session(tmp_path / "run").header["fp32_modules"] == ["1"]
    assert "forward" not in vars(model[1])   # the user's module as it was
    for hook in hooks:
        hook.remove()


def scaled_loop(monitor, model, opt, scaler, steps, *, before=None, big=1.0):
    """A loop calling its GradScaler; `big` multiplies the targets (large: fp16 overflows at 65536)."""
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        if before is not None:
            before(i)
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        with monitor.step() as step:
            with monitor.autocast():
                loss = nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True) * big)
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_fp16_without_a_grad_scaler_gets_one_amp_tui_owns(tmp_path):
    """A loop with no GradScaler (one made only on CUDA) in fp16: amp-tui makes one, the loop
    calls it as `monitor.scaler`, and its overflows are skipped and halve the scale."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    monitor = amp_tui.monitor(model, opt, dtype="fp16", probe_every=1, run_dir=tmp_path / "run", announce=False)
    scaler = monitor.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() and scaler.get_scale() == 2.0 ** 16
    scaled_loop(monitor, model, opt, scaler, 6, big=3000.0)
    monitor.close()
    steps = read_session(tmp_path / "run").steps
    assert steps[0]["skipped"] and steps[0]["scale"] == 2.0 ** 16 and steps[1]["scale"] == 2.0 ** 15
    assert all(s["dtype"] == "float16" for s in steps)
    assert all(math.isfinite(p.item()) for p in model.parameters() for p in p.flatten())


def test_a_loop_that_steps_without_amp_tuis_scaler_is_told_and_d_to_fp16_is_refused(tmp_path):
    model, opt, monitor = tiny(tmp_path)   # fp32: no scaler of the loop's
    answers = []

    def plain_step():
        with monitor.step() as step:
            with monitor.autocast():
                loss = model(torch.ones(1, 2)).float().sum()
            step.loss = loss
            loss.backward()
            opt.step()
    plain_step()
    command = Command("dtype", "float16", "test")
    command.on_done = answers.append
    monitor.controller.submit(command)
    plain_step()
    monitor.close()
    assert answers and not answers[0].ok and "monitor.scaler" in answers[0].message
    assert monitor.dtype == "float32"
    model, opt, monitor = tiny(tmp_path / "fp16", dtype="fp16")
    plain_step()
    monitor.close()
    alerts = [e for e in read_session(tmp_path / "fp16" / "run").events if e["kind"] == "alert"]
    assert [a["reason"] for a in alerts] == ["unscaled_fp16"] and "monitor.scaler" in alerts[0]["fix"]


def test_a_disabled_grad_scaler_of_the_loop_scales_in_fp16_and_is_given_back_disabled(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", enabled=False)   # the loop's, for bf16 and fp32
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", announce=False)
    assert monitor.scaler is scaler and monitor.dtype == "float32"

    def before(i):
        if i == 2:
            monitor.controller.submit(Command("dtype", "float16", "test"))
    scaled_loop(monitor, model, opt, scaler, 5, before=before, big=3000.0)
    assert scaler.is_enabled()
    monitor.close()
    assert not scaler.is_enabled()
    steps = read_session(tmp_path / "run").steps
    assert [s["scale"] for s in steps[:2]] == [None, None]
    assert steps[2]["dtype"] == "float16" and steps[2]["scale"] == 2.0 ** 16 and steps[2]["skipped"]


def test_the_loops_grad_scaler_state_is_given_back_after_a_stay_in_bf16(tmp_path):
    """While in bf16 the loop's `scaler.state_dict()` (what its own checkpoints save) holds the
    fp16 state it had, not amp-tui's scale of 1; back in fp16 the scaler takes it up again, and
    the records say no scale (null) in bf16."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", announce=False)
    seen = {}

    def before(i):
        if i == 3:
            seen["fp16"] = scaler.state_dict()
            monitor.controller.submit(Command("dtype", "bfloat16", "test"))
        if i == 5:
            seen["bf16"] = scaler.state_dict()
            seen["bf16 live"] = scaler.get_scale()
            monitor.controller.submit(Command("dtype", "float16", "test"))
        if i == 6:
            seen["back"] = scaler.state_dict()
    scaled_loop(monitor, model, opt, scaler, 7, before=before)
    monitor.close()
    assert seen["fp16"]["scale"] == 1024.0 and seen["fp16"]["_growth_tracker"] == 3
    assert seen["bf16"] == seen["fp16"] and seen["bf16 live"] == 1.0
    assert seen["back"] == {**seen["fp16"], "_growth_tracker": 4}   # one more clean fp16 step, counted on
    steps = read_session(tmp_path / "run").steps
    assert [(s["dtype"], s["scale"]) for s in steps[3:5]] == [("bfloat16", None)] * 2
    assert [s["next_scale"] for s in steps[3:5]] == [None, None]
    assert steps[5]["scale"] == 1024.0


def test_a_monitor_closed_in_bf16_gives_the_loop_its_fp16_scaler_state_back(tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, dtype="bf16", run_dir=tmp_path / "run", announce=False)
    scaled_loop(monitor, model, opt, scaler, 2)
    assert scaler.get_scale() == 1.0
    monitor.close()
    assert scaler.get_scale() == 512.0 and "state_dict" not in vars(scaler)


def test_micro_batches_in_one_block_record_the_mean_of_the_losses_set_before_the_division(tmp_path):
    """nanoGPT's way: every micro-batch's forward and backward inside one block, the loss divided
    by the accumulation steps for the backward. `step.loss` set to each micro-batch's loss before
    the division (docs/user-guide.md): the step's loss is their mean, the loss as the loop means it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = amp_tui.monitor(model, opt, run_dir=tmp_path / "run", announce=False)
    g = torch.Generator().manual_seed(2)
    meant = []
    for _ in range(2):
        losses = []
        with monitor.step() as step:
            for _ in range(4):
                with monitor.autocast():
                    loss = model(torch.randn(2, 4, generator=g)).pow(2).mean()
                step.loss = loss
                losses.append(loss.item())
                loss = loss / 4
                loss.backward()
            opt.step()
            opt.zero_grad()
        meant.append(sum(losses) / 4)
    monitor.close()
    steps = read_session(tmp_path / "run").steps
    assert [s["micro_batches"] for s in steps] == [4, 4]
    assert [s["loss"] for s in steps] == pytest.approx(meant, rel=1e-6)
