"""What the tests share: small training scripts, a loop under the monitor, a live run for the
dashboard, waiting on a run's own progress (never on how fast this machine is), a disk that fills
up, a synthetic recording."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import math
import time
from pathlib import Path

import torch
from textual.widgets._toast import Toast
from torch import nn

import amp_tui
from amp_tui.core.commands import parse_action, parse_at
from amp_tui.job.build import build_run
from amp_tui.job.config import RunConfig
from amp_tui.recording.format import event_record, step_record
from amp_tui.recording.reader import read_session
from amp_tui.recording.writer import SessionWriter
from amp_tui.sources.live import LiveSource
from amp_tui.training.checkpoint import read_checkpoint
from amp_tui.training.probes.layer_probes import LayerFigures
from amp_tui.training.script import load_script
from amp_tui.training.step.engine import StepResult

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DEMOS = REPO / "demos"


def strict_lines(path: Path) -> list[dict]:
    """Every line of a session, parsed with a parser that rejects NaN/Infinity tokens."""
    def reject(token):
        raise ValueError(f"non-standard token {token}")
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        out.append(json.loads(line, parse_constant=reject))
    return out


MLP_SCRIPT = '''
import torch
from torch import nn

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = torch.randn(64, 8)
    ys = xs.sum(1, keepdim=True)
    batches = [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, 64, 16)]
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches}
'''


# Regression targets ~300x the features: a loss of ~1e5-1e6 whose backward overflows fp16 at
# init_scale 65536. ACC is replaced by the micro-batch count.
OVERFLOW_SCRIPT = '''
import torch
from torch import nn

def setup(ctx=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    xs = torch.randn(64, 8)
    ys = xs.sum(1, keepdim=True) * 300          # a loss of ~1e5-1e6: overflows backward at 65536
    batches = [(xs[i:i + 16], ys[i:i + 16]) for i in range(0, 64, 16)]
    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches, "accumulate": ACC}
'''


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


SLOW_SCRIPT = '''
import time
import torch
from torch import nn

def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    def loss_fn(m, b):
        time.sleep(0.05)
        return nn.functional.mse_loss(m(b[0]), b[1])
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3),
            "loss_fn": loss_fn, "batches": [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(5)]}
'''


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def recorded_steps(run_dir) -> list[dict]:
    """The step records of a run that may be starting: none while its session file is missing or
    its header is still being written."""
    from amp_tui.recording.format import NoSessionError, SessionStarting
    from amp_tui.recording.reader import read_session
    try:
        return read_session(run_dir).steps
    except (NoSessionError, SessionStarting, FileNotFoundError):
        return []


def step_count(path):
    try:
        return sum(1 for line in path.read_text().splitlines() if '"type":"step"' in line)
    except OSError:
        return 0


SIZE = (120, 40)


# A step that hangs from step 2 on, until the test lets it go (a file "release" beside the script;
# 120 s at most, so that a failed test leaves no step behind), not for a fixed time: on a loaded
# machine a key pressed late in a step of fixed length could land after the step ended.
HELD_SCRIPT = '''
import time
from pathlib import Path
import torch
from torch import nn

steps = {"n": 0}
release = Path(__file__).with_name("release")

def setup(ctx=None):
    model = nn.Linear(4, 1)
    xs = torch.randn(8, 4)
    def loss_fn(model, batch):
        if model.training:           # every call is a step's (the pre-flight check is step 0's forward)
            steps["n"] += 1
            deadline = time.monotonic() + 120
            while steps["n"] > 2 and not release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)     # from step 2 on, every step waits for the test
        return model(batch).pow(2).mean()
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=1e-2),
            "loss_fn": loss_fn, "batches": [xs]}
'''


# Block 1's q and k grown 200 times: its attention scores overflow fp16 in the forward product.
ATTENTION_SCRIPT = '''
import math
import torch
import torch.nn.functional as F
from torch import nn

D = 16

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)
        return self.o(self.drop(scores.softmax(-1)) @ v)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return self.norm(x + self.attn(x))

class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

def setup(ctx=None):
    torch.manual_seed(0)
    model = TinyTransformer()
    with torch.no_grad():
        model.blocks[1].attn.q.weight.mul_(200.0)
        model.blocks[1].attn.k.weight.mul_(200.0)
    batches = [(torch.randn(2, 8, D), torch.randint(0, 4, (2, 8))) for _ in range(4)]
    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.0),
            "loss_fn": loss_fn, "batches": batches}
'''


def train_config(script, run_dir, *, at=(), **fields) -> RunConfig:
    """What `amp-tui train SCRIPT --run-dir RUN_DIR` asks for: `at` in `--at`'s words ("4:save"),
    the other fields as RunConfig names them (steps=12, dtype="float32"). Like the command
    line's, the run serves its control socket unless control=False."""
    fields.setdefault("control", True)
    return RunConfig(script=Path(script), run_dir=Path(run_dir), at=[parse_at(text) for text in at], **fields)


