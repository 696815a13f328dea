"""A non-finite activation the loss never sees: a Linear whose fp16 output passes 65504, then a
tanh that saturates it back to 1, so the loss and the gradients stay finite. Under `amp-tui train`
a probed step that shows it is a non-finite event of its own (`"where": "activations"`), with the
op that made the inf, once until the layer is finite again; --on-nonfinite applies to it."""

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
