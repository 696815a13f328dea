"""`amp-tui train` on a failing step: the step replayed op by op names the aten op that made inf
or NaN, its module and phase, and the remedy tried on that very step, in the non-finite event
(fields and message) and in `amp-tui report`. Small models on the CPU, in fp16."""

import json

from amp_tui.cli import main
from amp_tui.recording.reader import read_session

from support import ATTENTION_SCRIPT

# The loss (~1e5) is finite, in fp16 too; times the scale (65536) its gradient is not.
BACKWARD_SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn

D = 16

class MseHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, h, target):
        return F.mse_loss(self.proj(h), target)

class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(D, D)
        self.head = MseHead()

    def forward(self, x, target):
        return self.head(torch.relu(self.body(x)), target)

def setup(ctx=None):
    torch.manual_seed(0)
    model = Regressor()
    batches = [(torch.randn(4, D), torch.full((4, D), 316.0)) for _ in range(4)]
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.0),
            "loss_fn": lambda model, batch: model(*batch), "batches": batches}
'''


def train(script, run_dir, *extra):
    assert main(["train", str(script), "--headless", "--device", "cpu", "--dtype", "fp16", "--steps", "1",
                 "--run-dir", str(run_dir), *extra]) == 0
    return read_session(run_dir)


def nonfinite_event(session) -> dict:
    events = [e for e in session.events if e["kind"] == "nonfinite"]
    assert events, "no non-finite event"
    json.dumps(events[0], allow_nan=False)
    return events[0]


def test_attention_scores_overflowing_in_fp16_name_the_product_in_the_attention_and_a_verified_fix(
        write_script, tmp_path):
    session = train(write_script(ATTENTION_SCRIPT), tmp_path / "run")
    event = nonfinite_event(session)
    assert event["where"] == "loss"
    assert event["op"] in ("aten.bmm", "aten.matmul", "aten.mm")
    assert (event["op_module"], event["op_phase"], event["op_output_dtype"]) == \
        ("blocks.1.attn", "forward", "float16")
    assert [i["dtype"] for i in event["op_inputs"]] == ["float16", "float16"]
    assert all(100 < i["max"] < 65504 for i in event["op_inputs"])
    assert (event["fix"], event["fix_verified"]) == ("--fp32-modules 'blocks.1.attn'", True)
    assert f"{event['op']} in blocks.1.attn (forward, float16 inputs up to " in event["message"]
    assert "overflowed float16 (max 65504)" in event["message"]
    assert event["message"].endswith("; fix: --fp32-modules 'blocks.1.attn' (verified on this step)")
    # The replay changed nothing of the run: the step was skipped, the scale left as it was.
    step = session.steps[0]
    assert step["skipped"] and step["scale"] == 65536.0


def test_a_large_loss_times_the_scale_names_an_op_of_the_backward(write_script, tmp_path):
    # A start above GradScaler's default: the first skip is the overflow, not its calibration.
    event = nonfinite_event(train(write_script(BACKWARD_SCRIPT), tmp_path / "run", "--init-scale", "1048576"))
    assert event["where"] == "gradients"
    assert event["op_phase"] == "backward" and event["op_module"] == "head"
    assert event["op"].startswith("aten.")
    # The head in fp32 still takes the scaled gradient in fp16 from outside it; bf16 needs no scale.
    assert [t["fix"] for t in event["fixes_tried"]] == ["--fp32-modules 'head'", "--dtype bf16"]
    assert (event["fix"], event["fix_verified"]) == ("--dtype bf16", True)
    assert "(backward, " in event["message"] and "; fix: " in event["message"]


def test_report_shows_the_op_and_its_fix(write_script, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(write_script(ATTENTION_SCRIPT), run_dir)
    capsys.readouterr()
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "blocks.1.attn" in out and "--fp32-modules 'blocks.1.attn'" in out
    assert main(["report", str(run_dir), "--json"]) == 0
    ops = json.loads(capsys.readouterr().out)["op_traces"]
    assert ops[0]["step"] == 0 and ops[0]["op_module"] == "blocks.1.attn" and ops[0]["fix_verified"] is True
