"""Several ranks under faults, on the CPU with gloo and 2 ranks: a NaN on one rank only, a
signal to one worker, a worker killed, a resume with another world size.

Every job is bounded by a timeout (a hang fails the test), every wait is on the job's own
progress (steps recorded, the pid rank 1 printed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from amp_tui.core.precision import short_name
from amp_tui.recording.reader import read_session
from amp_tui.training.checkpoint.io import read_header

from support import (
    DDP_SCRIPT,
    RANK_TIMEOUT_S,
    REPO,
    rank_command,
    rank_end,
    rank_events,
    rank_pid,
    steer_to_its_end,
    step_count,
    train_ranks,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.ranks]


def documented_rank_fields() -> set[tuple[str, str]]:
    """(record, field) of every row of session-format.md's "Several ranks" table."""
    text = (REPO / "docs" / "session-format.md").read_text(encoding="utf-8")
    body = text.split("\n## Several ranks\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| ([a-z `]+?) \| `(\w+)` \|", body, flags=re.M))


def start(script, run_dir, *flags, script_args=()):
    return subprocess.Popen(rank_command(script, run_dir, *flags, script_args=script_args),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=script.parent)


def running(job, run_dir, steps: int) -> bool:
    """`steps` steps recorded and rank 1's pid printed (a job that exited fails the test)."""
    if job.poll() is not None:
        raise AssertionError(f"the job exited with status {job.returncode}: {job.stdout.read()}")
    return step_count(run_dir / "session.jsonl") >= steps and rank_pid(run_dir) is not None


def test_a_nan_in_rank_1s_inputs_only_is_skipped_by_both_ranks_without_a_hang(write_script, tmp_path):
    """Rank 1's loss alone is NaN at step 2: without the agreed loss check rank 1 would skip its
    backward while rank 0's waits in DDP's all-reduce (until --dist-timeout)."""
    script = write_script(DDP_SCRIPT)
    run_dir = tmp_path / "run"
    done = train_ranks(script, run_dir, "--dtype", "bf16", "--steps", "4", "--dist-timeout", "20",
                       script_args=["--nan", "1:2"])
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    [event] = [e for e in session.events if e["kind"] == "nonfinite"]
    assert event["step"] == 2 and event["where"] == "loss" and event["rank"] == 1
    assert "rank 1" in event["message"]
    # the NaN came in with rank 1's data: no module of the model made it, none is named as where it began
    assert event["layer"] is None and event["origin"] is None and event["origin_input_nonfinite"] is True
    assert "the model's input was already non-finite" in event["message"]
    bad = session.steps[2]
    assert bad["skipped"] and bad["nonfinite"] == "loss"
    assert isinstance(bad["rank_loss"][0], float) and bad["rank_loss"][1] == "NaN"   # rank 1's alone
    assert bad["layers"]["act"][0] == "NaN"   # each layer's maximum over the ranks: rank 1's NaN
    assert [s for s, kind, _ in rank_events(run_dir) if kind == "nonfinite"] == [2]
    end = session.end
    assert end["skipped_total"] == 1
    # What several ranks add to the session, under the names session-format.md gives them.
    one_rank = subprocess.run([sys.executable, "-m", "amp_tui", "train", str(script), "--headless", "--dtype", "bf16",
                               "--steps", "4", "--run-dir", str(tmp_path / "one"), "--", "--nan", "0:2"],
                              capture_output=True, text=True, timeout=RANK_TIMEOUT_S, cwd=tmp_path)
    assert one_rank.returncode == 0, one_rank.stderr
    alone = read_session(tmp_path / "one")
    added = {("header", k) for k in set(session.header) - set(alone.header)}
    added |= {("step", k) for k in set(bad) - set(alone.steps[2])}
    added |= {("event `nonfinite`", k) for k in set(event) - set(alone.events[0])}
    assert alone.events[0]["kind"] == "nonfinite" and added == documented_rank_fields()
    assert rank_end(run_dir) == {"state": "finished", "step": 4, "updates": 3, "skipped": 1, "dtype": "bf16",
                                 "scale": None}


