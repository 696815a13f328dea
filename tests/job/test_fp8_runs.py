"""`amp-tui train --dtype fp8`: the what-if of the first step chooses the layers (or `--fp8-filter`
does), each probed step records the fp8 layers' amax, `dtype=bf16` takes the run back and
`dtype=fp8` in again, an fp32 module stays out of fp8, a checkpoint restores in fp8, a non-finite
step is traced to its op and the ladder goes to bf16; in the user's own loop fp8 is refused with
what to do instead."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from amp_tui import monitor  # noqa: E402
from amp_tui.job.drivers.hook_driver import MonitorError  # noqa: E402
from amp_tui.recording.reader import read_session  # noqa: E402
from amp_tui.training.script import ScriptError  # noqa: E402
from amp_tui.training.step.guards import GuardConfig  # noqa: E402

from support import DEMOS, train_run  # noqa: E402

DEMO = DEMOS / "fp8_outliers.py"
LINEAR = {f"blocks.{b}.fc{i}" for b in range(4) for i in (1, 2)} | {"embed", "head"}


def events_of(session, kind):
    return [e for e in session.events if e["kind"] == kind]


def fp8_rows(step, names):
    return {n: row for n, row in zip(names, step["layers"]["fp8"]) if row is not None} if "fp8" in step.get(
        "layers", {}) else {}


def test_fp8_from_the_first_step_back_to_bf16_and_in_again(tmp_path):
    run_dir = tmp_path / "fp8"
    run = train_run(DEMO, run_dir, steps=14, device="cpu", dtype="float8", probe_every=2,
                    at=["6:dtype=bf16", "10:dtype=fp8"])
    assert run.run() == 0
    session = read_session(run_dir)
    names = session.header["layers"]
    # The what-if of step 0 ran first and chose: every Linear but the one behind massive channels.
    [whatif] = events_of(session, "fp8")
    assert whatif["step"] == 0 and whatif["kept"] == ["blocks.2.fc2"] and whatif["source"] == "fp8 entry"
    assert (run_dir / "fp8-filter-step-0000000.py").is_file()
    first, again = events_of(session, "fp8_layers")
    assert first["step"] == 0 and set(first["layers"]) == LINEAR - {"blocks.2.fc2"}
    assert first["filter"] == "fp8-filter-step-0000000.py"
    assert again["step"] == 10 and again["layers"] == first["layers"]   # no second what-if ...
    assert again["filter"] == "fp8-filter-step-0000000.py"            # ... step 0's chose
    by_step = {s["step"]: s for s in session.steps}
    assert [by_step[i]["dtype"] for i in (0, 5, 6, 9, 10, 13)] == ["float8"] * 2 + ["bfloat16"] * 2 + ["float8"] * 2
    # Probed fp8 steps: the amax of each fp8 layer's input, weight and output gradient.
    amax = fp8_rows(by_step[4], names)
    assert set(amax) == set(first["layers"]) and all(all(v > 0 for v in row) for row in amax.values())
    assert not fp8_rows(by_step[8], names)   # bf16: no layer in fp8
    assert set(fp8_rows(by_step[12], names)) == set(first["layers"])
    assert [(e["before"]["dtype"], e["after"]["dtype"]) for e in session.events
            if e["kind"] == "intervention" and e["action"] == "dtype"] == [
        ("float8", "bfloat16"), ("bfloat16", "float8")]
    assert all(s["loss"] == s["loss"] and not s["skipped"] for s in session.steps)


def test_a_filter_file_and_an_fp32_module(tmp_path):
    chosen = tmp_path / "filter.py"
    chosen.write_text("def module_filter_fn(module, fqn):\n    return fqn.startswith('blocks.')\n")
    run_dir = tmp_path / "filtered"
    run = train_run(DEMO, run_dir, steps=4, device="cpu", dtype="float8", fp8_filter=chosen,
                    fp32_modules=["blocks.1"])
    assert run.run() == 0
    session = read_session(run_dir)
    assert not events_of(session, "fp8")   # the file chose: no what-if
    [entered] = events_of(session, "fp8_layers")
    assert entered["filter"] == str(chosen)
    # blocks.1 runs in fp32, and so out of fp8.
    assert set(entered["layers"]) == {f"blocks.{b}.fc{i}" for b in (0, 2, 3) for i in (1, 2)}
    assert session.header["fp8_filter"] == str(chosen)


def test_a_bad_filter_file_is_named_before_anything_runs(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def module_filter_fn(:\n")
    with pytest.raises(ScriptError, match=r"--fp8-filter .*broken\.py: SyntaxError"):
        train_run(DEMO, tmp_path / "never", steps=2, device="cpu", dtype="float8", fp8_filter=broken)
    assert not (tmp_path / "never" / "session.jsonl").exists()


def test_a_checkpoint_saved_in_fp8_restores_in_fp8(tmp_path):
    run_dir = tmp_path / "saved"
    run = train_run(DEMO, run_dir, steps=8, device="cpu", dtype="float8", at=["3:save", "6:restore=latest"])
    assert run.run() == 0
    session = read_session(run_dir)
    [restored] = events_of(session, "checkpoint_restored")
    assert restored["step"] == 6 and restored["checkpoint_dtype"] == "float8"
    steps = [s for s in session.steps if s["step"] >= 6]
    assert steps and all(s["dtype"] == "float8" and not s["skipped"] for s in steps)


def test_the_users_own_loop_is_told_how_to_train_in_fp8(tmp_path):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(MonitorError, match="convert_to_float8_training"):
        monitor(model, opt, dtype="fp8", run_dir=tmp_path / "own", announce=False, control=False)


OVERFLOW = '''
import torch
from torch import nn

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = torch.randn(8, 16, 32)
    xs[3] *= 1e37          # batch 3: its loss overflows float32, whatever the layers run in
    ys = torch.randn(8, 16, 16)
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x).float(), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": list(zip(xs, ys))}
'''


def test_a_non_finite_step_in_fp8_is_traced_to_its_op_and_the_ladder_goes_to_bf16(write_script, tmp_path):
    script = write_script(OVERFLOW)
    run_dir = tmp_path / "overflow"
    run = train_run(script, run_dir, steps=6, device="cpu", dtype="float8", on_nonfinite="fallback",
                    guard=GuardConfig(fallback_after=1))
    assert run.run() == 0
    session = read_session(run_dir)
    [bad] = events_of(session, "nonfinite")
    # The replay runs through the fp8 layers (torchao's tensors) to the op that overflowed.
    assert bad["step"] == 3 and bad["dtype"] == "float8" and bad["op"] == "aten.mse_loss"
    moved = [e for e in session.events if e["kind"] == "intervention" and e["action"] == "dtype"]
    assert [(e["before"]["dtype"], e["after"]["dtype"]) for e in moved] == [("float8", "bfloat16")]
    assert [s["dtype"] for s in session.steps if s["step"] > 3] == ["bfloat16"] * 2
