"""torch.compile: the figures and the origin are those of the module the user wrote.

`torch.compile(net)` wraps `net` in an OptimizedModule whose submodules are named `_orig_mod.…`,
and Dynamo runs forward hooks inside its graph only when they were attached before it compiled.
The tests that compile need a C++ compiler (inductor on the CPU); they are skipped, with the
reason, where compiling fails.
"""

import asyncio
import math

import pytest
import torch
from torch import nn

import amp_tui
from amp_tui.cli import main
from amp_tui.recording.reader import read_session
from amp_tui.sources.buffer import RunBuffer
from amp_tui.sources.replay import ReplaySource
from amp_tui.training.compiled import clean_name, compiled_module_names, original_module
from amp_tui.training.local_fp32 import match_modules
from amp_tui.training.probes.layer_probes import LayerProbe
from amp_tui.training.step.engine import GuardedTrainer
from amp_tui.training.trace.diagnose import diagnose
from amp_tui.ui.app import create_app
from amp_tui.ui.view import ACT_NOT_MEASURED, unmeasured_note

from support import SIZE, strict_lines, until

# `hot.0` overflows fp16 when PLANT is large; the LayerNorm after it brings values back to ~1.
# COMPILE wraps the model (or not); WARM_UP calls the compiled model before amp-tui sees it.
SCRIPT = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.hot = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.hot[0].weight.mul_(PLANT)
    def forward(self, x):
        return self.head(torch.relu(self.hot(torch.relu(self.embed(x)) + 1.0)))

def setup(ctx=None):
    torch.manual_seed(0)
    net = Net()
    model = torch.compile(net) if COMPILE else net
    xs = torch.randn(32, 8)
    ys = xs.sum(1, keepdim=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if WARM_UP:
        with torch.autocast("cpu", dtype=getattr(torch, ctx.dtype)):
            model(xs[:8]).float().sum().backward()   # the shape the run uses: no recompile
        opt.zero_grad()
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x).float(), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn,
            "batches": [(xs[i:i + 8], ys[i:i + 8]) for i in range(0, 32, 8)]}
