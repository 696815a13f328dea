"""A finished run exits 0: no thread of ours outlives it into the interpreter's shutdown.

Each of our threads referenced the Run; the last one to end freed the model and its tensors. When
that was a thread still alive as the interpreter shut down, torch's tensor teardown gave up the GIL
and Python ended the thread inside C++ code: "terminate called without an active exception", exit
134, after the end record said "finished". The script below makes that window certain instead of
rare: a parameter freed off the main thread keeps that thread doing torch work until the
interpreter is finalizing, and the script's atexit hook waits for it while one of our threads is
still alive.
"""

import io
import socket
import subprocess
import sys
import threading

import pytest
from rich.console import Console

from amp_tui.cli.headless import HeadlessPrinter
from amp_tui.job.steering.control import send
from amp_tui.recording.reader import read_session

from support import train_run, wait_for

ALIVE_MARK = "threads alive at exit:"

EXIT_RACE_SCRIPT = f'''
import atexit, sys, threading, time, weakref
import torch
from torch import nn
import torch.nn.functional as F

freed_elsewhere = threading.Event()
_refs = []


def _on_free(_ref):
    if threading.current_thread() is threading.main_thread():
        return
    freed_elsewhere.set()
    deadline = time.monotonic() + 60   # an upper bound; the wait ends when finalizing starts
    while not sys.is_finalizing() and time.monotonic() < deadline:
        torch.ones(8).add_(1)


@atexit.register
def _report_threads():
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    sys.stderr.write("{ALIVE_MARK} " + ",".join(others) + "\\n")
    if others:
        freed_elsewhere.wait(30)   # let the thread that holds the run free it: the defect


class TinyGPT(nn.Module):
    def __init__(self, vocab=32, width=16, context=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        mask = torch.triu(torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return self.head(self.ln(x))


def setup(ctx=None):
    torch.manual_seed(0)
    model = TinyGPT()
    for p in model.parameters():
        _refs.append(weakref.ref(p, _on_free))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 32, (4, 9))
    batches = [data, data.flip(0)]

    def loss_fn(model, batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 32).float(), batch[:, 1:].reshape(-1))
    return {{"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches}}
'''

RUNS = 6


@pytest.mark.slow
def test_parallel_short_runs_all_exit_zero(write_script, tmp_path):
    script = write_script(EXIT_RACE_SCRIPT)
    procs = []
    for i in range(RUNS):
        dtype = ("fp16", "bf16")[i % 2]
        cmd = [sys.executable, "-m", "amp_tui", "train", str(script), "--headless", "--dtype", dtype,
               "--steps", "3", "--run-dir", str(tmp_path / f"run{i}")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        _, err = proc.communicate(timeout=240)  # an upper bound for a hang
        results.append((proc.returncode, err))
    for i, (code, err) in enumerate(results):
        assert "terminate called" not in err, err[-2000:]
        assert code == 0, f"run {i} exited {code}: {err[-2000:]}"
        end = read_session(tmp_path / f"run{i}").end
        assert end["status"] == "finished" and end["exit_status"] == 0
        alive = [line for line in err.splitlines() if line.startswith(ALIVE_MARK)]
        assert alive == [f"{ALIVE_MARK} "], alive   # none of our threads left at exit


def test_closing_the_control_socket_joins_its_threads_and_answers_waiting_clients(mlp_script, tmp_path):
    before = set(threading.enumerate())
    run = train_run(mlp_script, tmp_path / "run", at=["2:pause"])
    trainer_thread = threading.Thread(target=run.run)
    trainer_thread.start()
    try:
        assert wait_for(lambda: run.state == "paused", 60)
        # A client that connected and sent nothing yet; a status answered after it connected
        # proves the job accepted it (connections are accepted in order).
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect(str(run.controller._control.path))
        assert send(run.run_dir, "status")["ok"]
        # And a command that the run will never apply: it never reaches the loop.
        submitted = []
        run.controller.submit = submitted.append
        answers = []
        queued = threading.Thread(target=lambda: answers.append(send(run.run_dir, "save")))
        queued.start()
        assert wait_for(lambda: submitted, 30)
        run.request_stop()
        trainer_thread.join(60)
        assert not trainer_thread.is_alive()
        queued.join(30)
        assert answers == [{"ok": False, "message": "the run ended before applying it"}]
        assert silent.makefile("r").readline().strip() == '{"ok": false, "message": "the run has ended"}'
        silent.close()
        left = [t.name for t in set(threading.enumerate()) - before if t is not trainer_thread]
        assert left == [], f"threads of the run still alive after it closed: {left}"
    finally:
        run.request_stop()
        trainer_thread.join(30)


def test_the_headless_status_line_on_a_terminal_runs_no_thread_of_its_own():
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    before = set(threading.enumerate())
    with HeadlessPrinter(console, 3) as printer:
        printer({"type": "step", "step": 0, "loss": 1.5, "dtype": "float16", "scale": 65536.0})
        assert set(threading.enumerate()) == before
    assert "step 1/3" in console.file.getvalue()
