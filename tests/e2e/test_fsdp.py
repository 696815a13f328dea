"""FSDP2 under amp-tui, on the CPU with gloo and 2 ranks: `amp-tui train --nproc 2 --fsdp` in
fp16 and bf16 (the figures over shards equal a one-process run's, the skips and scales agree),
a NaN on one rank only, commands landing at the same step, checkpoints, and a script that shards
its own model.

Every job is bounded by a timeout (a hang fails the test); every wait is on the job's own
progress.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from amp_tui.recording.reader import read_session

from support import RANK_TIMEOUT_S, rank_end, rank_events, train_ranks

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

# Two Linear blocks whose first dimension shards unevenly over 2 ranks (16 rows, then 1: rank 1
# holds an empty shard of the last weight). `--own` shards the model in setup() itself.
FSDP_SCRIPT = '''
import argparse
import torch
from torch import nn

def setup(ctx):
    p = argparse.ArgumentParser()
    p.add_argument("--same-data", action="store_true")
    p.add_argument("--nan", default=None)
    p.add_argument("--own", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0)
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
    def loss_fn(model, batch):
        if a.sleep:
            import time
            time.sleep(a.sleep)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return {"model": model, "optimizer": opt, "loss_fn": loss_fn, "batches": batches, "max_grad_norm": 50.0}
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
    skipped = [(s, "nonfinite") for s, kind, _ in rank_events(run_dir) if kind == "nonfinite"]
    assert skipped == [(r["step"], "nonfinite") for r in steps if r["skipped"]]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fsdp_figures_over_shards_equal_the_unsharded_models(write_script, tmp_path, dtype):
    """The same data on both ranks: the averaged gradient is each rank's own, bitwise, so every
    figure of the sharded run is that of the same model in one process."""
    script = write_script(FSDP_SCRIPT)
    flags = ("--dtype", dtype, "--steps", "5", "--probe-every", "1")
    sharded = train_ranks(script, tmp_path / "sharded", "--fsdp", *flags, script_args=["--same-data"])
    assert sharded.returncode == 0, sharded.stdout + sharded.stderr
    whole = one_process(script, tmp_path / "whole", *flags, script_args=["--same-data"])
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
    assert "on rank 1" in bad[0]["message"] and bad[0]["layer"] == "0", bad[0]
    assert [r["step"] for r in session.steps if r["skipped"]] == [2]
    assert [s for s, kind, _ in rank_events(run_dir) if kind == "nonfinite"] == [2]
    assert rank_end(run_dir)["skipped"] == session.end["skipped_total"] == 1