'''

NAMES = ["embed", "hot.0", "hot.1", "head"]


def script_for(write_script, *, compiled: bool, plant: float = 1.0, warm_up: bool = False, name: str):
    body = (SCRIPT.replace("PLANT", repr(plant)).replace("WARM_UP", repr(warm_up))
            .replace("COMPILE", repr(compiled)))
    return write_script(body, name=f"{name}.py")


def train(script, tmp_path, *flags, name):
    status = main(["train", str(script), "--headless", "--run-dir", str(tmp_path / name), *flags])
    return status, strict_lines(tmp_path / name / "session.jsonl")


def probed_steps(lines):
    return [r for r in lines if r.get("type") == "step" and "layers" in r]


def events(lines, kind):
    return [r for r in lines if r.get("type") == "event" and r.get("kind") == kind]


def as_float(v):
    return {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}.get(v, v)


@pytest.fixture(scope="module")
def compiler():
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4))
    except Exception as exc:  # noqa: BLE001 - any failure means no compiled tests here
        pytest.skip(f"torch.compile does not work here ({type(exc).__name__}: {str(exc)[:200]})")
    yield


@pytest.fixture
def fresh_dynamo(compiler):
    """Each test compiles from scratch: Dynamo's caches live on shared code objects."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def planted_net(plant: float = 60000.0) -> nn.Module:
    torch.manual_seed(0)
    namespace: dict = {}
    exec(SCRIPT.replace("PLANT", repr(plant)).replace("WARM_UP", "False").replace("COMPILE", "False"),
         namespace)
    return namespace["Net"]()


# ---- without compiling (no C++ compiler needed: a compiled module compiles on its first call) ----

def test_the_probes_name_the_layers_of_the_original_module():
    net = planted_net()
    compiled = torch.compile(net)
    assert original_module(compiled) is net
    assert compiled_module_names(compiled) == [""]
    assert LayerProbe(compiled).names == LayerProbe(net).names == NAMES
    assert match_modules(compiled, "hot.*") == ["hot.0", "hot.1"]
    trainer = GuardedTrainer(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1),
                             lambda m, b: m(b).float().sum())
    assert trainer.layer_names == NAMES
    assert trainer.compile_info() == {"modules": [""], "act": "in_graph", "diagnosis": "eager"}
    assert GuardedTrainer(net, torch.optim.SGD(net.parameters(), lr=0.1),
                          lambda m, b: m(b).float().sum()).compile_info() is None


def test_a_compiled_submodule_keeps_its_own_name():
    net = planted_net()
    net.hot = torch.compile(net.hot)
    assert compiled_module_names(net) == ["hot"]
    assert LayerProbe(net).names == NAMES
    assert clean_name("hot._orig_mod.0") == "hot.0"


def test_the_diagnosis_runs_the_original_module_eagerly_and_names_the_real_layer():
    net = planted_net()
    compiled = torch.compile(net)
    x = torch.randn(8, 8)

    def forward():
        with torch.autocast("cpu", dtype=torch.float16):
            return compiled(x).float().sum()
    result = diagnose(compiled, forward, scale=None, device=torch.device("cpu"), backward=False)
    assert result.forward_layer == "hot.0" and result.input_nonfinite is False


# ---- compiled (slow: inductor compiles C++ kernels) ----

@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_compiled_model_trains_with_the_names_and_figures_of_the_uncompiled_one(
        write_script, tmp_path, fresh_dynamo, dtype):
    plain = script_for(write_script, compiled=False, name="plain")
    compiled = script_for(write_script, compiled=True, name="compiled")
    flags = ("--dtype", dtype, "--steps", "4", "--probe-every", "2")
    status_plain, eager = train(plain, tmp_path, *flags, name="plain")
    status_compiled, lines = train(compiled, tmp_path, *flags, name="compiled")
    assert status_plain == status_compiled == 0
    assert lines[0]["layers"] == eager[0]["layers"] == NAMES
    assert lines[0]["compile"] == {"modules": [""], "act": "in_graph", "diagnosis": "eager"}
    assert eager[0]["compile"] is None
    planned = [r for r in probed_steps(lines) if r["step"] % 2 == 0]
    assert [r["step"] for r in planned] == [0, 2]   # armed, disarmed, armed again
    # (a step skipped in between has its gradients' figures, measured after the fact)
    assert all(r["skipped"] for r in probed_steps(lines) if r["step"] % 2)
    for mine, theirs in zip(planned, [r for r in probed_steps(eager) if r["step"] % 2 == 0]):
        for figure in ("act", "grad", "weight"):
            assert all(v is not None for v in mine["layers"][figure]), figure
            assert mine["layers"][figure] == pytest.approx(theirs["layers"][figure], rel=0.02), figure
    assert [r["loss"] for r in lines if r.get("type") == "step"] == pytest.approx(
        [r["loss"] for r in eager if r.get("type") == "step"], rel=1e-2)
    assert not [e for e in events(lines, "alert") if e.get("reason") == "act_not_measured"]


@pytest.mark.slow
def test_a_planted_overflow_under_compile_names_the_real_layer(write_script, tmp_path, fresh_dynamo):
    script = script_for(write_script, compiled=True, plant=60000.0, name="planted")
    _, lines = train(script, tmp_path, "--dtype", "fp16", "--steps", "2", name="planted")
    bad = events(lines, "nonfinite")
    assert len(bad) == 2
    for e in bad:
        assert e["where"] == "loss" and e["origin"] == "hot.0" and e["origin_input_nonfinite"] is False
        assert e["layer"] == "hot.0" and "first non-finite output: hot.0" in e["message"]
        # Replayed op by op eagerly, on the module the user wrote: its op, in fp16, and the fix.
        assert e["op"] in ("aten.addmm", "aten.mm", "aten.linear") and "op_trace_error" not in e
        assert (e["op_module"], e["op_phase"], e["op_output_dtype"]) == ("hot.0", "forward", "float16")
        assert e["fixes_tried"][0]["fix"] == "--fp32-modules 'hot.0'"
    for record in probed_steps(lines):   # and the figure itself, measured inside the compiled graph
        assert as_float(record["layers"]["act"][NAMES.index("hot.0")]) == math.inf
        assert as_float(record["layers"]["act"][NAMES.index("embed")]) < 1e4


@pytest.mark.slow
def test_act_that_the_compiled_graph_cannot_show_is_said_once_not_left_blank(
        write_script, tmp_path, fresh_dynamo, capsys):
    script = script_for(write_script, compiled=True, warm_up=True, name="warm")
    status, lines = train(script, tmp_path, "--dtype", "bf16", "--steps", "3", "--probe-every", "1", name="warm")
    assert status == 0
    said = [e for e in events(lines, "alert") if e.get("reason") == "act_not_measured"]
    assert len(said) == 1 and said[0]["step"] == 0
    assert "act not measured under torch.compile" in said[0]["message"]
    assert lines[0]["compile"]["modules"] == [""]
    for record in probed_steps(lines):   # the gradients and weights are measured all the same
        assert record["layers"]["act"] == [None] * len(NAMES)
        assert all(v is not None for v in record["layers"]["grad"] + record["layers"]["weight"])
    out = capsys.readouterr().out
    assert out.count("act not measured under torch.compile") == 1   # the headless warning line
    buffer = RunBuffer("replay")
    for record in lines:
        buffer.feed(record)
    assert unmeasured_note(buffer.snapshot()) == ACT_NOT_MEASURED
    assert ACT_NOT_MEASURED in asyncio.run(layer_table_title(tmp_path / "warm"))


async def layer_table_title(run_dir) -> str:
    """The dashboard's layer table title once it shows a step of the recording."""
    app = create_app(ReplaySource(run_dir, autoplay=False))
    async with app.run_test(size=SIZE) as pilot:
        table = app.dashboard.layer_table
        await until(pilot, lambda: "step" in str(table.border_title), "the layer table's first step")
        return str(table.border_title)


@pytest.mark.slow
def test_fp32_modules_by_their_original_names_reach_the_compiled_graph(write_script, tmp_path, fresh_dynamo):
    script = script_for(write_script, compiled=True, plant=60000.0, name="planted_fp32")
    status, lines = train(script, tmp_path, "--dtype", "fp16", "--steps", "2", "--fp32-modules", "hot.0",
                          "--init-scale", "256", name="fp32")
    assert status == 0 and lines[0]["fp32_modules"] == ["hot.0"]
    assert not events(lines, "nonfinite")   # hot.0 overflowed fp16 without it (the test above)


@pytest.mark.slow
def test_a_planted_overflow_under_compile_in_the_users_own_loop_is_replayed_eagerly(tmp_path, fresh_dynamo):
    """The monitor's hooks keep the compiled model's inputs; the replay runs the module the user
    wrote, eagerly, and names its op."""
    compiled = torch.compile(planted_net())
    opt = torch.optim.SGD(compiled.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_tui.monitor(compiled, opt, scaler=scaler, run_dir=tmp_path / "run", announce=False)
    x = torch.randn(8, 8)
    with monitor.step() as step:
        with monitor.autocast():
            loss = compiled(x).float().pow(2).mean()
        step.loss = loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    monitor.close()
    [event] = [e for e in read_session(tmp_path / "run").events if e["kind"] == "nonfinite"]
    assert event["op"] in ("aten.addmm", "aten.mm", "aten.linear") and "op_trace_error" not in event
    assert (event["op_module"], event["op_phase"], event["op_output_dtype"]) == ("hot.0", "forward", "float16")
    assert event["op_replay_exact"] is True
