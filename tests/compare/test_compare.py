"""`amp-tui compare`: fp32 reference vs AMP dtypes on a fixed eval set, then (optionally) speed.

Tiny models only: fp16 matmuls are slow on these CPUs.
"""

import json
import subprocess
import sys

import pytest
import torch

from amp_tui.cli import main
from amp_tui.cli.compare import parse_max_flips
from amp_tui.compare import decisions, validation
from amp_tui.compare.criteria import DEFAULT_ATOL, Criteria
from amp_tui.compare.speed import lean_steps

# One layer planted to overflow fp16: `up` multiplies by ~1e5, so its output passes 65504 and is
# inf under fp16 autocast; `down` brings it back to O(1), so fp32 and bf16 stay finite.
PLANTED = '''
import torch
from torch import nn


class Planted(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        with torch.no_grad():
            self.up.weight.mul_(1e5)
            self.up.bias.mul_(1e5)
            self.down.weight.mul_(1e-5)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.head(torch.relu(self.down(self.up(h))))


def setup(ctx=None):
    torch.manual_seed(0)
    model = Planted()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(6)]

    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches}
'''

# An identity "classifier" whose eval set holds one planted near-tie: the reference scores of
# row 5 are 1.0 and 1.003 (class 1 wins by 0.003). bf16 rounds 1.003 to 1.0 (its spacing near 1
# is 2**-7), the two scores tie and the argmax moves to class 0. eval_batches are dicts, which the
# default predict could not call the model on: only the script's predict() makes this run.
NEAR_TIE = '''
import torch
from torch import nn


def setup(ctx=None):
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = [(torch.randn(4, 2), torch.randint(0, 2, (4,))) for _ in range(3)]
    rows = [[2.0, 0.0], [0.0, 2.0]] * 10
    rows[5] = [1.0, 1.003]
    x = torch.tensor(rows)
    y = x.argmax(1)
    eval_batches = [{"x": x[:10], "y": y[:10]}, {"x": x[10:], "y": y[10:]}]

    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    def predict(model, batch):
        return model(batch["x"])

    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": train,
            "eval_batches": eval_batches, "predict": predict}
'''


@pytest.fixture(autouse=True)
def _one_thread():
    # Two shared cores: one intra-op thread keeps timings steady and the suite quick.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def strict(text: str):
    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=reject)


def run(argv, capsys):
    status = main(["compare", *[str(a) for a in argv]])
    out, err = capsys.readouterr()
    return status, out, err


def by_dtype(data):
    return {r["dtype"]: r for r in data["results"]}


def test_planted_overflow_fails_fp16_passes_bf16(write_script, capsys):
    script = write_script(PLANTED)
    status, out, err = run([script], capsys)
    assert status == 1, err
    assert "FAIL  fp16" in out and "non-finite" in out
    assert "PASS  bf16" in out
    # the criteria come first, before any result
    assert out.index("criteria, declared before the run") < out.index("scores and decisions")

    status, out, _ = run([script, "--json"], capsys)
    data = strict(out)
    assert status == 1 and data["exit_status"] == 1 and data["passed"] is False
    fp16, bf16 = by_dtype(data)["float16"], by_dtype(data)["bfloat16"]
    assert fp16["status"] == "fail" and fp16["finite"] is False and fp16["nonfinite"] > 0
    assert "finite" in fp16["failed"] and fp16["max_abs"] == "Infinity"
    assert bf16["status"] == "pass" and bf16["finite"] is True and bf16["failed"] == []
    assert bf16["out_of_tolerance"] == 0 and 0 < bf16["max_abs"] < 1
    assert data["reference"]["finite"] is True
    assert data["eval_set"] == {"source": "batches", "batches": 4, "samples": 64, "predict": "default"}
    assert data["criteria"]["atol"] == DEFAULT_ATOL
    assert data["speed"] is None

    status, out, _ = run([script, "--dtypes", "bf16", "--eval-batches", "2"], capsys)
    assert status == 0 and "PASS  bf16" in out and "fp16" not in out.split("criteria")[1]


def test_near_tie_is_listed_apart_and_does_not_fail(write_script, capsys):
    script = write_script(NEAR_TIE)
    status, out, err = run([script, "--dtypes", "bf16", "--json"], capsys)
    assert status == 0, err
    data = strict(out)
    assert data["eval_set"]["source"] == "eval_batches" and data["eval_set"]["predict"] == "script"
    assert data["eval_set"]["samples"] == 20  # the script's eval_batches, not its training batches
    assert data["reference"]["near_ties"] == 1
    assert data["reference"]["near_tie_samples"] == [[0, 5]]
    bf16 = by_dtype(data)["bfloat16"]
    assert bf16["status"] == "pass"
    assert bf16["flips"] == 0 and bf16["near_tie_flips"] == 1
    flip = bf16["near_tie_flip_samples"][0]
    assert flip["index"] == [0, 5] and flip["fp32"] == 1 and flip["amp"] == 0
    assert flip["margin"] == pytest.approx(0.003, abs=1e-4)
    assert bf16["agreement"] == pytest.approx(0.95)
    # labels found under the dict's "y": accuracy is reported beside agreement
    assert data["reference"]["accuracy"] == 1.0 and bf16["accuracy"] == pytest.approx(0.95)
    status, out, _ = run([script, "--dtypes", "bf16"], capsys)
    assert status == 0
    assert "near-tie flips (not counted) at (0, 5) 1→0" in out
    assert "PASS  bf16" in out


