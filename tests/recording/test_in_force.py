"""What a run trains with, shown: the modules in fp32, the dtype and the loss scale's floor, from
one reducer (core/records.py) in the live dashboard, the replay, the report and the exports."""

import csv
import json

from amp_tui.cli import main
from amp_tui.core.records import InForce, in_force_after
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.plot_data import plot_data
from amp_tui.recording.report import read_digest, summarize, summary_lines
from amp_tui.sources.buffer import RunBuffer
from amp_tui.sources.replay import ReplaySource
from amp_tui.training.step.guards import GuardConfig
from amp_tui.ui.view import current_precision, layer_rows
from amp_tui.ui.widgets.status_bar import status_text

from support import train_run


def test_the_reducer_follows_every_record_that_changes_what_a_run_trains_with():
    header = {"type": "header", "dtype": "float16", "fp32_modules": ["head"], "guards": {"min_scale": None}}
    records = [
        header,
        {"type": "step", "step": 0, "dtype": "float16"},
        {"type": "event", "kind": "intervention", "action": "fp32", "source": "autopilot",
         "after": {"fp32_modules": ["blocks.0.attn", "head"]}},
        {"type": "event", "kind": "intervention", "action": "dtype", "after": {"dtype": "bfloat16", "scale": None}},
    ]
    in_force = in_force_after(records)
    assert in_force == InForce("bfloat16", ("blocks.0.attn", "head"), None)
    assert in_force.scale_floor == 2.0 ** -24
    assert in_force.runs_in_fp32("blocks.0.attn.q") and in_force.runs_in_fp32("head")
    assert not in_force.runs_in_fp32("blocks.0.attention") and not in_force.runs_in_fp32("blocks.0")
    undone = {"type": "event", "kind": "intervention", "action": "undo", "after": {"fp32_modules": ["head"]}}
    resumed = {"type": "event", "kind": "resumed", "fp32_modules": [], "min_scale": 0.25}
    assert in_force_after([undone, resumed], in_force) == InForce("bfloat16", (), 0.25)
    assert in_force_after([{"type": "end", "dtype": "float32"}], in_force).dtype == "float32"


def test_fp32_modules_and_the_floor_are_shown_live_in_the_replay_the_report_and_the_exports(mlp_script, tmp_path):
    run_dir = tmp_path / "run"
    run = train_run(mlp_script, run_dir, steps=6, dtype="float16", probe_every=1, device="cpu", control=False,
                    at=["3:fp32=0"], guard=GuardConfig(min_scale=0.5))
    live = RunBuffer("live")
    run.observers.append(live.feed)
    assert run.run() == 0

    snap = live.snapshot()
    assert snap.in_force == InForce("float16", ("0",), 0.5)
    # The layer table: "0" runs in fp32, its headroom to fp32's max (~128 bits); "2" to fp16's (~16).
    rows = {row.name: row for row in layer_rows(snap.layers, current_precision(snap), snap.in_force)}
    assert rows["0"].fp32 and rows["0"].headroom > 100
    assert not rows["2"].fp32 and rows["2"].headroom < 60
    status = status_text(snap, current_precision(snap), pending=[], stopping=False, now=0.0).plain
    assert "fp32: 0" in status and "floor 0.5" in status

    # The replay derives the same, at each step it shows.
    replay = ReplaySource(run_dir, autoplay=False)
    replay.playback.end()
    assert replay.snapshot().in_force == snap.in_force
    replay.playback.seek(1)
    assert replay.snapshot().in_force == InForce("float16", (), 0.5)

    summary = summarize(read_digest(run_dir))
    assert (summary.fp32_modules, summary.scale_floor, summary.min_scale) == (["0"], 0.5, 0.5)
    lines = dict(summary_lines(summary))
    assert lines["fp32 modules"] == "0" and lines["scale floor"] == "0.5 (--min-scale)"

    steps_csv, layers_csv = tmp_path / "steps.csv", tmp_path / "layers.csv"
    assert main(["export", str(run_dir), "--csv", str(steps_csv), "--layers-csv", str(layers_csv)]) == 0
    steps = list(csv.DictReader(steps_csv.open()))
    assert [r["fp32_modules"] for r in steps] == ["", "", "", "0", "0", "0"]
    assert {r["scale_floor"] for r in steps} == {"0.5"}
    layers = [r for r in csv.DictReader(layers_csv.open()) if r["layer"] == "0"]
    assert [r["fp32"] for r in layers] == ["False"] * 3 + ["True"] * 3
    assert float(layers[-1]["headroom_bits"]) > 100 > float(layers[0]["headroom_bits"])
    # The plot's headroom map: one column a step, layer "0" to fp32's max from step 3 on.
    with SessionIndex(run_dir) as index:
        heat = plot_data(index).heat
    assert (heat[0, :3] < 100).all() and (heat[0, 3:] > 100).all()


def test_report_json_says_what_the_run_trained_with(mlp_script, tmp_path, capsys):
    run = train_run(mlp_script, tmp_path / "run", steps=2, device="cpu", control=False, at=["1:fp32=2"])
    assert run.run() == 0
    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (said["fp32_modules"], said["scale_floor"], said["min_scale"]) == (["2"], 2.0 ** -24, None)


def test_the_layer_table_marks_a_row_that_runs_in_fp32():
    from amp_tui.sources.protocol import LayerView
    from amp_tui.ui.view import Precision
    from amp_tui.ui.widgets.layer_table import FP32_MARK, _cells

    layers = LayerView(["blocks.0.attn.q", "blocks.0.mlp"], [300.0, 300.0], [None, None], [1.0, 1.0], 5, "float16")
    rows = layer_rows(layers, Precision("float16", None), InForce("float16", ("blocks.0.attn",)))
    names = [row.name for row in rows]
    marked = ["".join(text for text, _style in _cells(row, names)[1]) for row in rows]
    assert marked == ["blocks.0.attn.q" + FP32_MARK, "blocks.0.mlp"]
    assert rows[0].headroom > 100 and rows[1].headroom < 8   # fp32's max, and fp16's (65504 / 300)
