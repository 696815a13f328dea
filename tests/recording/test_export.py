"""`amp-tui export` and `train --tensorboard`: what TensorBoard and pandas read back is the session.

The event files are read with tensorboard's own EventAccumulator, the CSVs with a bare
`pandas.read_csv(path)`; each value is compared with the session's line, read with a strict JSON
parser. The expected headroom is the dashboard's (amp_tui.ui.view.layer_rows), a separate
implementation from the exporters'.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pandas as pd
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from amp_tui.cli import main
from amp_tui.core.jsonsafe import read_float
from amp_tui.recording.csv_export import LayersCsv
from amp_tui.recording.export import export
from amp_tui.recording.extras import MissingExtra
from amp_tui.recording.figures import layer_figures
from amp_tui.recording.tensorboard import LAYER_TAGS, EventFile, TensorBoardObserver, layer_tag
from amp_tui.sources.protocol import LayerView
from amp_tui.ui.view import Precision, layer_rows

from support import DEMOS, strict_lines, write_run

FIGURE_TAGS = dict(zip(("act", "grad", "weight"), LAYER_TAGS))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A recorded demo: fp16 steps whose loss is NaN (an activation overflows; their gradients
    are not measured), then bf16 steps with a finite loss (`--at 3:dtype=bf16`)."""
    run_dir = tmp_path_factory.mktemp("export") / "activation_overflow"
    assert main(["train", str(DEMOS / "activation_overflow.py"), "--headless", "--steps", "6",
                 "--device", "cpu", "--run-dir", str(run_dir), "--at", "3:dtype=bf16"]) == 0
    return run_dir


def session(run_dir):
    lines = strict_lines(run_dir / "session.jsonl")
    return (lines[0], [r for r in lines if r["type"] == "step"], [r for r in lines if r["type"] == "event"])


def accumulator(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def same(recorded: float, read_back: float) -> bool:
    """A float32 TensorBoard value against the session's float: equal, NaN included."""
    want = np.float32(recorded)
    return bool(np.isnan(want) and np.isnan(read_back)) or bool(want == np.float32(read_back))


def expected_headroom(header: dict, record: dict) -> list[float | None]:
    names = header["layers"]
    figures = {k: [read_float(v) for v in record["layers"][k]] for k in ("act", "grad", "weight")}
    view = LayerView(names, figures["act"], figures["grad"], figures["weight"], record["step"], record["dtype"])
    return [row.headroom for row in layer_rows(view, Precision(record["dtype"], read_float(record["scale"])))]


def test_the_demo_has_what_the_comparisons_need(demo_run):
    _header, steps, events = session(demo_run)
    assert any(s["loss"] == "NaN" for s in steps) and any(isinstance(s["loss"], float) for s in steps)
    assert any(None in s["layers"]["grad"] for s in steps)                # not measured
    assert any("Infinity" in s["layers"]["act"] for s in steps)            # non-finite
    assert {s["dtype"] for s in steps} == {"float16", "bfloat16"}
    assert any(e["kind"] == "nonfinite" for e in events) and any(e["kind"] == "intervention" for e in events)


def test_tensorboard_scalars_are_the_sessions_including_a_nonfinite_loss(demo_run, tmp_path):
    result = export(demo_run, tensorboard=tmp_path / "tb")
    header, steps, events = session(demo_run)
    assert result.steps == len(steps) and result.ended
    acc = accumulator(tmp_path / "tb")

    loss = scalars(acc, "train/loss")
    assert sorted(loss) == [s["step"] for s in steps]
    assert any(math.isnan(v) for v in loss.values())          # the NaN loss is there, at its step
    for s in steps:
        assert same(read_float(s["loss"]), loss[s["step"]]), s["step"]
    for tag, key in (("amp/skipped_total", "skipped_total"), ("amp/updates_applied", "updates"),
                     ("train/lr", "lr")):
        values = scalars(acc, tag)
        assert {s["step"]: np.float32(s[key]) for s in steps} == values, tag
    assert scalars(acc, "amp/skipped") == {s["step"]: float(s["skipped"]) for s in steps}
    log2_scale = scalars(acc, "amp/loss_scale_log2")
    assert log2_scale == {s["step"]: np.float32(math.log2(s["scale"])) for s in steps if s["scale"] is not None}
    assert len(log2_scale) < len(steps)                        # bf16 steps run without a scaler

    for s in steps:
        headroom = expected_headroom(header, s)
        for i, name in enumerate(header["layers"]):
            for figure, tag in FIGURE_TAGS.items():
                value = read_float(s["layers"][figure][i])
                written = scalars(acc, layer_tag(name, tag)) if layer_tag(name, tag) in acc.Tags()["scalars"] else {}
                if value is None:
                    assert s["step"] not in written          # not measured: nothing written
                else:
                    assert same(value, written[s["step"]]), (s["step"], name, figure)
            bits = scalars(acc, layer_tag(name, "headroom_bits"))
            assert same(headroom[i], bits[s["step"]]), (s["step"], name)
    grad_norm = scalars(acc, "train/grad_norm")               # only where the step recorded one
    assert grad_norm == {s["step"]: np.float32(s["grad_norm"]) for s in steps if "grad_norm" in s} != {}

    texts = acc.Tags()["tensors"]
    for kind in ("nonfinite", "intervention"):
        recorded = [e for e in events if e["kind"] == kind]
        written = acc.Tensors(f"events/{kind}")
        assert [t.step for t in written] == [e["step"] for e in recorded]
        first = written[0].tensor_proto.string_val[0].decode()
        assert recorded[0]["message"].split(";")[0].replace("(", "").split()[0] in first
    assert "run/header" in texts


def test_train_tensorboard_writes_live_what_export_writes(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", str(DEMOS / "loss_scale_overflow.py"), "--headless", "--steps", "14", "--device", "cpu",
                 "--run-dir", str(run_dir), "--tensorboard", str(tmp_path / "live")]) == 0
    export(run_dir, tensorboard=tmp_path / "exported")
    live, exported = accumulator(tmp_path / "live"), accumulator(tmp_path / "exported")
    tags = live.Tags()["scalars"]
    assert tags == exported.Tags()["scalars"] and "amp/loss_scale_log2" in tags
    _header, steps, _events = session(run_dir)
    for tag in tags:
        a, b = (np.array([(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)]) for acc in (live, exported))
        assert np.array_equal(a, b, equal_nan=True), tag
    assert sorted(scalars(live, "train/loss")) == [s["step"] for s in steps]
    assert live.Tags()["tensors"] == exported.Tags()["tensors"]