def train_run(script, run_dir, *, at=(), **fields):
    """`train_config`'s run, built as the command line builds it (its pre-flight check passed)."""
    return build_run(train_config(script, run_dir, at=at, **fields)).run


def build_live(script, run_dir, *, at=(), **fields):
    """A run for the dashboard (on the CPU, pausing on a non-finite loss) and its live source."""
    fields = {"device": "cpu", "on_nonfinite": "pause", "command_line": ["amp-tui", "train", str(script)],
              **fields}
    run = train_run(script, run_dir, at=at, **fields)
    return run, LiveSource(run)


# How long `until` waits by default: what it waits for happens in well under a second on an idle
# machine; the deadline only has to end a test that hangs, also where two suites share the cores.
UI_WAIT_S = 60.0


async def until(pilot, predicate, what: str, timeout: float = UI_WAIT_S) -> None:
    """Poll the UI (letting it run) until `predicate()` holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await pilot.pause(0.03)


def toasts(app) -> str:
    """The text of the notifications on screen now."""
    return "\n".join(t.render().plain for t in app.screen.query(Toast))


def notified(app) -> list[str]:
    """Every message `app` notifies from now on, kept: a toast on screen lasts a few seconds (and the
    app may exit meanwhile), which a poll on a loaded machine can miss."""
    said: list[str] = []
    notify = app.notify

    def keep(message, **options):
        said.append(str(message))
        return notify(message, **options)

    app.notify = keep
    return said


def run_async(test):
    """Run an async test body with asyncio (no pytest async plugin needed); fixtures still work."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return wrapper


class FullDisk:
    """`os` as amp_tui.recording.writer sees it, with a disk that fills up: while `full`, a write takes at
    most `room` bytes (a partial write, as the kernel does) and the next one raises ENOSPC."""

    def __init__(self):
        import os
        self._os, self.full, self.room = os, False, 0

    def __getattr__(self, name):
        return getattr(self._os, name)

    def write(self, fd, data):
        import errno
        if not self.full:
            return self._os.write(fd, data)
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        taken = self._os.write(fd, bytes(data[:self.room]))
        self.room -= taken
        return taken


def restorable(path: Path, script: Path):
    """The checkpoint at `path`, read and checked (digests, shapes) against a fresh setup."""
    setup = load_script(script, device="cpu", argv=[])
    return read_checkpoint(path, model=setup.model, optimizer=setup.optimizer,
                           scheduler=setup.scheduler)


def next_step(records: list[dict], step: int) -> dict:
    last = next(r for r in reversed(records) if r["type"] == "step")
    record = copy.deepcopy(last)
    record.update(step=step, time=last["time"] + 0.125 * (step - last["step"]))
    return record


LAYERS = ["embed", "block.0", "head"]


def step_result(step, *, skipped_total=0, skipped=False, scale=65536.0, dtype="float16", loss=None,
           nonfinite=None, probed=True):
    act = [1.5 + step, 1234.5678 * (step + 1), 0.000123456]
    if nonfinite == "loss":
        act[1] = math.inf
    grad = [1e-4 * (step + 1), math.nan if nonfinite == "gradients" else 3.3e-6, None]
    figures = LayerFigures(act=act, grad=grad, weight=[0.25, 2.0, 0.0375]) if probed else None
    return StepResult(step=step, loss=math.nan if nonfinite == "loss" else (loss or 2.0 / (step + 1)),
                      scale=scale, skipped=skipped, skipped_total=skipped_total,
                      updates_applied=step + 1 - skipped_total, dtype=dtype, micro_batches=1,
                      nonfinite=nonfinite, lr=0.01, figures=figures, duration=0.01,
                      wall_time=1000.0 + step * 0.5)


