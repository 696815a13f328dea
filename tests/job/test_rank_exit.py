"""A rank's process ends with its process group: gloo's threads are gone before the interpreter
finalizes, so none of them can abort it there (job/ranks/group_end.py).

gloo lets go of a finished collective's tensors on a thread of its own, a moment after the wait
for it returned, and takes the GIL to do it. A thread that asks for the GIL once the interpreter
has begun to finalize is ended by Python, and the process aborts ("terminate called without an
active exception", exit -6). Under load that thread can still be waiting for the CPU when the
main thread reaches the end. The first test makes that order certain instead of rare: rank 0's
tensor is freed on gloo's thread, which is held there (a weakref callback) until the interpreter
finalizes or the group's end waits for it. The second checks the ranks of `amp-tui train --nproc 2`
at their exit: not one gloo thread left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import MLP_SCRIPT, RANK_TIMEOUT_S, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

# How long the callback holds gloo's thread, waiting for the interpreter's end. Where the ranks'
# close ends the group, the close waits for the thread that long, and then it ends well; where it
# did not, the interpreter's end came first (the close and the exit take a fraction of it) and the
# rank aborted. Its length decides nothing where the group ends.
HELD_S = 5.0

WORKER = '''
import json, sys, threading, weakref
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from amp_tui.job.ranks.distributed import Ranks

out = Path(sys.argv[1])
ranks = Ranks.join("cpu", 60)
ranks.replicate(nn.Linear(4, 4))   # a DistributedDataParallel over the group, as a run builds
store = dist.distributed_c10d._get_default_store()
finalizing, letting_go = threading.Event(), threading.Event()
seen = {}


class AtTheEnd:
    """Freed as the interpreter finalizes (a global of __main__, whose other names may be gone
    by then): says so, and gives gloo's thread the time to ask for the GIL."""

    def __init__(self, finalizing, letting_go):
        self.finalizing, self.letting_go = finalizing, letting_go

    def __del__(self):
        self.finalizing.set()
        self.letting_go.wait(60)


def freed(_ref):
    # On gloo's thread, with the GIL, as it lets go of the collective's tensor.
    seen["thread"] = "main" if threading.current_thread() is threading.main_thread() else "gloo"
    letting_go.set()
    finalizing.wait(HELD_S)   # the GIL released, taken again after: at the end, if it came


if ranks.rank == 0:
    end = AtTheEnd(finalizing, letting_go)
    tensor = torch.ones(4)
    ref = weakref.ref(tensor, freed)
    dist.all_reduce(tensor, async_op=True)
    del tensor                      # only the collective's work holds it now
    store.set("dropped", "1")       # rank 1 joins the collective only now: gloo's thread lets go
    letting_go.wait(60)
else:
    store.wait(["dropped"])
    dist.all_reduce(torch.ones(4))
ranks.close()
(out / f"rank{ranks.rank}.json").write_text(json.dumps(seen))
'''.replace("HELD_S", repr(HELD_S))


def test_a_tensor_gloo_lets_go_of_at_the_end_no_longer_aborts_the_rank(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER, encoding="utf-8")
    done = torchrun(str(worker), str(tmp_path), cwd=tmp_path)
    output = done.stdout + done.stderr
    assert "terminate called" not in output, output
    assert done.returncode == 0, output
    # The tensor was let go of on gloo's thread, the case that aborted.
    assert json.loads((tmp_path / "rank0.json").read_text()) == {"thread": "gloo"}, output
    assert (tmp_path / "rank1.json").exists()


# Every Python process of the job writes its rank (torchrun's RANK, None outside the ranks) and
# its threads' names as it begins to exit: after the program, before the interpreter finalizes.
THREADS_AT_EXIT = '''
import atexit, json, os

def _threads_at_exit():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    with open(os.path.join(os.environ["THREADS_AT_EXIT"], f"{os.getpid()}.json"), "w") as f:
        json.dump({"rank": os.environ.get("RANK"), "threads": names}, f)

atexit.register(_threads_at_exit)
'''


def test_the_ranks_of_amp_tui_train_exit_with_no_gloo_thread_left(tmp_path, write_script):
    script = write_script(MLP_SCRIPT)
    site, seen = tmp_path / "site", tmp_path / "threads"
    site.mkdir()
    seen.mkdir()
    (site / "sitecustomize.py").write_text(THREADS_AT_EXIT, encoding="utf-8")
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "THREADS_AT_EXIT": str(seen)}
    done = subprocess.run([sys.executable, "-m", "amp_tui", "train", str(script), "--nproc", "2", "--headless",
                           "--steps", "3", "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=RANK_TIMEOUT_S, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = {e["rank"]: e["threads"] for e in (json.loads(p.read_text()) for p in seen.glob("*.json"))
             if e["rank"] is not None}
    assert sorted(ranks) == ["0", "1"], ranks
    left = {rank: threads for rank, threads in ranks.items()
            if any(name.startswith(("pt_gloo", "gloo")) for name in threads)}
    assert left == {}, left