def test_the_monitors_tensorboard_dir_writes_live_what_export_writes(tmp_path):
    import torch
    from torch import nn

    import amp_tui
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    monitor = amp_tui.monitor(model, opt, scaler=scaler, run_dir=tmp_path / "run", announce=False,
                              tensorboard_dir=tmp_path / "live")
    for _ in range(6):
        with monitor.step() as step:
            with monitor.autocast():
                loss = model(torch.randn(8, 4)).pow(2).mean() * 1e4
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    monitor.close()
    export(tmp_path / "run", tensorboard=tmp_path / "exported")
    live, exported = accumulator(tmp_path / "live"), accumulator(tmp_path / "exported")
    assert live.Tags()["scalars"] == exported.Tags()["scalars"]
    for tag in live.Tags()["scalars"]:
        a, b = (np.array([(e.step, e.value) for e in acc.Scalars(tag)]) for acc in (live, exported))
        assert np.array_equal(a, b, equal_nan=True), tag
    assert sorted(scalars(live, "train/loss")) == list(range(6))


def test_the_monitors_tensorboard_dir_without_its_package_names_the_extra(tmp_path, monkeypatch):
    import torch
    from torch import nn

    import amp_tui
    from amp_tui.job.monitor import MonitorError
    monkeypatch.setitem(sys.modules, "google_crc32c", None)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(MonitorError, match=r"tensorboard_dir=.*pip install 'amp-tui\[tensorboard\]'"):
        amp_tui.monitor(model, opt, run_dir=tmp_path / "run", announce=False, tensorboard_dir=tmp_path / "tb")
    assert not (tmp_path / "run").exists() and not (tmp_path / "tb").exists()
    # nothing of it is left holding the process: a monitor without it starts
    amp_tui.monitor(model, opt, run_dir=tmp_path / "run2", announce=False).close()