def test_a_real_flip_fails_max_flips_0(write_script, capsys):
    # The same sample, with a tie margin below its 0.003 gap: now it is a real flip.
    script = write_script(NEAR_TIE)
    status, out, _ = run([script, "--dtypes", "bf16", "--tie-margin", "0.001", "--json"], capsys)
    data = strict(out)
    bf16 = by_dtype(data)["bfloat16"]
    assert status == 1
    assert bf16["status"] == "fail" and bf16["failed"] == ["flips"]
    assert bf16["flips"] == 1 and bf16["near_tie_flips"] == 0
    assert bf16["flip_samples"][0]["index"] == [0, 5]
    assert data["criteria"]["tie_margin"] == 0.001 and data["criteria"]["max_flips"]["count"] == 0

    status, out, _ = run([script, "--dtypes", "bf16", "--tie-margin", "0.001"], capsys)
    assert status == 1 and "FAIL  bf16: 1 decision flip (allowed ≤ 0)" in out
    assert "decision flips at (0, 5) 1→0" in out
    # a declared allowance passes it: as a count, or as a share of the 20 samples
    for allowance in ("1", "5%"):
        status, _, _ = run([script, "--dtypes", "bf16", "--tie-margin", "0.001",
                            "--max-flips", allowance], capsys)
        assert status == 0, allowance
    # ... and a stricter agreement threshold fails it again
    status, out, _ = run([script, "--dtypes", "bf16", "--max-flips", "1", "--min-agreement", "0.99"],
                         capsys)
    assert status == 1 and "agreement 0.9500 < 0.99" in out


def test_speed_measures_passing_dtypes_only(write_script, capsys):
    script = write_script(PLANTED)
    status, out, err = run([script, "--speed", "--speed-steps", "3", "--warmup", "1",
                            "--eval-batches", "2", "--json"], capsys)
    assert status == 1, err  # fp16 still fails validation
    speed = strict(out)["speed"]
    assert speed["steps"] == 3 and speed["warmup"] == 1
    runs = {r["dtype"]: r for r in speed["runs"]}
    assert list(runs) == ["float32", "bfloat16"]  # fp16 failed: not measured
    for r in runs.values():
        assert r["error"] is None
        assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    assert runs["float32"]["time_ratio_vs_fp32"] == 1.0
    assert runs["bfloat16"]["time_ratio_vs_fp32"] == pytest.approx(
        runs["bfloat16"]["median_ms"] / runs["float32"]["median_ms"], rel=1e-3)
    assert runs["bfloat16"]["skipped_updates"] == 0

    status, out, _ = run([script, "--speed", "--speed-steps", "2", "--warmup", "0",
                          "--eval-batches", "1"], capsys)
    assert "median of 2 after 0 warm-up" in out and "memory:" in out


def test_speed_is_skipped_when_nothing_passed(write_script, capsys):
    script = write_script(PLANTED)
    status, out, _ = run([script, "--dtypes", "fp16", "--speed", "--eval-batches", "1"], capsys)
    assert status == 1
    assert "no dtype passed validation" in out


def test_script_errors_exit_2_with_one_line(write_script, tmp_path, capsys):
    cases = {
        "x = 1\n": "has no setup() function",
        PLANTED.replace("return {\"model\"", "return {'eval_batches': [], \"model\""):
            "'eval_batches' from train_script.py is empty",
        NEAR_TIE.replace("return model(batch[\"x\"])", "raise KeyError('x')"):
            "predict in train_script.py failed on eval batch 0 in fp32: KeyError: 'x'",
        # the default predict can't call Linear on a dict batch
        NEAR_TIE.replace('"predict": predict', '"accumulate": 1'):
            "the model (default predict: the model's output) failed on eval batch 0 in fp32",
    }
    for body, expected in cases.items():
        script = write_script(body)
        status, out, err = run([script], capsys)
        assert status == 2, (expected, out, err)
        assert len(err.strip().splitlines()) == 1 and expected in err, err
    status, _, err = run([tmp_path / "missing.py"], capsys)
    assert status == 2 and "script not found" in err
    with pytest.raises(SystemExit) as exc:  # usage errors are argparse's exit 2
        main(["compare", str(script), "--dtypes", "fp32"])
    assert exc.value.code == 2
    assert "fp32 is the reference" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["compare", str(script), "--dtypes", "fp16,fp8"])
    assert exc.value.code == 2
    assert "amp-tui fp8 SCRIPT" in capsys.readouterr().err