def write_run(path, steps=30, *, end=True, writer=None):
    """Steps 0-2 overflow (a storm), an intervention before step 10 (dtype bf16), a checkpoint
    saved before step 20, a non-finite loss at step 25 with a pause, every 4th step unprobed."""
    w = writer or SessionWriter(path, {"layers": LAYERS, "dtype": "float16", "init_scale": 65536.0,
                                       "script": "train.py", "steps": steps,
                                       "device": {"type": "cpu", "backend": "CPU", "name": "Test"}},
                                flush_interval=0)
    scale, skipped_total, dtype = 65536.0, 0, "float16"
    for step in range(steps):
        if step == 10:
            w.write(event_record(10, "intervention", "dtype fp16 → bf16", action="dtype",
                                 value="bfloat16", source="at",
                                 before={"dtype": "float16", "scale": scale, "init_scale": 65536.0},
                                 after={"dtype": "bfloat16", "scale": None, "init_scale": 65536.0}))
            dtype, scale = "bfloat16", None
        if step == 20:
            w.write(event_record(20, "checkpoint_saved", "checkpoint checkpoints/step-0000020.safetensors "
                                 "saved", path="checkpoints/step-0000020.safetensors",
                                 checkpoint_step=20, source="checkpoint_every"))
        overflow = step < 3
        bad = step == 25
        skipped = overflow or bad
        skipped_total += skipped
        w.write(step_record(step_result(step, skipped_total=skipped_total, skipped=skipped, scale=scale,
                                   dtype=dtype, probed=step % 4 != 3,
                                   nonfinite="gradients" if overflow else "loss" if bad else None)))
        if overflow:
            w.write(event_record(step, "nonfinite", f"gradients overflowed at scale {scale:g}",
                                 where="gradients", layer="head", scale=scale, dtype=dtype))
            scale /= 2
        if bad:
            w.write(event_record(step, "nonfinite", "non-finite loss", where="loss", layer="block.0",
                                 dtype=dtype))
            w.write(event_record(step + 1, "paused", "paused after a non-finite loss", reason="nonfinite"))
            w.write(event_record(step + 1, "intervention", "resumed", action="resume", value=None,
                                 source="key", before={"state": "paused"}, after={"state": "running"}))
    if end:
        w.close({"step": steps, "status": "finished", "updates": steps - skipped_total,
                 "skipped_total": skipped_total, "dtype": dtype, "scale": scale, "exit_status": 0})
    return w


# A loop of the user's own, watched by amp_tui.monitor: fp16 with a GradScaler, going on until
# the monitor says stop (or STEPS steps, or it raises at step CRASH_AT). It prints a line per
# 20 steps, which `amp-tui run` keeps in output.log.
OWN_LOOP_SCRIPT = '''
import os, sys, time
import torch
from torch import nn
import amp_tui

STEPS = int(os.environ.get("STEPS", "100000"))
CRASH_AT = int(os.environ.get("CRASH_AT", "-1"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=256)
xs = torch.randn(64, 8)
batches = [(xs[i:i + 16], xs[i:i + 16].sum(1, keepdim=True)) for i in range(0, 64, 16)]
monitor = amp_tui.monitor(model, optimizer, scaler=scaler)
for i in range(STEPS):
    x, y = batches[i % len(batches)]
    optimizer.zero_grad()
    with monitor.step() as step:
        if i == CRASH_AT:
            raise RuntimeError(f"bad batch {i}")
        with monitor.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        step.loss = loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    if i % 20 == 0:
        print(f"own loop: step {i}, loss {loss.item():.4f}", flush=True)
    time.sleep(0.02)
    if monitor.should_stop:
        break
monitor.close()
'''


# ---- several ranks (torch.distributed, gloo on the CPU) --------------------------------------------