@pytest.mark.parametrize("words", ["gradients", "collectives"])
def test_a_nan_in_the_first_micro_batch_on_rank_1_only_skips_the_step_on_both_ranks(write_script, tmp_path, words):
    """Two micro-batches a step (the 4 batches: two steps, then again); rank 1's first of step 1
    holds a NaN. Both ranks skip the step alike. Carried by DDP's gradient all-reduce, the answer
    comes with the second micro-batch's backward (the first is `no_sync`), so both ran it; in an
    all-reduce of its own (the script's DDP has a communication hook of its own), after the first
    micro-batch's backward, and neither runs the second."""
    script = write_script(DDP_SCRIPT)
    run_dir, params, calls = tmp_path / "run", tmp_path / "params", tmp_path / "calls"
    params.mkdir()
    calls.mkdir()
    done = train_ranks(script, run_dir, "--dtype", "bf16", "--steps", "3", "--dist-timeout", "20",
                       script_args=["--accumulate", "2", "--nan", "1:2", "--params", str(params),
                                    "--calls", str(calls)] + (["--own-hook"] if words == "collectives" else []))
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    [event] = [e for e in session.events if e["kind"] == "nonfinite"]
    assert event["step"] == 1 and event["where"] == "loss" and event["rank"] == 1 and "rank 1" in event["message"]
    assert event["layer"] is None and event["origin"] is None and event["origin_input_nonfinite"] is True
    assert [r["micro_batches"] for r in session.steps] == [2] * 3
    assert session.steps[1]["skipped"] and session.steps[1]["rank_loss"][1] == "NaN"
    assert [s for s, kind, _ in rank_events(run_dir) if kind == "nonfinite"] == [1]
    end = session.end
    assert end["skipped_total"] == 1 and end["updates"] == 2
    assert rank_end(run_dir) == {"state": "finished", "step": 3, "updates": 2, "skipped": 1, "dtype": "bf16",
                                 "scale": None}
    assert (params / "rank0.txt").read_text() == (params / "rank1.txt").read_text()
    assert session.header["coordination"].startswith(words)
    # The same collectives in the same order on both ranks; rank 1 alone, whose loss was NaN,
    # replays its micro-batch's forward for the op trace (none in between).
    sequences = [(calls / f"rank{r}.calls").read_text().split("\n") for r in (0, 1)]
    assert [c for c in sequences[0] if c != "loss"] == [c for c in sequences[1] if c != "loss"]
    assert sequences[1].count("loss") == sequences[0].count("loss") + 1
    if words == "gradients":
        # Every micro-batch of the 3 steps, and the diagnosis's forward of the bad one.
        assert sequences[0].count("loss") == 7, sequences[0]
        return
    # Step 1 (from step 0's figures gathered to its own) ran one loss check: its second
    # micro-batch ran on neither rank.
    assert sequences[0].count("loss") == 6, sequences[0]   # (5 micro-batches and the diagnosis's)
    gathers = [i for i, name in enumerate(sequences[0]) if name == "gather"]
    assert len(gathers) == 3 and sequences[0][gathers[0] + 1:gathers[1]].count("all_reduce") == 1, sequences[0]