def test_nonfinite_reference_fails(write_script, capsys):
    script = write_script(PLANTED.replace("self.up.weight.mul_(1e5)", "self.up.weight.mul_(1e40)"))
    status, out, _ = run([script, "--json", "--eval-batches", "1"], capsys)
    data = strict(out)
    assert status == 1 and data["reference"]["finite"] is False and data["results"] == []
    status, out, _ = run([script, "--eval-batches", "1"], capsys)
    assert status == 1 and "the fp32 reference has non-finite outputs" in out


def test_unsupported_dtype_is_reported_not_a_crash(write_script, capsys, monkeypatch):
    from amp_tui.core import precision
    real = validation.unsupported_reason
    monkeypatch.setattr(validation, "unsupported_reason",
                        lambda device, dtype: "bf16 is not supported on this test device"
                        if precision.canonical(dtype) == "bfloat16" else real(device, dtype))
    script = write_script(NEAR_TIE)
    status, out, _ = run([script, "--dtypes", "bf16", "--json"], capsys)
    bf16 = by_dtype(strict(out))["bfloat16"]
    assert status == 1 and bf16["status"] == "unsupported" and "not supported" in bf16["reason"]
    status, out, _ = run([script, "--dtypes", "fp16,bf16"], capsys)
    assert status == 1 and "PASS  fp16" in out and "FAIL  bf16: unsupported here" in out


def test_decisions_single_output_and_labels():
    crit = Criteria(atol=0.01, rtol=0.0)
    scores = torch.tensor([[0.5], [-0.2], [0.004]])
    kind = decisions.decision_kind(scores)
    assert kind == "sign"
    assert decisions.decide(scores, kind).tolist() == [1, 0, 1]
    near, gap = decisions.near_ties(scores, kind, crit)
    assert near.tolist() == [False, False, True]
    multi = torch.tensor([[1.0, 1.005, 0.0], [3.0, 0.0, 0.0]])
    assert decisions.decision_kind(multi) == "argmax"
    near, gap = decisions.near_ties(multi, "argmax", crit)
    assert near.tolist() == [True, False] and gap[1] == 3.0
    labels = torch.tensor([1, 0])
    assert decisions.find_labels((multi, labels), torch.Size([2])) is labels
    assert decisions.find_labels({"labels": labels}, torch.Size([2])) is labels
    assert decisions.find_labels((multi, torch.randn(2)), torch.Size([2])) is None


@pytest.mark.parametrize("text, count, share", [("0", 0, None), ("3", 3, None),
                                                ("0.01", None, 0.01), ("2%", None, 0.02)])
def test_max_flips_parses_a_count_or_a_share(text, count, share):
    parsed = parse_max_flips(text)
    assert parsed.count == count
    assert parsed.share == (pytest.approx(share) if share is not None else None)


def test_lean_steps_counts_skipped_updates_without_warmup():
    # A loss of ~1.6e5 times GradScaler's 65536 overflows fp16 in the backward pass: the first
    # steps are skipped (the scale halves each time), which the speed table must show.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    batches = [(torch.randn(8, 4), torch.full((8, 1), 400.0))]

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    run = lean_steps(model, opt, loss_fn, batches, torch.device("cpu"), "float16",
                     steps=3, warmup=0)
    assert len(run.step_ms) == 3 and run.median_ms > 0
    assert run.skipped_updates == 3 and run.peak_bytes is None
    run = lean_steps(model, opt, loss_fn, batches, torch.device("cpu"), "bfloat16",
                     steps=2, warmup=1)
    assert run.skipped_updates == 0 and len(run.step_ms) == 2


def test_a_dtype_whose_predict_raises_is_an_error_not_a_crash(write_script, capsys):
    body = NEAR_TIE.replace('return model(batch["x"])',
                            'if torch.is_autocast_enabled("cpu"):\n'
                            '            raise NotImplementedError("no half kernel")\n'
                            '        return model(batch["x"])')
    script = write_script(body)
    status, out, _ = run([script, "--dtypes", "bf16", "--json"], capsys)
    bf16 = by_dtype(strict(out))["bfloat16"]
    assert status == 1 and bf16["status"] == "error" and bf16["failed"] == ["error"]
    assert "failed on eval batch 0 under bf16 autocast: NotImplementedError: no half kernel" in bf16["reason"]
    status, out, _ = run([script, "--dtypes", "bf16"], capsys)
    assert status == 1 and "FAIL  bf16: predict in train_script.py failed on eval batch 0" in out


def test_the_compare_parser_is_built_without_torch():
    # Every command builds the whole parser, compare's included: `report`, `replay` and `ls`
    # must not pay for importing torch (about a second) because compare is registered.
    code = ("import argparse, sys\n"
            "import amp_tui.compare\n"
            "from amp_tui.cli.compare import add_parser\n"
            "add_parser(argparse.ArgumentParser().add_subparsers())\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