# A script for `amp-tui train --nproc 2`: each rank its own data (the same with --same-data, so
# the ranks' losses must match to the bit while they are in step), NaN planted in one rank's
# inputs (--nan RANK:BATCH), a pause per loss_fn call (--sleep S: a run to signal while it goes),
# the model in a DistributedDataParallel of the script's own (--wrap; --own-hook: with a
# communication hook of the script's, DDP's default all-reduce written in Python), N micro-batches a step
# (--accumulate N), SIGTERM to this process
# on one rank's Nth loss_fn call (--term RANK:N), one rank held at the end of step S, in its
# optimizer's step, until rank 0 has begun step S + 1's forward (--linger RANK:S:DIR[:kill]: at
# most LINGER_S; it writes DIR/rank<N>.linger, "ahead" if rank 0 did, "behind" if not, then with
# kill SIGKILLs itself), and at exit a digest of this rank's parameters
# in DIR/rank<N>.txt (--params DIR) and the sequence of its loss_fn calls ("loss") and of the
# torch.distributed collectives called from Python (their names) in DIR/rank<N>.calls (--calls DIR).
DDP_SCRIPT = '''
import argparse, atexit, hashlib, os, signal, time
from pathlib import Path
import torch
from torch import nn

LINGER_S = 60   # an upper bound: rank 0 begins its next step at once, or never while it waits

def setup(ctx):
    p = argparse.ArgumentParser()
    p.add_argument("--same-data", action="store_true")
    p.add_argument("--nan", default=None)
    p.add_argument("--overflow", default=None)
    p.add_argument("--scale-at", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--params", default=None)
    p.add_argument("--wrap", action="store_true")
    p.add_argument("--own-hook", action="store_true")
    p.add_argument("--term", default=None)
    p.add_argument("--calls", default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--linger", default=None)
    a = p.parse_args(ctx.argv)
    calls = []
    if a.calls:
        import torch.distributed as dist
        def counted(name, call):
            def wrapper(*args, **kwargs):
                calls.append(name)
                return call(*args, **kwargs)
            return wrapper
        for name in ("all_reduce", "broadcast", "gather", "gather_object", "broadcast_object_list",
                     "all_gather", "all_gather_object", "barrier"):
            setattr(dist, name, counted(name, getattr(dist, name)))
        atexit.register(lambda: Path(a.calls, f"rank{ctx.rank}.calls").write_text("\\n".join(calls)))
    term_rank, term_call = (int(v) for v in a.term.split(":")) if a.term else (-1, -1)
    # RANK:CALL:FACTOR: that rank's inputs times FACTOR ("nan" too) in loss_fn's CALLth call
    scale_rank, scale_call, scale_by = a.scale_at.split(":") if a.scale_at else (-1, -1, "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if a.wrap or a.own_hook:   # the script's own DistributedDataParallel (amp-tui set up the process group)
        model = nn.parallel.DistributedDataParallel(model)
    if a.own_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    linger_rank, linger_step, linger_dir, *linger_then = a.linger.split(":") if a.linger else (-1, -1, "")
    linger_rank, linger_step = int(linger_rank), int(linger_step)
    if ctx.rank == linger_rank:
        plain_step = opt.step
        def lingering_step(*args, **kwargs):
            if calls.count("loss") == linger_step + 1:   # step S's forward was its (S + 1)th call
                ahead = Path(linger_dir, "ahead")
                until = time.monotonic() + LINGER_S
                while not ahead.exists() and time.monotonic() < until:
                    time.sleep(0.01)
                Path(linger_dir, f"rank{ctx.rank}.linger").write_text("ahead" if ahead.exists() else "behind")
                if linger_then == ["kill"]:
                    os.kill(os.getpid(), signal.SIGKILL)
            return plain_step(*args, **kwargs)
        opt.step = lingering_step
    g = torch.Generator().manual_seed(0 if a.same_data else 1 + ctx.rank)
    xs = torch.randn(64, 8, generator=g)
    ys = xs.sum(1, keepdim=True)
    batches = [(xs[i:i + 16].clone(), ys[i:i + 16]) for i in range(0, 64, 16)]
    if a.nan:   # RANK:BATCH[,BATCH...]
        rank, chosen = a.nan.split(":")
        for batch in (chosen.split(",") if int(rank) == ctx.rank else ()):
            batches[int(batch)][0][0, 0] = float("nan")
    if a.overflow:   # RANK:BATCH: inputs that fp16 holds, one of whose first layer's outputs it can't
        rank, chosen = a.overflow.split(":")
        if int(rank) == ctx.rank:
            weight = model.module[0].weight if a.wrap or a.own_hook else model[0].weight
            row = weight.detach().abs().sum(1).argmax()
            batches[int(chosen)][0].copy_(6e4 * weight.detach()[row].sign().expand(16, 8))
    if a.params:
        def digest():
            h = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.parameters()))
            Path(a.params, f"rank{ctx.rank}.txt").write_text(h.hexdigest())
        atexit.register(digest)
    def loss_fn(model, batch):
        calls.append("loss")
        if a.linger and ctx.rank == 0 and calls.count("loss") == linger_step + 2:
            Path(linger_dir, "ahead").write_text("")
        if ctx.rank == term_rank and calls.count("loss") == term_call:
            os.kill(os.getpid(), signal.SIGTERM)
        if a.sleep:
            time.sleep(a.sleep)
        x, y = batch
        if ctx.rank == int(scale_rank) and calls.count("loss") == int(scale_call):
            x = x * float(scale_by)
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches, "accumulate": a.accumulate}
'''

