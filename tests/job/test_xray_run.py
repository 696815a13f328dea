"""`xray` (the dashboard's x, `amp-tui ctl RUN xray`): the next step traced op by op before it
runs, on the same batch and RNG state; its JSON file in the run directory, its event naming the op
closest to its dtype's max and who asked, `amp-tui report`'s lines (in the user's own loop:
tests/job/test_op_trace_monitor.py). Small models on the CPU, in fp16."""

import json
import os
import threading

from amp_tui.cli import main
from amp_tui.job.steering.control import send
from amp_tui.recording.reader import read_session

from support import train_run

# Dropout draws from the RNG: a replay that left it moved would change the next losses.
SCRIPT = '''
import torch
from torch import nn

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = torch.randn(64, 8)
    ys = xs.sum(1, keepdim=True)
    batches = [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, 64, 16)]
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches}
'''


def paused_run(script, run_dir, answers: list):
    """A run paused before step 2, answered over its control socket: xray, then resume."""
    run = train_run(script, run_dir, steps=4, device="cpu", dtype="float16", at=["2:pause"])

    def on_record(record):
        if record.get("action") == "pause":
            threading.Thread(target=lambda: answers.extend(send(run_dir, c) for c in ("xray", "resume"))).start()
    run.observers.append(on_record)
    return run


def test_ctl_xray_writes_the_file_and_its_event_and_leaves_the_run_as_it_was(write_script, tmp_path):
    script = write_script(SCRIPT)
    answers: list[dict] = []
    assert paused_run(script, tmp_path / "xrayed", answers).run() == 0
    assert [a["ok"] for a in answers] == [True, True], answers
    assert "step 2 will be X-rayed" in answers[0]["message"]
    session = read_session(tmp_path / "xrayed")
    [event] = [e for e in session.events if e["kind"] == "xray"]
    assert event["step"] == 2 and event["path"] == "xray-step-0000002.json"
    # Who asked, as an intervention names it.
    assert event["source"].startswith("ctl pid=") and event["client"]["uid"] == os.getuid()
    xray = json.loads((tmp_path / "xrayed" / event["path"]).read_text(encoding="utf-8"))
    step = next(r for r in session.steps if r["step"] == 2)
    assert xray["dtype"] == "float16" and xray["scale"] == step["scale"]
    rows = {(m["module"], op["op"], op["phase"]): op for m in xray["modules"] for op in m["ops"]}
    # CPU autocast: the Linear layers' matmuls in float16, the loss (outside the model) in float32.
    assert rows[("0", "aten.addmm", "forward")]["dtype"] == "float16"
    assert rows[("3", "aten.addmm", "forward")]["dtype"] == "float16"
    loss_ops = [op for (module, _, _), op in rows.items() if module is None]
    assert loss_ops and all(op["dtype"] == "float32" for op in loss_ops if op["phase"] == "forward")
    closest = xray["closest"][0]
    bits = [r["headroom_bits"] for r in xray["closest"]]
    assert bits == sorted(bits)
    assert (event["op"], event["op_module"], event["headroom_bits"]) == \
        (closest["op"], closest["module"], closest["headroom_bits"])
    assert event["message"].startswith(f"X-ray of step 2: closest to {closest['dtype']}'s max: {closest['op']} in ")
    assert event["message"].endswith(f", {closest['headroom_bits']:.1f} bits")
    assert not list((tmp_path / "xrayed").glob(".*.tmp"))

    # The same run without the X-ray: the same losses, the same scales (the replay moved no RNG,
    # no weight, no gradient, no scaler).
    plain = train_run(script, tmp_path / "plain", steps=4, device="cpu", dtype="float16", at=["2:pause"])
    plain.observers.append(lambda r: r.get("action") == "pause" and threading.Thread(
        target=lambda: send(tmp_path / "plain", "resume")).start())
    assert plain.run() == 0
    def figures(s):
        return [(r["loss"], r["scale"], r["skipped"]) for r in s.steps]
    assert figures(read_session(tmp_path / "plain")) == figures(session)


def test_report_lists_the_closest_ops_of_the_last_xray(write_script, tmp_path, capsys):
    script = write_script(SCRIPT)
    assert main(["train", str(script), "--headless", "--device", "cpu", "--dtype", "fp16", "--steps", "3",
                 "--run-dir", str(tmp_path / "run"), "--at", "0:xray", "--at", "2:xray"]) == 0
    xray = json.loads((tmp_path / "run" / "xray-step-0000002.json").read_text(encoding="utf-8"))
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "xray-step-0000002.json" in out and "xray-step-0000000.json" not in out
    first = xray["closest"][0]
    assert f"{first['headroom_bits']:.1f} bits  {first['op']} ({first['phase']}, {first['dtype']})" in out
