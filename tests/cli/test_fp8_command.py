"""`amp-tui fp8 SCRIPT`: the what-if in one command, on the demo whose one layer sits behind
massive channels: that layer, and only it, kept in bf16; the table, the files, the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from amp_tui.cli import main

DEMO = Path(__file__).resolve().parents[2] / "demos" / "fp8_outliers.py"


def test_the_demo_keeps_the_layer_behind_massive_channels_in_bf16(tmp_path, capsys):
    assert main(["fp8", str(DEMO), "--step", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("layer "):]
    lines = {line.split()[0]: line.split()[1] for line in table.splitlines()[1:] if line and not line.startswith(" ")
             and line.split()[0] not in ("kept", "what-if:", "filter:")}
    assert lines["blocks.2.fc2"] == "bf16"
    assert {m for m, v in lines.items() if v == "bf16"} == {"blocks.2.fc2"}
    assert len(lines) == 10
    assert f"filter:  {tmp_path / 'run' / 'fp8-filter-step-0000002.py'}" in out
    assert (tmp_path / "run" / "fp8-step-0000002.json").is_file()



def test_fp8_json_prints_the_verdict(tmp_path, capfd):
    assert main(["fp8", str(DEMO), "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--json"]) == 0
    out = capfd.readouterr().out
    said = json.loads(out[out.rindex("\n{\n") + 1:])
    assert said["step"] == 0 and said["filter"] == "fp8-filter-step-0000000.py"
    assert said["verdict"]["blocks.2.fc2"].startswith("bf16: ")


def test_a_step_the_run_never_reaches_is_said(write_script, tmp_path, capsys):
    script = write_script("""
import torch
def setup(ctx=None):
    model = torch.nn.Linear(4, 4)
    def loss_fn(model, batch):
        if batch == 2:
            raise RuntimeError("the data ran dry")
        return model(torch.ones(2, 4)).sum()
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "loss_fn": loss_fn,
            "batches": [0, 1, 2]}
""")
    assert main(["fp8", str(script), "--step", "5", "--device", "cpu", "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "no fp8 what-if was recorded" in err and "the run ended before step 5" in err
