"""Fixtures every test may ask for: a deterministic seed, a script written to a temporary file, the
small MLP script, and a headless run going on a background thread with its control socket."""

import os
import textwrap
import threading
from pathlib import Path

# One intra-op thread a process, read by torch as it is imported, and inherited by every run
# and rank a test starts: the tests run side by side on every core already (-n), and more
# threads than cores spin for each other (a third of the suite's time on two cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from amp_tui.job.steering.control import socket_path  # noqa: E402

from support import MLP_SCRIPT, SLOW_SCRIPT, train_run, wait_for


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _monitor_left_open():
    """A test that fails with its monitor still open leaves it here: closed, so that the next test
    in the process can make its own (one monitor per process) and one failure stays one."""
    yield
    from amp_tui.job.monitor import _SLOT
    left = _SLOT.holder
    if left is not None and not left._closed:
        try:
            left.close()
        except Exception:  # noqa: BLE001 - the test has failed already; its own error says why
            pass


@pytest.fixture
def write_script(tmp_path):
    def write(body: str, name: str = "train_script.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(body), encoding="utf-8")
        return path
    return write


@pytest.fixture
def mlp_script(write_script):
    return write_script(MLP_SCRIPT)


@pytest.fixture
def live_job(write_script, tmp_path):
    """A headless run on a background thread, with its control socket: (run, thread)."""
    script = write_script(SLOW_SCRIPT)
    run = train_run(script, tmp_path / "run", init_scale=256.0)
    thread = threading.Thread(target=run.run)
    thread.start()
    assert wait_for(lambda: run.step >= 2 and socket_path(run.run_dir).exists(), 60)
    yield run, thread
    run.request_stop()
    thread.join(30)


@pytest.fixture
def live_run(live_job):
    return live_job[0]
