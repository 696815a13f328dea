"""Several processes, one run, on the CPU with gloo and 2 ranks: `amp-tui train --nproc 2` in
fp16 and bf16, commands landing at the same step on both ranks, ctl and attach against rank 0,
`torchrun -m amp_tui train` and `amp-tui run -- torchrun` with a loop of one's own.

Every job is bounded by a timeout (a hang fails the test); every wait is on the job's own
progress (records written, a state answered over the control socket).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from amp_tui.job.steering.control import send
from amp_tui.recording.reader import read_session
from amp_tui.sources.attached import AttachedSource
from amp_tui.ui.app import create_app

from support import (
    DDP_SCRIPT,
    OWN_DDP_LOOP_SCRIPT,
    RANK_TIMEOUT_S,
    rank_command,
    rank_end,
    rank_events,
    recorded_steps,
    run_async,
    steer_to_its_end,
    step_count,
    toasts,
    torchrun,
    train_ranks,
    until,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.ranks]


def digests(folder) -> list[str]:
    return [(folder / f"rank{r}.txt").read_text() for r in (0, 1)]


def status(run_dir, job=None) -> dict:
    """Rank 0's status over its control socket ({} before it serves one); a job that exited
    fails the test at once instead of letting the caller wait for it."""
    if job is not None and job.poll() is not None:
        raise AssertionError(f"the job exited with status {job.returncode}: {job.stdout.read()}")
    try:
        return send(run_dir, "status", timeout=10)["status"]
    except Exception:  # noqa: BLE001 - not up yet: the caller waits on what it needs
        return {}


def resumed_after_pause(job, run_dir, while_paused) -> str:
    """Wait until the job is paused, check `while_paused()`, resume it with `ctl resume` and
    let it finish (exit 0): its output. A job that never gets there is killed."""
    def steer():
        assert wait_for(lambda: status(run_dir, job).get("state") == "paused", RANK_TIMEOUT_S), "never paused"
        while_paused()
        assert send(run_dir, "resume")["ok"]
    out = steer_to_its_end(job, steer)
    assert job.returncode == 0, out
    return out


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_nproc_2_trains_one_run_with_per_rank_figures_and_identical_replicas(write_script, tmp_path, dtype):
    script = write_script(DDP_SCRIPT)
    run_dir, params = tmp_path / "run", tmp_path / "params"
    params.mkdir()
    done = train_ranks(script, run_dir, "--dtype", dtype, "--steps", "6", "--probe-every", "1",
                       script_args=["--params", str(params)])
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    assert session.header["world_size"] == 2
    steps = session.steps
    assert [r["step"] for r in steps] == list(range(6))
    for r in steps:   # probes every step: every record has both ranks' figures
        assert len(r["rank_loss"]) == 2 and len(r["rank_step_time"]) == 2
        assert all(isinstance(t, float) and t >= 0 for t in r["rank_step_time"])
        assert r["loss"] == r["rank_loss"][0]
    assert steps[-1]["rank_loss"][0] != steps[-1]["rank_loss"][1]   # their own data
    # Rank 1 ended where rank 0 did, with the same counts and scale; the replicas are the same.
    end, other = session.end, rank_end(run_dir)
    assert other == {"state": "finished", "step": 6, "updates": end["updates"], "skipped": end["skipped_total"],
                     "dtype": dtype, "scale": end["scale"]}
    if dtype == "fp16":
        assert end["skipped_total"] > 0   # GradScaler skipped, and both ranks alike
    d0, d1 = digests(params)
    assert d0 == d1
    assert not (run_dir / "rank0.log").exists() and len(list(tmp_path.rglob("session.jsonl"))) == 1


def test_at_commands_land_at_the_same_step_on_both_ranks(write_script, tmp_path):
    """With the same data on both ranks, their losses agree to the bit at every step only while
    both run the same dtype on the same weights; a scale on one rank only makes the replicas
    differ from the next update. A pause holds both ranks longer than the process group's
    timeout (the heartbeat), then `ctl resume` lets them go on."""
    script = write_script(DDP_SCRIPT)
    run_dir, params = tmp_path / "run", tmp_path / "params"
    params.mkdir()
    timeout_s = 5
    job = subprocess.Popen(
        rank_command(script, run_dir, "--steps", "10", "--dist-timeout", str(timeout_s), "--probe-every", "1",
                     "--at", "1:save", "--at", "2:scale=half", "--at", "3:dtype=bf16", "--at", "5:restore=latest",
                     "--at", "4:note=shard 3 → 4", "--at", "6:dtype=fp16", "--at", "7:pause",
                     script_args=["--same-data", "--params", str(params)]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)

    def while_paused():
        # Held at least 2.5 timeouts: without the heartbeat rank 1's wait would fail meanwhile.
        assert not wait_for(lambda: job.poll() is not None, 2.5 * timeout_s)
        assert status(run_dir)["state"] == "paused" and status(run_dir)["step"] == 7
        assert send(run_dir, "note=held at 7")["ok"]

    resumed_after_pause(job, run_dir, while_paused)
    session = read_session(run_dir)
    for r in session.steps:
        assert r["rank_loss"][0] == r["rank_loss"][1], r
    ours = [(e["step"], e["kind"], e.get("action")) for e in session.events
            if e["kind"] in ("intervention", "checkpoint_restored")]
    assert ours == [(1, "intervention", "save"), (2, "intervention", "scale"), (3, "intervention", "dtype"),
                    (5, "checkpoint_restored", None), (6, "intervention", "dtype"),
                    (7, "intervention", "pause"), (7, "intervention", "resume")]
    notes = [(e["step"], e["text"]) for e in session.events if e["kind"] == "note"]
    assert notes == [(4, "shard 3 → 4"), (7, "held at 7")]
    assert [(step, text) for step, kind, text in rank_events(run_dir) if kind == "note"] == \
        [(4, "shard 3 → 4"), (7, "held at 7")]
    theirs = [(step, kind) for step, kind, _ in rank_events(run_dir)
              if kind in ("intervention", "checkpoint_restored", "checkpoint_saved")]
    assert theirs == [(1, "checkpoint_saved"), (2, "intervention"), (3, "intervention"),
                      (5, "checkpoint_restored"), (6, "intervention"), (7, "intervention"), (7, "intervention")]
    dtypes = {r["step"]: r["dtype"] for r in session.steps}
    assert dtypes[2] == "float16" and dtypes[3] == dtypes[4] == dtypes[5] == "bfloat16" and dtypes[6] == "float16"
    end = session.end
    assert rank_end(run_dir) == {"state": "finished", "step": 10, "updates": end["updates"],
                                 "skipped": end["skipped_total"], "dtype": "fp16", "scale": end["scale"]}
    d0, d1 = digests(params)
    assert d0 == d1


def test_an_overflow_on_rank_1_alone_is_traced_to_its_op_by_rank_1_and_recorded_by_rank_0(write_script, tmp_path):
    """Rank 1's inputs in step 1 overflow its first layer in fp16 (rank 0's are fine): both
    ranks skip the update, and rank 1 replays its own step on the model inside DDP, alone; the
    event rank 0 records names rank 1, the op, its module and the fix tried on the step."""
    script = write_script(DDP_SCRIPT)
    run_dir, calls = tmp_path / "run", tmp_path / "calls"
    calls.mkdir()
    done = train_ranks(script, run_dir, "--dtype", "fp16", "--init-scale", "256", "--steps", "4",
                       script_args=["--overflow", "1:1", "--calls", str(calls)])
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    assert [r["skipped"] for r in session.steps] == [False, True, False, False]
    (event,) = [e for e in session.events if e["kind"] == "nonfinite"]
    assert event["step"] == 1 and event["where"] == "loss" and event["rank"] == 1
    assert (event["op"], event["op_module"], event["op_phase"]) == ("aten.addmm", "0", "forward")
    assert event["op_output_dtype"] == "float16" and {"dtype": "float16", "max": 60000.0} in event["op_inputs"]
    assert event["fix"] == "--dtype bf16" and event["fix_verified"] is True
    assert "on rank 1" in event["message"] and "aten.addmm in 0" in event["message"]
    assert rank_end(run_dir) == {"state": "finished", "step": 4, "updates": 3, "skipped": 1, "dtype": "fp16",
                                 "scale": 256.0}
    (theirs,) = [text for step, kind, text in rank_events(run_dir) if kind == "nonfinite"]
    assert "aten.addmm in 0" in theirs
    # Rank 0's loss was finite: it replayed nothing. Rank 1 ran its forward more than the 4 steps'
    # (the checked pass, the trace and the fixes), with no collective of its own in between.
    sequences = [(calls / f"rank{r}.calls").read_text().split("\n") for r in (0, 1)]
    assert sequences[0].count("loss") == 5 and sequences[1].count("loss") > 6   # 4 steps, the checked pass
    assert [c for c in sequences[1] if c != "loss"] == [c for c in sequences[0] if c != "loss"]


@pytest.mark.parametrize("words", ["gradients", "collectives"])
def test_the_adaptive_probe_schedule_is_rank_0s_on_every_rank_and_escalates_on_both(write_script, tmp_path, words):
    """`--probe-every auto` with 2 ranks: rank 0's spacing rides in each step's words, and both
    ranks probe the same steps (every probed step's record has both ranks' figures; where the
    figures go in a gather of their own, both ranks issue the same collectives), fewer than all
    while the run is healthy. A NaN in rank 1's step 20 skips it on both, and both probe every
    step after it."""
    script = write_script(DDP_SCRIPT)
    run_dir, calls = tmp_path / "run", tmp_path / "calls"
    calls.mkdir()
    done = train_ranks(script, run_dir, "--dtype", "bf16", "--steps", "30", "--probe-every", "auto",
                       script_args=["--scale-at", "1:21:nan", "--calls", str(calls)]
                       + (["--own-hook"] if words == "collectives" else []))
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    assert session.header["probe_every"] == "auto" and session.header["coordination"].startswith(words)
    assert [r["step"] for r in session.steps] == list(range(30))
    assert [r["step"] for r in session.steps if r["skipped"]] == [20]
    probed = [r["step"] for r in session.steps if "layers" in r]
    for r in session.steps:   # a probed step has every rank's figures: both ranks probed it
        assert ("rank_loss" in r) == ("layers" in r) or r["skipped"], r   # (a non-finite one has them)
        assert len(r.get("rank_loss", [0, 0])) == 2, r
    healthy = [s for s in probed if s < 20]
    assert healthy[:3] == [0, 1, 2] and len(healthy) < 15, probed
    assert set(range(21, 30)) <= set(probed), probed
    [escalation] = [e for e in session.events if e["kind"] == "probes"]
    assert escalation["mode"] == "every" and escalation["reason"] == "nonfinite", escalation
    theirs = [(step, text) for step, kind, text in rank_events(run_dir) if kind == "probes"]
    assert theirs == [(escalation["step"], escalation["message"])]
    sequences = [(calls / f"rank{r}.calls").read_text().split("\n") for r in (0, 1)]
    assert [c for c in sequences[0] if c != "loss"] == [c for c in sequences[1] if c != "loss"]
    if words == "collectives":   # each probed step's figures gathered, and the non-finite step's
        assert sequences[0].count("gather") == len(probed) + (20 not in probed)


def test_ctl_and_attach_steer_rank_0_of_a_2_process_job(write_script, tmp_path):
    script = write_script(DDP_SCRIPT)
    run_dir = tmp_path / "run"
    job = subprocess.Popen(rank_command(script, run_dir, script_args=["--sleep", "0.05"]),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    @run_async
    async def from_the_dashboard():
        source = AttachedSource(run_dir)
        app = create_app(source)
        async with app.run_test(size=(120, 40), notifications=True) as pilot:
            await until(pilot, lambda: "ranks 2" in str(app.dashboard.query_one("#status").render()),
                        "the world size in the status bar")
            await pilot.press("d")
            await until(pilot, lambda: "dtype fp16 → bf16" in toasts(app), "rank 0's answer")
            await pilot.press("Q")
            await until(pilot, lambda: not app.is_running, "the app to exit")

    def steer():
        assert wait_for(lambda: status(run_dir, job).get("step", 0) >= 2, RANK_TIMEOUT_S)
        answer = status(run_dir)
        assert answer["state"] == "running" and answer["world_size"] == 2
        from_the_dashboard()
    out = steer_to_its_end(job, steer)
    assert job.returncode == 0, out
    session = read_session(run_dir)
    switch = next(e for e in session.events if e.get("action") == "dtype")
    assert switch["source"].startswith("ctl")
    assert (switch["step"], "intervention") in [(s, k) for s, k, _ in rank_events(run_dir)]
    stop = next(e for e in session.events if e.get("action") == "stop")
    assert rank_end(run_dir)["step"] == session.end["step"] == stop["step"]
    assert rank_end(run_dir)["state"] == "stopped"


def test_torchrun_runs_amp_tui_train_as_its_ranks(write_script, tmp_path):
    """The script wraps its model in DDP itself here: amp-tui doesn't wrap it again."""
    script = write_script(DDP_SCRIPT)
    run_dir, params = tmp_path / "run", tmp_path / "params"
    params.mkdir()
    done = torchrun("-m", "amp_tui", "train", str(script), "--headless", "--steps", "3",
                    "--run-dir", str(run_dir), "--", "--wrap", "--params", str(params), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    assert session.header["world_size"] == 2 and len(session.steps) == 3
    assert session.end["status"] == "finished" and rank_end(run_dir)["step"] == 3
    assert session.header["layers"] == ["0", "2"]   # the script's module's names, not module.0
    d0, d1 = digests(params)
    assert d0 == d1


def test_amp_tui_run_follows_a_torchrun_loop_with_a_monitor(write_script, tmp_path):
    script = write_script(OWN_DDP_LOOP_SCRIPT, "loop.py")
    run_dir = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "amp_tui", "run", "--headless", "--run-dir", str(run_dir), "--",
                            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            str(script)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    def steer():
        assert wait_for(lambda: step_count(run_dir / "session.jsonl") >= 3, RANK_TIMEOUT_S)
        assert send(run_dir, "dtype=bf16")["ok"]
        assert wait_for(lambda: any(r.get("dtype") == "bfloat16" for r in recorded_steps(run_dir)),
                        RANK_TIMEOUT_S)
        assert send(run_dir, "stop")["ok"]
    out = steer_to_its_end(job, steer)
    assert job.returncode == 0, out
    session = read_session(run_dir)
    assert session.header["world_size"] == 2 and len(list(tmp_path.rglob("session.jsonl"))) == 1
    assert session.header["probe_every"] == "auto"   # rank 0's schedule, agreed at each boundary
    probed = [r for r in session.steps if "layers" in r]
    assert probed and all(len(r["rank_loss"]) == 2 for r in probed)   # both ranks probed them
    # The ranks' lines reach one pipe unbuffered, a line's text and its newline in two writes, so
    # one rank's line can run into the other's: each ends at its list's closing bracket.
    ends = dict(re.findall(r"rank (\d) stopped at (\d+; dtypes \[[^\]]*\])", out))
    assert set(ends) == {"0", "1"} and ends["0"] == ends["1"], out   # the same step, the same switch
    switch = next(e for e in session.events if e.get("action") == "dtype")
    assert f"({switch['step']}, 'torch.bfloat16')" in ends["0"]


OWN_LOOP_NAN_ON_RANK_1 = '''
import sys
import torch
import torch.distributed as dist
from torch import nn
import amp_tui

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
xs = torch.randn(64, 8, generator=torch.Generator().manual_seed(rank))
monitor = amp_tui.monitor(model, optimizer, dtype="bf16", run_dir=sys.argv[1], control=False, announce=False)
for i in range(30):
    x = xs[(i % 4) * 16:(i % 4 + 1) * 16]
    optimizer.zero_grad()
    with monitor.step() as step:
        with monitor.autocast():
            loss = nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True))
        if rank == 1 and i == 20:
            loss = loss * float("nan")   # rank 1's alone: no GradScaler to skip it on both
        step.loss = loss
        loss.backward()
        optimizer.step()
monitor.close()
print(f"rank {rank} probed {monitor.driver.probe_schedule.probed_steps}", flush=True)
dist.destroy_process_group()
'''


def test_a_monitored_loop_of_2_ranks_probes_rank_0s_steps_and_escalates_both_on_one_ranks_nan(
        write_script, tmp_path):
    """`amp_tui.monitor` under torchrun, with its default schedule: both ranks probe the same
    steps (each probed step's record has both ranks' figures), fewer than all while healthy; a
    NaN loss on rank 1 alone, which no collective agrees on in a loop of one's own, goes in the
    boundary's words, and both ranks probe every step after it (a rank escalating alone would
    gather where the other doesn't: the job would hang, and the timeout fail the test). DDP's
    all-reduce carries the NaN into both ranks' gradients, so both hold the update back
    (training/step/update_guard.py): a skip on every rank, the sign they share, is the escalation's
    reason (before updates were held back, the loop applied it, and rank 1's loss was the sign)."""
    script = write_script(OWN_LOOP_NAN_ON_RANK_1, "loop.py")
    run_dir = tmp_path / "run"
    done = torchrun(str(script), str(run_dir), cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    session = read_session(run_dir)
    assert session.header["probe_every"] == "auto" and [r["step"] for r in session.steps] == list(range(30))
    probed = [r["step"] for r in session.steps if "layers" in r]
    assert all(len(r["rank_loss"]) == 2 for r in session.steps if "layers" in r)
    healthy = [s for s in probed if s <= 20]
    assert healthy[:3] == [0, 1, 2] and len(healthy) < 10, probed
    assert set(range(21, 30)) <= set(probed), probed
    [escalation] = [e for e in session.events if e["kind"] == "probes"]
    assert (escalation["mode"], escalation["reason"], escalation["step"]) == ("every", "skip", 21)
    assert escalation["message"] == "probing every step: an update skipped at step 20"
    assert [s["skipped"] for s in session.steps].count(True) == 1 and session.steps[20]["skipped"]
    counts = dict(re.findall(r"rank (\d) probed (\d+)", out))
    assert counts == {"0": str(len(probed)), "1": str(len(probed))}, out


@pytest.mark.parametrize("words", ["gradients", "collectives"])
def test_each_step_meets_once_and_what_its_loss_check_carries_lands_on_both_ranks(write_script, tmp_path, words):
    """The loss check of step k carries what applies at boundary k + 1: rank 0's `--at` command
    (with its value, broadcast only then) and rank 1's stop vote (a SIGTERM to rank 1 alone in
    step 7's forward). Both land at the same step on both ranks. In DDP's own gradient
    all-reduce, no step after the first runs a collective of ours (the probed step's figures come
    with the next step's gradients); where the script's DDP has a communication hook of its own,
    each step's loss check is the one collective of ours, and the probed step's figures a gather."""
    script = write_script(DDP_SCRIPT)
    run_dir, calls = tmp_path / "run", tmp_path / "calls"
    calls.mkdir()
    # loss_fn's 1st call is step 0's forward (the pre-flight's, kept), its 8th step 7's.
    done = train_ranks(script, run_dir, "--dtype", "bf16", "--steps", "20", "--probe-every", "100",
                       "--at", "4:dtype=fp32",
                       script_args=["--same-data", "--term", "1:8", "--calls", str(calls)]
                       + (["--own-hook"] if words == "collectives" else []))
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    assert session.header["coordination"].startswith(words), session.header
    stopping = next(e for e in session.events if e["kind"] == "stopping")
    assert "SIGTERM on rank 1" in stopping["message"] and stopping["step"] == 8
    assert session.end["status"] == "stopped" and session.end["step"] == 8
    assert rank_end(run_dir)["state"] == "stopped" and rank_end(run_dir)["step"] == 8
    switch = next(e for e in session.events if e.get("action") == "dtype")
    assert switch["step"] == 4 and (4, "intervention") in [(s, k) for s, k, _ in rank_events(run_dir)]
    assert [r["dtype"] for r in session.steps] == ["bfloat16"] * 4 + ["float32"] * 4
    assert len(session.steps[0]["rank_loss"]) == 2   # step 0 is probed: every rank's figures
    for r in session.steps:   # the same data and the same commands: the same losses to the bit
        if "rank_loss" in r:
            assert r["rank_loss"][0] == r["rank_loss"][1], r
    sequences = [(calls / f"rank{r}.calls").read_text().split("\n") for r in (0, 1)]
    assert sequences[0] == sequences[1]
    # What each step's forward is followed by, up to the next step's forward: the collectives
    # called from Python, which are DDP's gradient all-reduce too where a hook makes it (ours, or
    # the script's own).
    steps = "\n".join(sequences[0]).split("loss")[1:]
    per_step = [s.split() for s in steps]
    assert len(per_step) == 8
    if words == "gradients":
        # After the pre-flight's forward: every rank's word on it, the first boundary's own
        # all-reduce, then the gradients' (with step 0's loss check).
        assert per_step[0] == ["all_reduce", "all_reduce", "all_reduce"], per_step
        alone = ["all_reduce"]
    else:
        assert per_step[0].count("gather") == 1, per_step   # step 0's figures, gathered
        alone = ["all_reduce", "all_reduce"]   # the loss check, then the gradients
    for step in range(1, 8):
        assert per_step[step][:len(alone)] == alone, (step, per_step)
        assert "gather" not in per_step[step]
    assert [s for s in range(1, 7) if per_step[s] != alone] == [3]
    assert per_step[3] == alone + ["broadcast"]   # the command's value, once


def test_a_probed_steps_record_comes_a_step_later_in_its_place_before_the_boundary_after_it(write_script, tmp_path):
    """Rank 0 gathers a probed step's figures without waiting for the other ranks to finish the
    step: rank 1, held at the end of step 6 until rank 0 has begun step 7's forward, is let go.
    Each step's record still has every rank's figures and comes before what the boundary after
    it recorded (a save, a dtype switch, a pause, a resume); while paused the last step is in the
    file; the last step comes before the end."""
    script = write_script(DDP_SCRIPT)
    run_dir, linger = tmp_path / "run", tmp_path / "linger"
    linger.mkdir()
    job = subprocess.Popen(
        rank_command(script, run_dir, "--steps", "9", "--dtype", "bf16", "--probe-every", "1",
                     "--at", "2:save", "--at", "3:dtype=fp32", "--at", "5:pause",
                     script_args=["--linger", f"1:6:{linger}"]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)

    def while_paused():
        held = read_session(run_dir)
        assert held.steps[-1]["step"] == 4 and len(held.steps[-1]["rank_loss"]) == 2

    resumed_after_pause(job, run_dir, while_paused)
    assert (linger / "rank1.linger").read_text() == "ahead"
    records = read_session(run_dir).records
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(9))
    for r in steps:
        assert len(r["rank_loss"]) == 2 and len(r["rank_step_time"]) == 2, r
    position = {r["step"]: i for i, r in enumerate(records) if r["type"] == "step"}
    boundary = [(r["step"], r["kind"], r.get("action")) for r in records
                if r["type"] == "event" and r["kind"] in ("intervention", "checkpoint_saved")]
    assert boundary == [(2, "checkpoint_saved", None), (2, "intervention", "save"), (3, "intervention", "dtype"),
                        (5, "intervention", "pause"), (5, "intervention", "resume")]
    for i, r in enumerate(records):
        if r["type"] == "event" and r["kind"] in ("intervention", "checkpoint_saved"):
            assert position[r["step"] - 1] < i < position[r["step"]], (i, r)
    assert records[-1]["type"] == "end" and records[-2] is steps[-1]
