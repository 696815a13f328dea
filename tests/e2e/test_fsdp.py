"""FSDP2 under amp-tui, on the CPU with gloo and 2 ranks: `amp-tui train --nproc 2 --fsdp` in
fp16 and bf16 (the figures over shards equal a one-process run's, the skips and scales agree),
a NaN on one rank only, commands landing at the same step, checkpoints, and a script that shards
its own model.

Every job is bounded by a timeout (a hang fails the test); every wait is on the job's own
progress.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from amp_tui.job.steering.control import send
from amp_tui.recording.reader import read_session

from support import (
    RANK_TIMEOUT_S,
    rank_command,
    rank_end,
    rank_events,
    rank_pid,
    recorded_steps,
    steer_to_its_end,
    step_count,
    train_ranks,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

# Two Linear blocks whose first dimension shards unevenly over 2 ranks (16 rows, then 1: rank 1
# holds an empty shard of the last weight). `--own` shards the model in setup() itself.
FSDP_SCRIPT = '''
import argparse, hashlib
import torch
from torch import nn

def setup(ctx):
    p = argparse.ArgumentParser()
    p.add_argument("--same-data", action="store_true")
    p.add_argument("--nan", default=None)
    p.add_argument("--own", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--digests", default=None)
    p.add_argument("--accumulate", type=int, default=1)
    a = p.parse_args(ctx.argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if a.own:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0 if a.same_data else 1 + ctx.rank)
    xs = torch.randn(64, 8, generator=g) * 40
    ys = xs.sum(1, keepdim=True)
    batches = [(xs[i:i + 16].clone(), ys[i:i + 16]) for i in range(0, 64, 16)]
    if a.nan:   # RANK:BATCH
        rank, batch = (int(v) for v in a.nan.split(":"))
        if rank == ctx.rank:
            batches[batch][0][0, 0] = float("nan")
    def digest(model):
        # Every rank gathers the whole weights (a collective, the same on every rank); rank 0
        # writes their digest, one line per forward.
        with torch.no_grad():
            full = [p.full_tensor() for p in model.parameters()]
        if ctx.rank == 0:
            h = hashlib.sha256(b"".join(t.numpy().tobytes() for t in full)).hexdigest()
            with open(a.digests, "a") as out:
                out.write(h + "\\n")
    def loss_fn(model, batch):
        if a.digests:
            digest(model)
        if a.sleep:
            import time
            time.sleep(a.sleep)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches, "max_grad_norm": 50.0,
            "accumulate": a.accumulate}
'''


def one_process(script, run_dir, *flags, script_args=()):
    """`amp-tui train SCRIPT --headless` in one process, to its end."""
    command = [sys.executable, "-m", "amp_tui", "train", str(script), "--headless", "--run-dir", str(run_dir), *flags]
    return subprocess.run(command + (["--", *script_args] if script_args else []), capture_output=True, text=True,
                          timeout=RANK_TIMEOUT_S, cwd=script.parent)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fsdp_trains_with_per_layer_figures_and_agreed_skips(write_script, tmp_path, dtype):
    script = write_script(FSDP_SCRIPT)
    run_dir = tmp_path / "run"
    done = train_ranks(script, run_dir, "--fsdp", "--dtype", dtype, "--steps", "6", "--probe-every", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    assert session.header["world_size"] == 2
    assert session.header["coordination"] == "collectives: the model is sharded with FSDP2 (fully_shard)"
    assert session.header["layers"] == ["0", "2"]
    steps = session.steps
    assert [r["step"] for r in steps] == list(range(6))
    for r in steps:
        layers = r["layers"]
        assert len(layers["act"]) == len(layers["grad"]) == len(layers["weight"]) == 2
        assert all(isinstance(v, (int, float)) for v in layers["act"] + layers["weight"])
        assert len(r["rank_loss"]) == 2 and r["rank_loss"][0] != r["rank_loss"][1]   # their own data
    end, other = session.end, rank_end(run_dir)
    assert other == {"state": "finished", "step": 6, "updates": end["updates"], "skipped": end["skipped_total"],
                     "dtype": dtype, "scale": end["scale"]}
    if dtype == "fp16":
        assert end["skipped_total"] > 0   # GradScaler's found_inf, agreed over the shards
    # Each skip told once: GradScaler's calibration at the start, a non-finite event after it.
    told = [s for s, kind, _ in rank_events(run_dir) if kind in ("nonfinite", "calibration")]
    assert told == [r["step"] for r in steps if r["skipped"]]


@pytest.mark.parametrize(("dtype", "accumulate"), [("fp16", 1), ("bf16", 2)])
def test_fsdp_figures_over_shards_equal_the_unsharded_models(write_script, tmp_path, dtype, accumulate):
    """The same data on both ranks: the averaged gradient is each rank's own, bitwise, so every
    figure of the sharded run is that of the same model in one process (with 2 micro-batches
    too: each one's backward reduce-scatters, and the shards add up)."""
    script = write_script(FSDP_SCRIPT)
    flags = ("--dtype", dtype, "--steps", "5", "--probe-every", "1")
    data = ["--same-data", "--accumulate", str(accumulate)]
    sharded = train_ranks(script, tmp_path / "sharded", "--fsdp", *flags, script_args=data)
    assert sharded.returncode == 0, sharded.stdout + sharded.stderr
    whole = one_process(script, tmp_path / "whole", *flags, script_args=data)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    a, b = read_session(tmp_path / "sharded").steps, read_session(tmp_path / "whole").steps
    assert len(a) == len(b) == 5
    for mine, theirs in zip(a, b):
        for kind in ("grad", "weight", "act"):
            assert mine["layers"][kind] == theirs["layers"][kind], (kind, mine["step"])
        assert (mine["loss"], mine["scale"], mine["skipped"], mine["grad_norm"]) == \
            (theirs["loss"], theirs["scale"], theirs["skipped"], theirs["grad_norm"])


def test_fsdp_nan_on_rank_1_only_skips_on_both_and_names_rank_and_layer(write_script, tmp_path):
    script = write_script(FSDP_SCRIPT)
    run_dir = tmp_path / "run"
    done = train_ranks(script, run_dir, "--fsdp", "--dtype", "bf16", "--steps", "4", "--probe-every", "1",
                       "--dist-timeout", "60", script_args=["--nan", "1:2"])
    assert done.returncode == 0, done.stdout + done.stderr
    session = read_session(run_dir)
    bad = [e for e in session.events if e["kind"] == "nonfinite"]
    assert len(bad) == 1 and bad[0]["step"] == 2 and bad[0]["rank"] == 1, bad
    # the NaN came in with rank 1's data: named as such, not as a layer of the model
    assert "on rank 1" in bad[0]["message"] and bad[0]["layer"] is None, bad[0]
    assert "the model's input was already non-finite" in bad[0]["message"], bad[0]
    # a rank can't replay an FSDP2 forward alone: said, instead of an error from a refused collective
    assert bad[0]["op_message"].startswith("not traced to its op") and "op_trace_error" not in bad[0], bad[0]
    assert [r["step"] for r in session.steps if r["skipped"]] == [2]
    assert [s for s, kind, _ in rank_events(run_dir) if kind == "nonfinite"] == [2]
    assert rank_end(run_dir)["skipped"] == session.end["skipped_total"] == 1


def test_fsdp_at_commands_land_on_both_ranks_and_a_restore_brings_the_weights_back_bitwise(write_script, tmp_path):
    """Every forward, rank 0 writes a digest of the whole weights (gathered from the shards): the
    forward after the restore runs on the very weights of the forward after the save."""
    script = write_script(FSDP_SCRIPT)
    run_dir, digests = tmp_path / "run", tmp_path / "digests.txt"
    done = train_ranks(script, run_dir, "--fsdp", "--dtype", "bf16", "--steps", "6", "--dist-timeout", "60",
                       "--at", "2:save", "--at", "3:note=between", "--at", "4:restore=latest",
                       "--at", "5:dtype=fp32", script_args=["--digests", str(digests)])
    assert done.returncode == 0, done.stdout + done.stderr
    forwards = digests.read_text().split()
    assert len(forwards) == 6   # one forward per step, the first kept from the pre-flight
    assert forwards[4] == forwards[2] and forwards[3] != forwards[2]
    session = read_session(run_dir)
    kinds = ("checkpoint_saved", "checkpoint_restored", "note", "intervention")
    ours = [(e["step"], e["kind"]) for e in session.events if e["kind"] in kinds and e.get("action") != "save"]
    assert ours == [(2, "checkpoint_saved"), (3, "note"), (4, "checkpoint_restored"), (5, "intervention")]
    assert [r["dtype"] for r in session.steps] == ["bfloat16"] * 5 + ["float32"]
    theirs = [(s, k) for s, k, _ in rank_events(run_dir) if k in kinds]
    assert theirs == ours   # rank 1: the same steps
    # One safetensors file, the whole model in it, readable without amp-tui.
    from safetensors import safe_open
    saved = next(e for e in session.events if e["kind"] == "checkpoint_saved")
    assert saved["layout"] == "full" and "available" in saved["layout_reason"]   # auto: a small model
    with safe_open(str(run_dir / saved["path"]), framework="pt") as f:
        assert f.get_tensor("model.0.weight").shape == (16, 8) and f.get_tensor("model.2.weight").shape == (1, 16)
    assert rank_end(run_dir)["updates"] == session.end["updates"]


def test_fsdp_resume_after_a_kill_and_refuse_another_world_size(write_script, tmp_path):
    script = write_script(FSDP_SCRIPT)
    run_dir = tmp_path / "run"
    job = subprocess.Popen(rank_command(script, run_dir, "--fsdp", "--dtype", "bf16", "--checkpoint-every", "2",
                                        "--dist-timeout", "60", script_args=["--sleep", "0.05"]),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)

    def steer():
        def going() -> bool:
            if job.poll() is not None:
                raise AssertionError(f"the job exited with status {job.returncode}: {job.stdout.read()}")
            return step_count(run_dir / "session.jsonl") >= 4 and rank_pid(run_dir) is not None
        assert wait_for(going, RANK_TIMEOUT_S), "the job never got going"
        os.kill(rank_pid(run_dir), signal.SIGKILL)
    out = steer_to_its_end(job, steer)
    assert job.returncode != 0, out
    killed = read_session(run_dir)
    assert killed.end["status"] == "error"
    [lost] = [e for e in killed.events if e["kind"] == "error"]
    assert "another rank is gone" in lost["message"]
    saved = [e["checkpoint_step"] for e in killed.events if e["kind"] == "checkpoint_saved"]
    assert saved, killed.events
    # Another world size: refused before anything is written.
    before = (run_dir / "session.jsonl").read_bytes()
    alone = one_process(script, run_dir, "--steps", "2", "--resume", str(run_dir))
    assert alone.returncode == 2, alone.stdout + alone.stderr
    assert "saved by a run of 2 ranks and this one has 1" in alone.stderr and "--nproc 2" in alone.stderr
    assert (run_dir / "session.jsonl").read_bytes() == before
    # The same world size goes on from the newest checkpoint, on both ranks.
    again = train_ranks(script, run_dir, "--fsdp", "--dtype", "bf16", "--steps", "2", "--resume", str(run_dir),
                        with_run_dir=False)
    assert again.returncode == 0, again.stdout + again.stderr
    session = read_session(run_dir)
    [resumed] = [e for e in session.events if e["kind"] == "resumed"]
    assert resumed["checkpoint_step"] == saved[-1]
    assert rank_end(run_dir)["state"] == "finished" and rank_end(run_dir)["step"] == session.end["step"]


# A loop of the user's own under torchrun that shards its model itself, with a GradScaler,
# clipping on the sharded total norm and amp_tui.monitor. Each rank prints where it stopped, its
# scale and every change of autocast dtype it saw.
OWN_FSDP_LOOP_SCRIPT = '''
import os, time
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import amp_tui

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
fully_shard(model[0])
fully_shard(model[2])
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=256)
xs = torch.randn(64, 8, generator=torch.Generator().manual_seed(rank))
batches = [(xs[i:i + 16], xs[i:i + 16].sum(1, keepdim=True)) for i in range(0, 64, 16)]
monitor = amp_tui.monitor(model, optimizer, scaler=scaler)
seen = []
for i in range(100000):
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
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(optimizer)
        scaler.update()
    time.sleep(0.02)
    if monitor.should_stop:
        break
monitor.close()
print(f"rank {rank} stopped at {i}, scale {scaler.get_scale()}; dtypes {seen}", flush=True)
dist.destroy_process_group()
'''


def test_amp_tui_run_follows_a_torchrun_loop_that_shards_its_own_model(write_script, tmp_path):
    script = write_script(OWN_FSDP_LOOP_SCRIPT, "loop.py")
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
    assert session.header["world_size"] == 2
    assert session.header["coordination"] == "collectives: the model is sharded with FSDP2 (fully_shard)"
    probed = [r for r in session.steps if "layers" in r]   # rank 0's schedule, agreed by both
    assert session.header["probe_every"] == "auto" and probed
    for r in probed:
        assert len(r["rank_loss"]) == 2 and len(r["layers"]["grad"]) == 2
        assert len(r["layers"].get("weight", [0, 0])) == 2   # (weights: on some probed steps)
    assert "weight" in probed[0]["layers"]
    # Unbuffered, one rank's line can run into the other's: each ends at its list's closing bracket.
    ends = dict(re.findall(r"rank (\d) stopped at ([^\[\n]*\[[^\]]*\])", out))
    assert set(ends) == {"0", "1"} and ends["0"] == ends["1"], out   # the same step, scale and switch
    switch = next(e for e in session.events if e.get("action") == "dtype")
    assert f"({switch['step']}, 'torch.bfloat16')" in ends["0"]


def test_a_model_the_script_sharded_itself_is_left_as_it_is(write_script, tmp_path):
    script = write_script(FSDP_SCRIPT)
    run_dir = tmp_path / "run"
    done = train_ranks(script, run_dir, "--fsdp", "--dtype", "bf16", "--steps", "3", "--probe-every", "1",
                       script_args=["--own"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sharded already" in done.stdout + done.stderr
    session = read_session(run_dir)
    assert session.header["coordination"] == "collectives: the model is sharded with FSDP2 (fully_shard)"
    assert session.header["layers"] == ["0", "2"] and len(session.steps) == 3
    assert all(len(r["layers"]["weight"]) == 2 for r in session.steps)


def test_fsdp_scale_pause_single_step_and_resume_land_on_both_ranks(write_script, tmp_path):
    """fp16 with a scale halved at step 1 and a pause at step 3, held longer than the process
    group's timeout (the heartbeat), one single step over the control socket, then resume: rank 1
    applies each at the step rank 0 does, and both end with the same counts and scale."""
    script = write_script(FSDP_SCRIPT)
    run_dir = tmp_path / "run"
    timeout_s = 5
    job = subprocess.Popen(rank_command(script, run_dir, "--fsdp", "--steps", "6", "--dist-timeout", str(timeout_s),
                                        "--at", "1:scale=half", "--at", "3:pause"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)

    def state():
        if job.poll() is not None:
            raise AssertionError(f"the job exited with status {job.returncode}: {job.stdout.read()}")
        try:
            return send(run_dir, "status", timeout=10)["status"]
        except Exception:  # noqa: BLE001 - not serving yet: wait on
            return {}

    def steer():
        assert wait_for(lambda: state().get("state") == "paused", RANK_TIMEOUT_S), "never paused"
        assert state()["step"] == 3
        assert not wait_for(lambda: job.poll() is not None, 2 * timeout_s)   # held past the timeout
        assert send(run_dir, "step")["ok"]
        assert wait_for(lambda: state().get("step") == 4 and state().get("state") == "paused", RANK_TIMEOUT_S)
        assert send(run_dir, "resume")["ok"]
    out = steer_to_its_end(job, steer)
    assert job.returncode == 0, out
    session = read_session(run_dir)
    kinds = ("intervention",)
    ours = [(e["step"], e.get("action")) for e in session.events if e["kind"] in kinds]
    assert ours[:2] == [(1, "scale"), (3, "pause")] and (4, "resume") in ours, ours
    theirs = [s for s, k, _ in rank_events(run_dir) if k in kinds]
    assert theirs == [s for s, _ in ours]
    end = session.end
    assert rank_end(run_dir) == {"state": "finished", "step": 6, "updates": end["updates"],
                                 "skipped": end["skipped_total"], "dtype": "fp16", "scale": end["scale"]}


def test_fsdp_sharded_checkpoint_each_rank_its_shards_restored_bitwise_and_resumed(write_script, tmp_path):
    """`--fsdp-checkpoint sharded`: each rank writes its own shards with torch.distributed.checkpoint
    into one folder; a restore mid-run brings the weights back bitwise, the listing and a --resume
    find the folder, another world size is refused, and torch's consolidation makes one file of it
    that a single process loads."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    from amp_tui.training.checkpoint import list_checkpoints
    from amp_tui.training.checkpoint.dcp import consolidate

    script = write_script(FSDP_SCRIPT)
    run_dir, digests = tmp_path / "run", tmp_path / "digests.txt"
    done = train_ranks(script, run_dir, "--fsdp", "--fsdp-checkpoint", "sharded", "--dtype", "bf16", "--steps", "6",
                       "--dist-timeout", "60", "--at", "2:save", "--at", "3:note=between", "--at", "4:restore=latest",
                       script_args=["--digests", str(digests)])
    assert done.returncode == 0, done.stdout + done.stderr
    forwards = digests.read_text().split()
    assert len(forwards) == 6 and forwards[4] == forwards[2] and forwards[3] != forwards[2]
    session = read_session(run_dir)
    kinds = ("checkpoint_saved", "checkpoint_restored", "note")
    ours = [(e["step"], e["kind"]) for e in session.events if e["kind"] in kinds]
    assert ours == [(2, "checkpoint_saved"), (3, "note"), (4, "checkpoint_restored")]
    assert [(s, k) for s, k, _ in rank_events(run_dir) if k in kinds] == ours
    [saved] = [e for e in session.events if e["kind"] == "checkpoint_saved"]
    [restored] = [e for e in session.events if e["kind"] == "checkpoint_restored"]
    assert saved["layout"] == "sharded" and "--fsdp-checkpoint sharded" in saved["layout_reason"]
    assert restored["path"] == saved["path"] == "checkpoints/step-0000002.shards"
    folder = run_dir / saved["path"]
    shards = ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert sorted(p.name for p in folder.iterdir()) == ["amp-tui-checkpoint.json", *shards]   # no .metadata
    rows = 0
    for name in shards:   # each rank's file holds its rows of each weight, readable without amp-tui
        assert not (folder / name).read_bytes().startswith(b"\x80")
        with safe_open(str(folder / name), framework="pt") as f:
            rows += f.get_slice("model.0.weight").get_shape()[0]
            assert f.get_slice("model.0.weight").get_shape()[1] == 8
    assert rows == 16
    manifest = json.loads((folder / "amp-tui-checkpoint.json").read_text())
    assert manifest["world_size"] == 2 and len(manifest["extra"]["rank_rng"]) == 2
    assert manifest["step"] == 2 and manifest["dtype"] == "bfloat16" and "scaler" in manifest   # bf16: none
    assert manifest["extra"]["updates_applied"] == 2 and manifest["optimizer"]["class"] == "AdamW"
    assert manifest["model"]["0.weight"]["shape"] == [16, 8]
    assert [i.path for i in list_checkpoints(run_dir / "checkpoints")] == [folder]
    # One file of it, for one process (torch's consolidation, outside the run).
    whole = consolidate(folder, tmp_path / "whole")
    weights = load_file(str(whole))
    assert weights["0.weight"].shape == (16, 8) and weights["2.weight"].shape == (1, 16)
    # Another world size: refused before anything is written.
    before = (run_dir / "session.jsonl").read_bytes()
    alone = one_process(script, run_dir, "--steps", "2", "--resume", str(run_dir))
    assert alone.returncode == 2, alone.stdout + alone.stderr
    assert "saved by a run of 2 ranks and this one has 1" in alone.stderr
    assert (run_dir / "session.jsonl").read_bytes() == before
    # The same world size goes on from it, each rank loading its shards.
    again_digests = tmp_path / "again.txt"
    again = train_ranks(script, run_dir, "--fsdp", "--dtype", "bf16", "--steps", "2", "--resume", str(run_dir),
                        with_run_dir=False, script_args=["--digests", str(again_digests)])
    assert again.returncode == 0, again.stdout + again.stderr
    [resumed] = [e for e in read_session(run_dir).events if e["kind"] == "resumed"]
    assert resumed["path"] == saved["path"] and resumed["checkpoint_step"] == 2
    assert forwards[2] in again_digests.read_text().split()
