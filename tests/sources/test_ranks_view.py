"""What the read side makes of a session of several ranks (world_size, rank_loss, rank_step_time):
`amp-tui ls` lists it as one run, a replay's snapshot has its per-rank view with the slowest rank,
the status bar names both; a one-process session reads as before. And the command words the
ranks agree on survive their encoding."""

import json

import pytest

from amp_tui.cli import main
from amp_tui.core.commands import ACTIONS, Command
from amp_tui.job.ranks.command_codec import decode_commands, encode_commands
from amp_tui.sources.replay import ReplaySource
from amp_tui.ui.view import current_precision, rank_summary
from amp_tui.ui.widgets.status_bar import status_text


@pytest.fixture
def runs(mlp_script, tmp_path):
    """exp/alone (one process) and exp/ranks: the same records as a 2-rank job's, rank 1 the slower."""
    alone, ranks = tmp_path / "exp" / "alone", tmp_path / "exp" / "ranks"
    assert main(["train", str(mlp_script), "--headless", "--steps", "4", "--run-dir", str(alone)]) == 0
    ranks.mkdir()
    lines = []
    for line in (alone / "session.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "header":
            record["world_size"] = 2
        elif record["type"] == "step":
            layers = record.pop("layers", None)
            record["rank_loss"] = [record["loss"], record["loss"] + 1.0]
            record["rank_step_time"] = [0.01, 0.03 + record["step"]]
            if layers is not None:
                record["layers"] = layers
        lines.append(json.dumps(record))
    (ranks / "session.jsonl").write_text("\n".join(lines) + "\n")
    return alone, ranks


def test_ls_lists_a_run_of_several_ranks_as_one_run_with_its_ranks(runs, capsys):
    alone, ranks = runs
    capsys.readouterr()
    assert main(["ls", str(ranks.parent)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "finished" in line]
    assert len(rows) == 2
    [row] = [r for r in rows if "ranks" in r.split()[0]]
    assert "(2 ranks)" in row
    assert "ranks)" not in next(r for r in rows if r.split()[0] == "alone")


def test_a_replay_shows_the_world_size_and_the_slowest_rank(runs):
    alone, ranks = runs
    source = ReplaySource(ranks, autoplay=False)
    source.end()
    snap = source.snapshot()
    summary = rank_summary(snap)
    assert summary.world_size == 2 and summary.step == 3 and summary.slowest == 1
    assert [(row.rank, row.slowest) for row in summary.rows] == [(0, False), (1, True)]
    assert summary.rows[1].loss == pytest.approx(summary.rows[0].loss + 1.0)
    assert summary.lag == pytest.approx(3.03 / 0.01)
    text = status_text(snap, current_precision(snap), pending=[], stopping=False, now=0.0).plain
    assert "ranks 2" in text and "slowest rank 1" in text

    one = ReplaySource(alone, autoplay=False)
    one.end()
    snap = one.snapshot()
    assert rank_summary(snap) is None and snap.ranks is None
    assert "ranks" not in status_text(snap, current_precision(snap), pending=[], stopping=False, now=0.0).plain


@pytest.mark.parametrize("commands", [
    [],
    [Command("pause", None, "ctl")],
    [Command(ACTIONS[-1], None, "ctl")],
    [Command("dtype", "bfloat16", "ctl")],
    [Command("save", None, "at"), Command("scale", "half", "at"), Command("restore", "latest", "at")],
])
def test_the_commands_rank_0_sends_are_the_ones_every_rank_applies(commands):
    code, payload = encode_commands(commands)
    if len(commands) == 1 and commands[0].value is None:
        assert payload == b""   # one command without a value: the fixed-size words alone
    decoded = decode_commands(code, payload)
    assert [(c.action, c.value) for c in decoded] == [(c.action, c.value) for c in commands]


@pytest.mark.parametrize("flags, problem", [
    (["--dist-timeout", "1"], "--dist-timeout 1: give more than 2 s"),
    (["--nnodes", "2", "--rdzv-endpoint", "localhost:29555"], "--nnodes 2 needs --run-dir DIR"),
], ids=["a timeout a pause would trip", "several machines without one run directory"])
def test_a_job_of_several_ranks_that_could_not_work_is_refused_before_it_starts(tmp_path, capsys, flags, problem):
    script = tmp_path / "train.py"
    script.write_text("def setup(ctx):\n    raise AssertionError('never imported')\n")
    assert main(["train", str(script), "--nproc", "2", "--headless", *flags]) == 2
    assert problem in capsys.readouterr().err