def test_sigterm_to_one_worker_stops_both_at_the_same_step_with_a_checkpoint(write_script, tmp_path):
    script = write_script(DDP_SCRIPT)
    run_dir = tmp_path / "run"
    job = start(script, run_dir, "--steps", "300", "--dist-timeout", "60", script_args=["--sleep", "0.05"])
    def steer():
        assert wait_for(lambda: running(job, run_dir, 3), RANK_TIMEOUT_S), "the job never got going"
        os.kill(rank_pid(run_dir), signal.SIGTERM)
    out = steer_to_its_end(job, steer)
    assert job.returncode == 0, out
    session = read_session(run_dir)
    assert session.end["status"] == "stopped"
    [stopping] = [e for e in session.events if e["kind"] == "stopping"]
    assert "SIGTERM on rank 1" in stopping["message"]
    [saved] = [e for e in session.events if e["kind"] == "checkpoint_saved"]
    assert (run_dir / saved["path"]).exists() and saved["checkpoint_step"] == session.end["step"]
    assert rank_end(run_dir)["state"] == "stopped" and rank_end(run_dir)["step"] == session.end["step"]
    head, _ = read_header(run_dir / saved["path"])   # rank 0's file, with every rank's RNG state
    extra = json.loads(head.metadata["extra"])
    assert extra["world_size"] == 2 and len(extra["rank_rng"]) == 2
    # The same world size resumes from it, on both ranks.
    stopped_at = session.end["step"]
    again = train_ranks(script, run_dir, "--steps", "2", "--resume", str(run_dir), with_run_dir=False)
    assert again.returncode == 0, again.stdout + again.stderr
    session = read_session(run_dir)
    [resumed] = [e for e in session.events if e["kind"] == "resumed"]
    assert resumed["checkpoint_step"] == stopped_at and session.end["step"] == stopped_at + 2
    assert rank_end(run_dir)["state"] == "finished" and rank_end(run_dir)["step"] == stopped_at + 2


def test_kill_9_of_one_worker_ends_the_other_with_the_session_kept(write_script, tmp_path):
    """The survivor's collective fails as the dead rank's connection closes (or torchrun's agent
    stops it): far sooner than --dist-timeout, which the wait's bound stays below."""
    script = write_script(DDP_SCRIPT)
    run_dir = tmp_path / "run"
    job = start(script, run_dir, "--dist-timeout", str(3 * RANK_TIMEOUT_S), script_args=["--sleep", "0.05"])
    before_kill = {}

    def steer():
        assert wait_for(lambda: running(job, run_dir, 3), RANK_TIMEOUT_S), "the job never got going"
        before_kill["recorded"] = step_count(run_dir / "session.jsonl")
        os.kill(rank_pid(run_dir), signal.SIGKILL)
    out = steer_to_its_end(job, steer)
    recorded = before_kill["recorded"]
    assert job.returncode != 0, out
    session = read_session(run_dir)   # reads back: every step recorded before the kill is there
    assert len(session.steps) >= recorded and session.skipped_lines == 0
    assert [r["step"] for r in session.steps] == list(range(len(session.steps)))
    assert session.end is not None and session.end["status"] == "error", session.end
    [lost] = [e for e in session.events if e["kind"] == "error"]
    assert "another rank is gone" in lost["message"] and not lost.get("traceback")
    assert "rank 1 (pid" in out and "killed by SIGKILL" in out and "Traceback" not in out


