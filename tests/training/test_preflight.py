"""The pre-flight check: the first step's own forward, under every precision policy of the run,
so a broken script exits 2 before anything is written and a working one starts exactly as a plain
loop would."""


import pytest
import torch
from torch import nn

from amp_tui.cli import main
from amp_tui.training.step.engine import GuardedTrainer

from support import strict_lines

# A module that fails under autocast, as nn.LSTM does on some CPUs ("could not create a primitive
# descriptor"): what --fp32-modules is for.
FRAGILE_SCRIPT = '''
import torch
from torch import nn

class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
    def forward(self, x):
        if torch.is_autocast_enabled(x.device.type):
            raise RuntimeError("could not create a primitive descriptor under autocast")
        return self.proj(x)

def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Fragile(), nn.Linear(8, 1))
    xs = torch.randn(32, 8)
    batches = [(xs[i:i + 8], xs[i:i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]
    def loss_fn(model, batch):
        return nn.functional.mse_loss(model(batch[0]), batch[1])
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
            "loss_fn": loss_fn, "batches": batches}
'''


def train(script, run_dir, *flags):
    status = main(["train", str(script), "--headless", "--run-dir", str(run_dir), *flags])
    lines = strict_lines(run_dir / "session.jsonl") if (run_dir / "session.jsonl").exists() else []
    return status, lines


def test_a_module_failing_under_autocast_fails_the_preflight(write_script, tmp_path, capsys):
    script = write_script(FRAGILE_SCRIPT)
    status, _ = train(script, tmp_path / "run", "--steps", "2")
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "loss_fn in train_script.py failed on the first batch: RuntimeError: could not create" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, step0_dtype, step0_fp32", [
    (["--fp32-modules", "1"], "float16", ["1"]),
    (["--at", "0:fp32=1"], "float16", ["1"]),
    (["--at", "0:dtype=fp32"], "float32", []),
    (["--at", "0:scale=1024", "--at", "0:fp32=1"], "float16", ["1"]),
])
def test_every_precision_policy_is_in_place_before_the_preflight(write_script, tmp_path, flags,
                                                                  step0_dtype, step0_fp32):
    script = write_script(FRAGILE_SCRIPT)
    status, lines = train(script, tmp_path / "run", "--steps", "3", *flags)
    assert status == 0
    steps = [r for r in lines if r["type"] == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2] and steps[0]["dtype"] == step0_dtype
    header = lines[0]
    # The header keeps the starting precision; --at 0:... follows as events, before step 0.
    assert header["dtype"] == "float16" and header["fp32_modules"] == (["1"] if "--fp32-modules" in flags else [])
    at_events = [r for r in lines[:lines.index(steps[0])] if r["type"] == "event"]
    assert [e["action"] for e in at_events] == [f.split(":")[1].split("=")[0] for f in flags if f.startswith("0:")]
    if at_events:
        assert at_events[-1]["after"].get("fp32_modules", step0_fp32) == step0_fp32


def test_a_real_lstm_that_fails_under_autocast_runs_with_fp32_modules(write_script, tmp_path):
    lstm = nn.LSTM(8, 16, batch_first=True)
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            lstm(torch.randn(2, 3, 8))[0].sum().backward()
        pytest.skip("nn.LSTM works under fp16 CPU autocast here")
    except RuntimeError:
        pass
    script = write_script('''
import torch
from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 1)
    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])
def setup():
    torch.manual_seed(0)
    model = Net()
    data = [(torch.randn(4, 5, 8), torch.randn(4, 1)) for _ in range(3)]
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "loss_fn": lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), "batches": data}
''')
    status, lines = train(script, tmp_path / "run", "--steps", "3", "--fp32-modules", "rnn")
    assert status == 0 and [r["step"] for r in lines if r["type"] == "step"] == [0, 1, 2]