# A loop of the user's own under torchrun: DDP, a GradScaler, amp_tui.monitor. At the end each
# rank prints the step it stopped at and every change of autocast dtype it saw.
OWN_DDP_LOOP_SCRIPT = '''
import os, time
import torch
import torch.distributed as dist
from torch import nn
import amp_tui

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=256)
xs = torch.randn(64, 8, generator=torch.Generator().manual_seed(rank))
batches = [(xs[i:i + 16], xs[i:i + 16].sum(1, keepdim=True)) for i in range(0, 64, 16)]
monitor = amp_tui.monitor(model, optimizer, scaler=scaler)
seen = []
for i in range(int(os.environ.get("STEPS", "100000"))):
    x, y = batches[i % len(batches)]
    optimizer.zero_grad()
    with monitor.step() as step:
        with monitor.autocast():
            dtype = str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else "fp32"
            if not seen or seen[-1][1] != dtype:
                seen.append((i, dtype))
            loss = nn.functional.mse_loss(model(x), y)
        step.loss = loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    time.sleep(0.02)
    if monitor.should_stop:
        break
monitor.close()
print(f"rank {rank} stopped at {i}; dtypes {seen}", flush=True)
dist.destroy_process_group()
'''

RANK_TIMEOUT_S = 240   # an upper bound for one multi-process job: a hang fails the test, not CI


def rank_command(script, run_dir, *flags: str, nproc: int = 2, script_args=(), with_run_dir=True) -> list[str]:
    import sys
    command = [sys.executable, "-m", "amp_tui", "train", str(script), "--nproc", str(nproc), "--headless",
               *(["--run-dir", str(run_dir)] if with_run_dir else []), *flags]
    return command + (["--", *script_args] if script_args else [])


def train_ranks(script, run_dir, *flags: str, script_args=(), nproc: int = 2, with_run_dir=True):
    """`amp-tui train SCRIPT --nproc 2 --headless` to its end (bounded by RANK_TIMEOUT_S)."""
    import subprocess
    command = rank_command(script, run_dir, *flags, nproc=nproc, script_args=script_args, with_run_dir=with_run_dir)
    return subprocess.run(command, capture_output=True, text=True, timeout=RANK_TIMEOUT_S, cwd=Path(script).parent)


