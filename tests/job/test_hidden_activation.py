"""A non-finite activation the loss never sees: a Linear whose fp16 output passes 65504, then a
tanh that saturates it back to 1, so the loss and the gradients stay finite. Under `amp-tui train`
and in a monitored loop, a probed step that shows it is a non-finite event of its own (`"where":
"activations"`), with the op that made the inf, once until the layer is finite again;
--on-nonfinite applies to it. An unprobed step measures no activation: the event comes at the
first probed step that shows it."""

import torch
from torch import nn

import amp_tui
from amp_tui.cli import main
from amp_tui.recording.reader import read_session

# lr 0: the weights stay; batch 2 is small enough for fp16, the others overflow.
SCRIPT = '''
import torch
from torch import nn

class Saturated(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.big(x)))

def setup(ctx=None):
    torch.manual_seed(0)
    model = Saturated()
    with torch.no_grad():
        model.big.weight.fill_(1000.0)    # 8 x 10 x 1000 = 80000: past fp16's 65504
        model.big.bias.zero_()
    batches = [(torch.full((4, 8), 0.1 if i == 2 else 10.0), torch.zeros(4, 1)) for i in range(4)]
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.0),
            "loss_fn": loss_fn, "batches": batches}
'''


def train(script, run_dir, *extra, status=0):
    assert main(["train", str(script), "--headless", "--device", "cpu", "--dtype", "fp16", "--probe-every", "1",
                 "--run-dir", str(run_dir), *extra]) == status
    return read_session(run_dir)


def test_an_overflow_behind_a_tanh_is_a_nonfinite_event_once_naming_its_op(write_script, tmp_path):
    session = train(write_script(SCRIPT), tmp_path / "run", "--steps", "4")
    assert all(s["loss"] == s["loss"] and not s["skipped"] for s in session.steps)   # finite, applied
    # Step 1 overflows as step 0 did: not said again; step 3 is said again, after step 2's finite one.
    assert [s.get("nonfinite") for s in session.steps] == ["activations", None, None, "activations"]
    event, again = [e for e in session.events if e["kind"] == "nonfinite"]
    assert again["step"] == 3 and again["layer"] == "big"
    assert (event["step"], event["where"], event["layer"], event["origin"]) == (0, "activations", "big", "big")
    assert event["op"] in ("aten.addmm", "aten.mm", "aten.linear")
    assert (event["op_module"], event["op_phase"], event["op_output_dtype"]) == ("big", "forward", "float16")
    assert event["message"].startswith("non-finite activation in fp16 in big, while the loss and the gradients")
    assert f"{event['op']} in big (forward" in event["message"]


def test_on_nonfinite_stop_stops_on_it(write_script, tmp_path):
    session = train(write_script(SCRIPT), tmp_path / "run", "--steps", "3", "--on-nonfinite", "stop", status=3)
    stopping = [e for e in session.events if e["kind"] == "stopping"]
    assert stopping and stopping[0]["message"].startswith("stopping after a non-finite activation at step 0")


def saturated_model() -> nn.Module:
    namespace: dict = {}
    exec(SCRIPT, namespace)
    return namespace["setup"]()["model"]


def monitored_loop(run_dir, inputs: list[float], *, probe_every: int | str, on_nonfinite: str | None = None):
    """A plain loop of the user's own in fp16 with a GradScaler, the loss computed outside the
    model; step i's input is filled with inputs[i] (10: `big` overflows, 0.1: it doesn't)."""
    model = saturated_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=run_dir, probe_every=probe_every, announce=False)
    if on_nonfinite is not None:
        monitor.controller.on_nonfinite = on_nonfinite   # the policy the run controller holds (train's --on-nonfinite)
    for value in inputs:
        with monitor.step() as step:
            with monitor.autocast():
                out = model(torch.full((4, 8), float(value)))
            step.loss = loss = nn.functional.mse_loss(out.float(), torch.zeros(4, 1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if monitor.should_stop:
            break
    monitor.close()
    return read_session(run_dir)


def test_a_monitored_loop_says_it_at_the_first_probed_step_that_shows_it(tmp_path):
    # Probed: steps 0, 2, 4, 6. Step 1 overflows unprobed (no figures, nothing said); step 2 is the
    # first probed step that shows it; step 4 is finite again, so step 6 says it again.
    session = monitored_loop(tmp_path / "run", [0.1, 10, 10, 10, 0.1, 10, 10], probe_every=2)
    assert all(s["loss"] == s["loss"] and not s["skipped"] for s in session.steps)   # finite, applied
    assert [s.get("nonfinite") for s in session.steps] == [None, None, "activations", None, None, None,
                                                           "activations"]
    event, again = [e for e in session.events if e["kind"] == "nonfinite"]
    assert (again["step"], again["layer"]) == (6, "big")
    assert (event["step"], event["where"], event["layer"], event["origin"]) == (2, "activations", "big", "big")
    assert event["op"] in ("aten.addmm", "aten.mm", "aten.linear")
    assert (event["op_module"], event["op_phase"], event["op_output_dtype"]) == ("big", "forward", "float16")
    assert event["message"].startswith("non-finite activation in fp16 in big, while the loss and the gradients")
    assert f"{event['op']} in big (forward" in event["message"]
    # The finite gradient that reached the model's output replays the backward too; the update was
    # applied before the monitor saw the step, so the replay is not exact and says so.
    assert (event["op_replay_from"], event["op_replay_exact"]) == ("outputs", False)
    assert "not exact: replayed on the weights after this step's update" in event["message"]
    assert (event["fix"], event["fix_verified"]) == ("--fp32-modules 'big'", True)


def test_the_run_controllers_on_nonfinite_stop_stops_a_monitored_loop_on_it(tmp_path):
    session = monitored_loop(tmp_path / "run", [10, 10, 10], probe_every=1, on_nonfinite="stop")
    assert len(session.steps) == 1
    stopping = [e for e in session.events if e["kind"] == "stopping"]
    assert stopping and stopping[0]["message"].startswith("stopping after a non-finite activation at step 0")