# A GRU-like language model whose loss_fn carries the hidden state across batches, with dropout:
# an extra loss_fn call (or random numbers drawn for it) changes every later loss.
STATEFUL_SCRIPT = '''
from pathlib import Path
import torch
from torch import nn

class CharRNN(nn.Module):
    def __init__(self, vocab=12, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.cell_x, self.cell_h = nn.Linear(width, width), nn.Linear(width, width, bias=False)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(width, vocab)
    def forward(self, tokens, h):
        outs = []
        for x in self.embed(tokens).unbind(1):
            h = torch.tanh(self.cell_x(x) + self.cell_h(h))
            outs.append(self.head(self.drop(h)))
        return torch.stack(outs, 1), h

def parts():
    torch.manual_seed(0)
    model = CharRNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    text = torch.randint(0, 12, (4, 41))
    batches = [text[:, i:i + 9] for i in range(0, 40, 8)]   # consecutive windows: state carries over
    state = {"h": torch.zeros(4, 16), "calls": 0}
    def loss_fn(model, batch):
        state["calls"] += 1
        (Path(__file__).parent / "calls.txt").write_text(str(state["calls"]))
        logits, h = model(batch[:, :-1], state["h"].to(batch.device))
        state["h"] = h.detach()                              # truncated BPTT across batches
        return nn.functional.cross_entropy(logits.float().reshape(-1, 12), batch[:, 1:].reshape(-1))
    return model, opt, loss_fn, batches

def setup():
    model, opt, loss_fn, batches = parts()
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches}

def plain_loop_losses(steps, dtype):
    """The canonical AMP loop, no amp-tui: the losses a run must reproduce exactly."""
    model, opt, loss_fn, batches = parts()
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0, enabled=dtype == torch.float16)
    losses = []
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model, batches[k % len(batches)])
        losses.append(float(loss.detach().float()))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return losses
'''


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_stateful_loss_fn_gives_a_plain_loops_losses_exactly(write_script, tmp_path, dtype):
    script = write_script(STATEFUL_SCRIPT)
    steps = 8   # more than the batches: the state carries over a re-iteration too
    status, lines = train(script, tmp_path / "run", "--steps", str(steps), "--dtype", dtype)
    assert status == 0
    assert (tmp_path / "calls.txt").read_text() == str(steps)  # one loss_fn call per step, no more
    recorded = [r["loss"] for r in lines if r["type"] == "step"]
    namespace = {"__file__": str(tmp_path / "reference.py")}
    exec(script.read_text(), namespace)
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert recorded == namespace["plain_loop_losses"](steps, torch_dtype)


MLP_ONE_BATCH = '''
import torch
from torch import nn
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(16, 8)
    def loss_fn(model, batch):
        return nn.functional.mse_loss(model(batch), batch.sum(1, keepdim=True))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
            "loss_fn": loss_fn, "batches": [x]}
'''


def _step_losses(lines):
    return [r["loss"] for r in lines if r["type"] == "step"]


@pytest.mark.parametrize("late_change, same_as", [
    (["--at", "0:dtype=bf16"], ["--dtype", "bf16"]),
    (["--at", "0:fp32=0"], ["--fp32-modules", "0"]),
])
def test_a_precision_change_after_the_preflight_runs_the_forward_again(write_script, tmp_path,
                                                                        late_change, same_as):
    script = write_script(MLP_ONE_BATCH)
    # A save scheduled first keeps its place, so the change comes after the pre-flight's forward.
    _, changed = train(script, tmp_path / "changed", "--steps", "1", "--at", "0:save", *late_change)
    _, reference = train(script, tmp_path / "reference", "--steps", "1", *same_as)
    _, plain = train(script, tmp_path / "plain", "--steps", "1")
    assert _step_losses(plain) != _step_losses(reference)  # the change shows in the loss
    assert _step_losses(changed) == _step_losses(reference)


def test_a_restore_before_the_first_step_runs_the_forward_again(write_script, tmp_path):
    script = write_script(MLP_ONE_BATCH)
    _, first = train(script, tmp_path / "first", "--steps", "3", "--at", "2:save")
    checkpoint = tmp_path / "first" / "checkpoints" / "step-0000002.safetensors"
    _, restored = train(script, tmp_path / "restored", "--steps", "1", "--at", f"0:restore={checkpoint}")
    # One batch: after restoring step 2's weights, step 0 computes what step 2 did.
    assert _step_losses(restored) == _step_losses(first)[2:3]
    assert _step_losses(first)[0] != _step_losses(first)[2]


def test_start_step_is_kept_only_for_its_own_batch():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                             lambda m, b: m(b).pow(2).mean(), dtype="fp32")
    kept, other = torch.randn(8, 4), torch.randn(8, 4) * 3
    ahead = trainer.start_step(kept)
    assert trainer.step([other]).loss == float(model(other).pow(2).mean().detach())  # not the kept forward
    trainer.start_step(kept)
    assert trainer.step([kept]).loss == float(ahead.detach())


def test_a_resumed_run_calls_loss_fn_once_per_step_on_the_loaded_weights(write_script, tmp_path):
    script = write_script(MLP_ONE_BATCH.replace(
        "    def loss_fn(model, batch):\n",
        "    calls = [0]\n"
        "    def loss_fn(model, batch):\n"
        "        calls[0] += 1\n"
        "        (__import__('pathlib').Path(__file__).parent / 'calls.txt').write_text(str(calls[0]))\n"))
    _, straight = train(script, tmp_path / "straight", "--steps", "12")
    train(script, tmp_path / "run", "--steps", "4", "--checkpoint-every", "2")
    assert main(["train", str(script), "--headless", "--steps", "6", "--resume", str(tmp_path / "run")]) == 0
    lines = strict_lines(tmp_path / "run" / "session.jsonl")
    resumed_at = next(i for i, r in enumerate(lines) if r.get("kind") == "resumed")
    resumed = [r for r in lines[resumed_at:] if r["type"] == "step"]
    assert resumed and (tmp_path / "calls.txt").read_text() == str(len(resumed))  # no extra call
    by_step = {r["step"]: r["loss"] for r in straight if r["type"] == "step"}
    assert [r["loss"] for r in resumed] == [by_step[r["step"]] for r in resumed]  # the loaded weights