def test_resume_refuses_another_world_size(write_script, tmp_path):
    """A checkpoint of one process, resumed with 2 ranks: a clear error, the session untouched."""
    script = write_script(DDP_SCRIPT)
    run_dir = tmp_path / "run"
    first = subprocess.run([sys.executable, "-m", "amp_tui", "train", str(script), "--headless", "--steps", "3",
                            "--checkpoint-every", "2", "--run-dir", str(run_dir)],
                           capture_output=True, text=True, timeout=RANK_TIMEOUT_S, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    before = (run_dir / "session.jsonl").read_bytes()
    again = subprocess.run([sys.executable, "-m", "amp_tui", "train", str(script), "--headless", "--nproc", "2",
                            "--steps", "2", "--resume", str(run_dir)],
                           capture_output=True, text=True, timeout=RANK_TIMEOUT_S, cwd=tmp_path)
    assert again.returncode == 2, again.stdout + again.stderr
    lines = [x for x in again.stderr.splitlines() if "saved by a run of" in x]
    assert len(lines) == 1, again.stderr
    assert "a run of 1 rank and this one has 2" in lines[0] and "without --nproc" in lines[0]
    assert (run_dir / "session.jsonl").read_bytes() == before   # nothing recorded is lost


def test_the_fallback_guard_moves_every_rank_to_the_same_dtype_at_the_same_step(write_script, tmp_path):
    """--on-nonfinite fallback decides on each rank from what the ranks agreed (the loss check,
    the skips, the scale): rank 1's inputs alone hold NaNs (three batches in a row), and both
    ranks still leave fp16 at the same step, with the same counts and the same parameters."""
    script = write_script(DDP_SCRIPT)
    run_dir, params = tmp_path / "run", tmp_path / "params"
    params.mkdir()
    done = train_ranks(script, run_dir, "--dtype", "fp16", "--steps", "14", "--on-nonfinite", "fallback",
                       "--dist-timeout", "20", script_args=["--nan", "1:1,2,3", "--params", str(params)])
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    moved = [e for e in session.events if e["kind"] == "intervention" and e.get("source") == "fallback"]
    assert moved, "the guard never fell back"
    assert [(s, kind) for s, kind, _ in rank_events(run_dir) if kind == "intervention"] == \
        [(e["step"], "intervention") for e in session.events if e["kind"] == "intervention"]
    end = session.end
    assert end["dtype"] != "float16"
    assert rank_end(run_dir) == {"state": "finished", "step": 14, "updates": end["updates"],
                                 "skipped": end["skipped_total"], "dtype": short_name(end["dtype"]),
                                 "scale": end["scale"]}
    assert (params / "rank0.txt").read_text() == (params / "rank1.txt").read_text()


EMPTY_SHARD_SCRIPT = '''
import torch
from torch import nn

def setup(ctx):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))   # buffers
    xs = torch.randn(8, 8)
    batches = [(xs[i:i + 4], xs[i:i + 4].sum(1, keepdim=True)) for i in range(0, 8, 4)]
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
            "loss_fn": lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
            "batches": batches if ctx.rank == 0 else []}   # rank 1's shard is empty
'''


def test_a_rank_whose_first_batch_fails_stops_every_rank_with_its_words(write_script, tmp_path):
    """Rank 1 has no batch while rank 0's first forward would start (DDP broadcasts the model's
    buffers at each forward): the first batch is agreed on before any forward, so both ranks
    stop at once with rank 1's problem, not in a collective that waits for the other."""
    script = write_script(EMPTY_SHARD_SCRIPT)
    done = train_ranks(script, tmp_path / "run", "--steps", "2", "--dist-timeout", "30")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "rank 1: 'batches' from" in done.stderr and "is empty" in done.stderr, done.stderr
    assert not (tmp_path / "run" / "session.jsonl").exists()


def test_a_rank_killed_while_rank_0_waits_for_its_figures_ends_the_run_with_every_step_before(write_script,
                                                                                            tmp_path):
    """Rank 1 is held at the end of step 3, before its figures go to rank 0, until rank 0 has
    begun step 4 (rank 0 no longer waits for them there), then killed: step 3's figures never
    come. Rank 0 stops within the bound, far below --dist-timeout, and the session reads back
    with steps 0-2, whose figures came, and the error after them."""
    script = write_script(DDP_SCRIPT)
    run_dir, linger = tmp_path / "run", tmp_path / "linger"
    linger.mkdir()
    done = train_ranks(script, run_dir, "--dtype", "bf16", "--steps", "50", "--dist-timeout", str(3 * RANK_TIMEOUT_S),
                       "--probe-every", "1", script_args=["--linger", f"1:3:{linger}:kill"])
    assert done.returncode != 0, done.stdout + done.stderr
    assert (linger / "rank1.linger").read_text() == "ahead"
    session = read_session(run_dir)
    assert [r["step"] for r in session.steps] == [0, 1, 2] and session.skipped_lines == 0
    assert all(len(r["rank_loss"]) == 2 for r in session.steps)
    assert session.end is not None and session.end["status"] == "error", session.end
    [lost] = [e for e in session.events if e["kind"] == "error"]
    assert "another rank is gone" in lost["message"] and not lost.get("traceback")
    kinds = [r["type"] for r in session.records]
    assert kinds[-3:] == ["step", "event", "end"]
    out = done.stdout + done.stderr
    assert "killed by SIGKILL" in out and "Traceback" not in out