def steer_to_its_end(job, steer) -> str:
    """Call `steer()` while `job` (a Popen with its output piped) runs, then let it end, within
    RANK_TIMEOUT_S: its output. A job still running when something failed is killed."""
    try:
        steer()
        out, _ = job.communicate(timeout=RANK_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    return out


def torchrun(*arguments: str, cwd: Path):
    """`python -m torch.distributed.run --standalone --nproc-per-node 2 ARGUMENTS...` to its end,
    its output captured; bounded by RANK_TIMEOUT_S: a hang fails the test."""
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *arguments], capture_output=True, text=True, timeout=RANK_TIMEOUT_S, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def run_rank_worker(tmp_path: Path, source: str, argument) -> list:
    """A worker script of 2 ranks under torch.distributed.run, given `tmp_path` and `argument`
    (JSON) on its command line; what each rank wrote to tmp_path/rank<N>.json, in rank order.
    Bounded by RANK_TIMEOUT_S: a hang fails the test."""
    worker = tmp_path / "worker.py"
    worker.write_text(source, encoding="utf-8")
    done = torchrun(str(worker), str(tmp_path), json.dumps(argument), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def rank_lines(run_dir, rank: int = 1) -> list[str]:
    try:
        return (Path(run_dir) / f"rank{rank}.log").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []


def rank_end(run_dir, rank: int = 1) -> dict | None:
    """The last line a rank other than 0 prints: where it ended, with its counts."""
    import re
    pattern = re.compile(r"rank \d+/\d+: (\w+) before step (\d+): (\d+) updates?, (\d+) skipped, (\w+), scale (\S+)")
    for line in reversed(rank_lines(run_dir, rank)):
        m = pattern.search(line)
        if m:
            state, step, updates, skipped, dtype, scale = m.groups()
            return {"state": state, "step": int(step), "updates": int(updates), "skipped": int(skipped),
                    "dtype": dtype, "scale": None if scale == "none" else float(scale)}
    return None


def rank_pid(run_dir, rank: int = 1) -> int | None:
    import re
    for line in rank_lines(run_dir, rank):
        m = re.search(r"\(pid (\d+),", line)
        if m:
            return int(m.group(1))
    return None


def rank_events(run_dir, rank: int = 1) -> list[tuple[int, str, str]]:
    """(step, kind, message) of every event a rank other than 0 printed."""
    import re
    out = []
    for line in rank_lines(run_dir, rank):
        m = re.match(r"rank \d+/\d+: step (\d+): (\w+): (.*)", line)
        if m:
            out.append((int(m.group(1)), m.group(2), m.group(3)))
    return out


def monitored_loop(run_dir, steps, *, probe_every="auto", init_scale=2.0 ** 40, bad_step=None, plan=None, **kw):
    """A plain loop under the monitor; `bad_step`: its loss is made infinite there; `plan`: commands
    submitted before the given steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=run_dir, announce=False,
                              probe_every=probe_every, control=False, **kw)
    x = torch.randn(16, 4)
    for i in range(steps):
        if plan and i in plan:
            monitor.controller.submit(parse_action(plan[i], source="api"))
        opt.zero_grad()
        with monitor.step() as step:
            with monitor.autocast():
                loss = model(x).float().pow(2).mean()
            if i == bad_step:
                loss = loss * math.inf
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    monitor.close()
    return read_session(run_dir)


def install_made_up_clock(monkeypatch, step: float, probe_cost: float):
    """Each call of the drivers' perf_counter moves it on by `step` (a step's duration is the
    difference of two calls); collecting a probed step's figures costs `probe_cost` more. Which
    steps the adaptive schedule probes then depends on the run's own progress, never on how busy
    the machine is. Recording the steps, and the run's other work between them, take no time on
    this clock (test_probe_schedule.py counts them)."""
    import types

    import amp_tui.job.controller as controller_module
    import amp_tui.job.drivers.engine_driver as engine_driver_module
    import amp_tui.job.drivers.hook_driver as hook_driver_module
    import amp_tui.job.monitor as monitor_module
    import amp_tui.job.records.probe_budget as probe_budget_module
    import amp_tui.training.step.engine as engine_module
    from amp_tui.training.probes.layer_probes import LayerProbe

    clock = types.SimpleNamespace(now=0.0)

    def perf_counter():
        clock.now += step
        return clock.now
    fake_time = types.SimpleNamespace(perf_counter=perf_counter, time=time.time)
    monkeypatch.setattr(engine_module, "time", fake_time)
    monkeypatch.setattr(hook_driver_module, "time", fake_time)
    still = types.SimpleNamespace(perf_counter=lambda: 0.0, monotonic=time.monotonic, time=time.time,
                                  sleep=time.sleep)
    for module in (controller_module, probe_budget_module, engine_driver_module, monitor_module):
        monkeypatch.setattr(module, "time", still)
    collect = LayerProbe.collect

    def costly_collect(self, *args, **kwargs):
        clock.now += probe_cost
        return collect(self, *args, **kwargs)
    monkeypatch.setattr(LayerProbe, "collect", costly_collect)
    return clock


class MassiveChannels(nn.Module):
    """A few channels of its input made `factor` times larger, as LLMs' massive activations are."""

    def __init__(self, width: int, channels, factor: float):
        super().__init__()
        self.register_buffer("gain", torch.ones(width))
        self.gain[list(channels)] = factor

    def forward(self, x):
        return x * self.gain


def outlier_model(factor: float = 1e4) -> nn.Module:
    """Four Linear layers; the input of the third (`"5"`) carries three channels `factor` times the
    rest: the fp8 what-if keeps it, and only it, in bf16."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
        MassiveChannels(64, (3, 17, 50), factor),
        nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 16))