def test_train_tensorboard_without_its_package_fails_before_the_run(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    run_dir = tmp_path / "run"
    status = main(["train", str(DEMOS / "healthy.py"), "--headless", "--steps", "2", "--device", "cpu",
                   "--run-dir", str(run_dir), "--tensorboard", str(tmp_path / "tb")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and not run_dir.exists()
    assert len(err.splitlines()) == 1 and "pip install 'amp-tui[tensorboard]'" in err
    assert not (tmp_path / "tb").exists()


def test_export_without_tensorboard_names_the_extra(demo_run, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert main(["export", str(demo_run), "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs tensorboard" in err and "amp-tui[tensorboard]" in err


def test_export_without_google_crc32c_writes_the_same_files_slower_and_says_so(demo_run, tmp_path,
                                                                                monkeypatch, capsys):
    assert main(["export", str(demo_run), "--tensorboard", str(tmp_path / "fast")]) == 0
    assert "google_crc32c" not in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "google_crc32c", None)
    assert main(["export", str(demo_run), "--tensorboard", str(tmp_path / "slow")]) == 0
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and "google_crc32c is not installed" in err and "slower" in err
    assert "TensorBoard" in out and "exported" in out
    # tensorboard's reader checks every record's checksums: it reads back what the fast ones gave
    fast, slow = accumulator(tmp_path / "fast"), accumulator(tmp_path / "slow")
    assert fast.Tags() == slow.Tags() and fast.Tags()["scalars"]
    for tag in fast.Tags()["scalars"]:
        a, b = (np.array([(e.step, e.value) for e in acc.Scalars(tag)]) for acc in (fast, slow))
        assert np.array_equal(a, b, equal_nan=True), tag
    [fast_file], [slow_file] = (list((tmp_path / d).iterdir()) for d in ("fast", "slow"))
    assert records_checked(slow_file) == records_checked(fast_file) > 0


def records_checked(path) -> int:
    """The records of an event file, each one's checksums verified by tensorboard's own reader
    (a wrong one raises DataLossError)."""
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
    reader, count = PyRecordReader_New(str(path)), 0
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return count
        count += 1


def test_a_live_writer_still_needs_google_crc32c(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "google_crc32c", None)
    with pytest.raises(MissingExtra, match="google_crc32c"):
        TensorBoardObserver(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def test_observer_reports_a_refused_write_once_and_the_run_goes_on(demo_run, tmp_path, monkeypatch, capsys):
    observer = TensorBoardObserver(tmp_path / "tb")
    lines = strict_lines(demo_run / "session.jsonl")
    observer(lines[0])
    full = OSError(28, "No space left on device")

    def refuse(self, event):
        raise full
    monkeypatch.setattr(EventFile, "write", refuse)
    for record in lines[1:]:
        observer(record)                       # never raises: the training thread goes on
    err = capsys.readouterr().err
    assert err.count("TensorBoard logging stopped") == 1 and "No space left on device" in err
    assert observer.error is not None


def test_observer_follows_a_run_without_a_header_and_starts_a_new_file_after_the_end(demo_run, tmp_path):
    observer = TensorBoardObserver(tmp_path / "tb")
    lines = strict_lines(demo_run / "session.jsonl")
    for record in lines[1:]:                   # attached after the header went by
        observer(record)
    for record in lines:                       # a second run into the same directory
        observer(record)
    assert len(observer.writer.files) == 2
    acc = accumulator(tmp_path / "tb")
    assert any(tag.startswith("layer.0/") for tag in acc.Tags()["scalars"])       # named by position
    assert any(tag.startswith("layer.amplifier/") for tag in acc.Tags()["scalars"])


# ---- CSV ---------------------------------------------------------------------------------------

def test_steps_csv_reads_back_with_pandas_as_the_session(demo_run, tmp_path):
    export(demo_run, csv=tmp_path / "steps.csv")
    header, steps, _events = session(demo_run)
    table = pd.read_csv(tmp_path / "steps.csv")
    assert list(table["step"]) == [s["step"] for s in steps]
    assert table["skipped"].dtype == bool and list(table["skipped"]) == [s["skipped"] for s in steps]
    for column in ("loss", "scale", "next_scale", "lr", "time", "duration"):
        for got, s in zip(table[column], steps):
            want = read_float(s.get(column))
            assert (math.isnan(got) and (want is None or math.isnan(want))) or got == want, (column, s["step"])
    for column in ("skipped_total", "updates", "micro_batches"):
        assert list(table[column]) == [s[column] for s in steps]
    assert list(table["dtype"]) == [s["dtype"] for s in steps]
    assert list(table["nonfinite"].fillna("")) == [s.get("nonfinite", "") for s in steps]
    for row, s in zip(table.itertuples(), steps):
        headroom = expected_headroom(header, s)
        least = min(h for h in headroom if h is not None)
        assert row.min_headroom_bits == pytest.approx(least, rel=1e-3) or row.min_headroom_bits == least
        assert headroom[header["layers"].index(row.min_headroom_layer)] == least
    text = (tmp_path / "steps.csv").read_text()
    assert ",nan," in text and ",-inf," in text                      # the NaN loss, a non-finite layer


def test_layers_csv_reads_back_with_pandas_one_row_per_step_and_layer(demo_run, tmp_path):
    export(demo_run, layers_csv=tmp_path / "layers.csv")
    header, steps, _events = session(demo_run)
    names = header["layers"]
    table = pd.read_csv(tmp_path / "layers.csv")
    assert len(table) == len(steps) * len(names)
    assert list(table["layer"][:len(names)]) == names
    rows = iter(table.itertuples())
    for s in steps:
        headroom = expected_headroom(header, s)
        for i, name in enumerate(names):
            row = next(rows)
            assert (row.step, row.layer, row.dtype) == (s["step"], name, s["dtype"])
            for figure, column in (("act", row.max_abs_act), ("grad", row.max_abs_grad),
                                   ("weight", row.max_abs_weight)):
                want = read_float(s["layers"][figure][i])
                assert (want is None and math.isnan(column)) or column == want or \
                    (math.isnan(want) and math.isnan(column)), (s["step"], name, figure)
            want = headroom[i]
            assert (want is None and math.isnan(row.headroom_bits)) or row.headroom_bits == want or \
                row.headroom_bits == pytest.approx(want, rel=1e-3), (s["step"], name)
    text = (tmp_path / "layers.csv").read_text()
    assert ",inf," in text and ",nan," in text and ",-inf," in text


def test_layers_csv_copied_from_the_lines_equals_the_one_formatted_from_the_records(tmp_path):
    """The fast path (each figure copied from the line as written) and the parsed records give the
    same file, for a session with NaN, Infinity, null and unprobed steps."""
    from amp_tui.recording.index import SessionIndex
    from amp_tui.recording.stream import entries
    write_run(tmp_path / "session.jsonl")
    outputs = []
    for name, copy_lines in (("copied.csv", True), ("formatted.csv", False)):
        sink = LayersCsv(tmp_path / name)
        with SessionIndex(tmp_path) as index:
            for record, line in entries(index):
                sink.write(record, line if copy_lines else None)
        sink.finish()
        outputs.append((tmp_path / name).read_text())
    assert outputs[0] == outputs[1] and "nan" in outputs[0]


def test_a_torn_last_line_and_a_missing_end_are_exported_up_to_the_last_whole_record(tmp_path):
    write_run(tmp_path / "session.jsonl", end=False)
    path = tmp_path / "session.jsonl"
    with open(path, "ab") as fh:
        fh.write(b'{"type":"step","step":30,"loss":0.5,"sca')      # the writer died mid-line
    result = export(tmp_path, csv=tmp_path / "steps.csv", tensorboard=tmp_path / "tb")
    assert result.steps == 30 and not result.ended and "incomplete last line" in result.skipped
    assert list(pd.read_csv(tmp_path / "steps.csv")["step"]) == list(range(30))
    assert sorted(scalars(accumulator(tmp_path / "tb"), "train/loss")) == list(range(30))


def test_export_refuses_to_overwrite_the_session(demo_run, capsys):
    before = (demo_run / "session.jsonl").read_bytes()
    assert main(["export", str(demo_run), "--csv", str(demo_run / "session.jsonl")]) == 2
    assert (demo_run / "session.jsonl").read_bytes() == before
    assert "is the session being exported" in capsys.readouterr().err


def test_a_failed_csv_export_leaves_no_half_written_file(demo_run, tmp_path, monkeypatch):
    calls = []

    def fail_later(self, record, line=None):
        calls.append(record)
        if len(calls) == 4:
            raise OSError(28, "No space left on device")
        return original(self, record, line)
    original = LayersCsv.write
    monkeypatch.setattr(LayersCsv, "write", fail_later)
    out = tmp_path / "layers.csv"
    assert main(["export", str(demo_run), "--layers-csv", str(out)]) == 1
    assert not out.exists() and not list(tmp_path.iterdir())


def test_export_needs_an_output(demo_run, capsys):
    assert main(["export", str(demo_run)]) == 2
    assert "--tensorboard DIR" in capsys.readouterr().err


def test_headroom_of_the_exporters_is_the_dashboards(tmp_path):
    """Every probed step of a session with skips, a dtype switch and unmeasured figures."""
    write_run(tmp_path / "session.jsonl")
    lines = strict_lines(tmp_path / "session.jsonl")
    header = lines[0]
    for record in (r for r in lines if r["type"] == "step" and "layers" in r):
        got = layer_figures(record, len(header["layers"])).headroom
        want = expected_headroom(header, record)
        for g, w in zip(got.tolist(), want):
            assert (w is None and math.isnan(g)) or g == w or g == pytest.approx(w), record["step"]


def test_events_built_by_protobuf_when_the_fixed_summary_fails_its_check_are_the_same(demo_run, tmp_path,
                                                                                      monkeypatch):
    from amp_tui.recording.tensorboard import FixedSummary
    export(demo_run, tensorboard=tmp_path / "fixed")

    def fails(self, *args):
        raise ValueError("an event made from a FixedSummary does not read back as written")
    monkeypatch.setattr(FixedSummary, "check", fails)
    export(demo_run, tensorboard=tmp_path / "protobuf")
    fixed, built = accumulator(tmp_path / "fixed"), accumulator(tmp_path / "protobuf")
    assert fixed.Tags()["scalars"] == built.Tags()["scalars"]
    for tag in fixed.Tags()["scalars"]:
        a, b = (np.array([(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)]) for acc in (fixed, built))
        assert np.array_equal(a, b, equal_nan=True), tag


def two_rank_session(run_dir):
    """write_run's session as a job of 2 ranks records it: `world_size` in the header, and each
    rank's loss and step time on the steps that gathered them (the probed ones)."""
    import json
    write_run(run_dir / "session.jsonl")
    lines = []
    for line in (run_dir / "session.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "header":
            record["world_size"] = 2
            record["coordination"] = "gradients"
        elif record["type"] == "step" and "layers" in record:
            layers = record.pop("layers")
            step = record["step"]
            record["rank_loss"] = [record["loss"], "NaN" if step == 25 else 0.5 + step]
            record["rank_step_time"] = [0.01, 0.02 + step / 1000]
            record["layers"] = layers
        lines.append(json.dumps(record, separators=(",", ":")))
    (run_dir / "session.jsonl").write_text("\n".join(lines) + "\n")
    return [json.loads(line) for line in lines]


def test_a_run_of_several_ranks_exports_each_ranks_loss_and_step_time(tmp_path, capsys):
    records = two_rank_session(tmp_path)
    gathered = {r["step"]: r for r in records if r["type"] == "step" and "rank_loss" in r}
    assert 25 in gathered and 3 not in gathered
    export(tmp_path, csv=tmp_path / "steps.csv", tensorboard=tmp_path / "tb")
    table = pd.read_csv(tmp_path / "steps.csv")
    assert list(table.columns[-4:]) == ["rank_loss_0", "rank_loss_1", "rank_step_time_0", "rank_step_time_1"]
    for step, record in gathered.items():
        row = table[table.step == step].iloc[0]
        for rank in (0, 1):
            assert same(read_float(record["rank_loss"][rank]), row[f"rank_loss_{rank}"])
            assert same(record["rank_step_time"][rank], row[f"rank_step_time_{rank}"])
    assert math.isnan(table[table.step == 3].iloc[0]["rank_loss_1"])      # not gathered: empty
    acc = accumulator(tmp_path / "tb")
    for rank in (0, 1):
        losses = scalars(acc, f"ranks/{rank}/loss")
        times = scalars(acc, f"ranks/{rank}/step_time")
        assert sorted(times) == sorted(gathered)
        assert all(same(read_float(gathered[s]["rank_loss"][rank]), v) for s, v in losses.items())
    assert math.isnan(scalars(acc, "ranks/1/loss")[25])
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2, recorded by rank 0" in out and "ranks' words       in DDP's gradient all-reduce" in out


def test_a_one_process_run_exports_no_rank_columns(demo_run, tmp_path):
    export(demo_run, csv=tmp_path / "steps.csv")
    assert not [c for c in pd.read_csv(tmp_path / "steps.csv").columns if c.startswith("rank_")]


def test_the_report_says_where_the_ranks_words_went_round():
    from amp_tui.recording.report import _coordination_words
    assert _coordination_words("gradients") == "in DDP's gradient all-reduce"
    assert _coordination_words("collectives: its gradients are torch.bfloat16 (fp32 or fp64 carry the words)") == \
        "in collectives of their own: its gradients are torch.bfloat16 (fp32 or fp64 carry the words)"
