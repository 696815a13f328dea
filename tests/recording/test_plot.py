"""`amp-tui plot`: one PNG (or SVG) that shows what the run did, checked by its pixels.

Each figure is checked where its panels lie in the image (the plot reports their boxes): a blank
or one-colour figure, a panel left empty, a mark in the wrong place all fail. The columns and
points of a long run keep the extreme of their steps; a model with many layers shows its worst.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from amp_tui.cli import main
from amp_tui.recording.format import event_record, step_record
from amp_tui.recording.index import SessionIndex
from amp_tui.recording.plot import NONFINITE, SIZE_IN, SKIPPED, plot
from amp_tui.recording.plot_data import MAX_LAYERS, plot_data
from amp_tui.recording.writer import SessionWriter
from amp_tui.training.probes.layer_probes import LayerFigures
from amp_tui.training.step.engine import StepResult

from support import DEMOS, REPO, write_run

LOSS_LINE = "#1f77b4"
SCALE_LINE = "#ff7f0e"
PLENTY = (0, 104, 55)          # RdYlGn's top: 16 bits of headroom or more
HANG_S = 120


def record(tmp_path, demo: str, *flags: str, steps: int):
    run_dir = tmp_path / demo
    assert main(["train", str(DEMOS / f"{demo}.py"), "--headless", "--steps", str(steps), "--device", "cpu",
                 "--run-dir", str(run_dir), *flags]) == 0
    return run_dir


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def inside(image: np.ndarray, box) -> np.ndarray:
    left, top, right, bottom = box
    return image[top + 2:bottom - 2, left + 2:right - 2]


def rgb(colour) -> tuple[int, int, int]:
    if isinstance(colour, tuple):
        return colour
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def where(region: np.ndarray, colour, tolerance: int = 12) -> np.ndarray:
    """(row, column) of the pixels of `region` within `tolerance` of `colour`."""
    return np.argwhere(np.abs(region - np.array(rgb(colour))).max(axis=2) <= tolerance)


def colours(region: np.ndarray) -> int:
    return len(np.unique(region.reshape(-1, 3), axis=0))


def check_figure(result, path) -> np.ndarray:
    """The size, and a figure that isn't blank: many colours, each panel more than one."""
    image = pixels(path)
    assert result.size == (round(SIZE_IN[0] * 100), round(SIZE_IN[1] * 100))
    assert image.shape[:2] == (result.size[1], result.size[0])
    assert colours(image) > 50
    for name, box in result.panels.items():
        assert colours(inside(image, box)) > 2, f"the {name} panel is one colour"
    return image


def without_legend(region: np.ndarray) -> np.ndarray:
    """`region` with its top right corner (where the legend is) blanked."""
    out = region.copy()
    out[:region.shape[0] // 4, -region.shape[1] // 4:] = 255
    return out


def x_pixel(result, box, step: float) -> float:
    left, _top, right, _bottom = box
    data = result.data
    first, last = data.first_step, max(data.last_step + 1, data.first_step + 1)
    return left + (step - first) / (last - first) * (right - left)


def test_a_healthy_run(tmp_path):
    run_dir = record(tmp_path, "healthy", steps=10)
    result = plot(run_dir, tmp_path / "healthy.png")
    image = check_figure(result, tmp_path / "healthy.png")
    assert result.data.skipped == 0 and "10 steps" in result.data.title and "finished" in result.data.title
    loss, scale, heat = (inside(image, result.panels[n]) for n in ("loss", "scale", "heatmap"))
    assert len(where(loss, LOSS_LINE)) > 100 and not len(where(loss, SKIPPED))
    assert len(where(scale, SCALE_LINE)) > 50
    assert colours(heat) > 5 and not len(where(heat, NONFINITE, 6))


def test_a_skip_storm(tmp_path):
    run_dir = record(tmp_path, "loss_scale_overflow", steps=16)
    result = plot(run_dir, tmp_path / "storm.png")
    image = check_figure(result, tmp_path / "storm.png")
    assert result.data.skipped >= 5
    box = result.panels["loss"]
    loss, heat = inside(image, box), inside(image, result.panels["heatmap"])
    marks = where(loss[-loss.shape[0] // 8:], SKIPPED)          # along the bottom of the panel
    assert len(marks) > 20
    last = max(s for s in result.data.skipped_x)
    assert last == result.data.skipped - 1                      # the storm: steps 0, 1, 2...
    assert marks[:, 1].max() + box[0] + 2 <= x_pixel(result, box, last + 1)    # in the cells of those steps
    assert len(where(heat, NONFINITE, 6)) > 500


def test_a_dtype_switch(tmp_path):
    write_run(tmp_path / "session.jsonl")          # fp16, then bf16 from step 10 of 30
    result = plot(tmp_path, tmp_path / "switch.png")
    image = check_figure(result, tmp_path / "switch.png")
    assert "fp16 → bf16" in result.data.title
    assert [m.label for m in result.data.markers][:1] == ["dtype=bf16"]
    box = result.panels["scale"]
    switch = x_pixel(result, box, 10)
    line = where(without_legend(inside(image, box)), SCALE_LINE)
    assert len(line) > 20 and line[:, 1].max() + box[0] + 2 <= switch + 3     # no scale after the switch
    heat_box = result.panels["heatmap"]
    heat = inside(image, heat_box)
    after = int(x_pixel(result, heat_box, 20)) - heat_box[0] - 2
    before = int(x_pixel(result, heat_box, 6)) - heat_box[0] - 2
    column_after, column_before = heat[:, after], heat[:, before]
    assert len(where(column_after[:, None], PLENTY, 4)) > 0.9 * len(column_after)    # bf16: plenty
    assert len(where(column_before[:, None], PLENTY, 4)) < 0.5 * len(column_before)


def test_a_nonfinite_origin(tmp_path):
    run_dir = record(tmp_path, "activation_overflow", "--at", "3:dtype=bf16", steps=6)
    result = plot(run_dir, tmp_path / "origin.png")
    image = check_figure(result, tmp_path / "origin.png")
    data = result.data
    row = data.layer_names.index("amplifier")
    assert data.origin_rows == {row} and (0, row) in data.origins
    assert len(data.nonfinite_loss_x) == 3
    left, top, right, bottom = result.panels["heatmap"]
    row_top = top + (bottom - top) * row / len(data.layer_names)
    row_bottom = top + (bottom - top) * (row + 1) / len(data.layer_names)
    labels = image[int(row_top):int(row_bottom), :left]
    assert len(where(labels, NONFINITE, 30)) > 10                     # the origin's label, in colour
    other_labels = image[top:int(row_top), :left]
    assert not len(where(other_labels, NONFINITE, 30))
    cells = image[int(row_top):int(row_bottom), left:right]
    assert len(where(cells, "#000000", 40)) > 5                       # its marks, in its row


def test_an_empty_session(tmp_path, capsys):
    SessionWriter(tmp_path / "session.jsonl", {"script": "train.py", "layers": ["a", "b"],
                                               "dtype": "float16"}).close(None)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "empty.png")]) == 0
    image = pixels(tmp_path / "empty.png")
    result = plot(tmp_path, tmp_path / "empty.png")
    assert result.data.steps == 0 and "0 steps" in result.data.title
    assert "no end record" in result.data.title
    for box in result.panels.values():
        assert len(where(inside(image, box), "#666666", 40)) > 20      # "no steps recorded yet"
    assert "0 steps" in capsys.readouterr().out


def test_a_file_without_a_header_is_a_one_line_error(tmp_path, capsys):
    """Exit status 1, a session that can't be read, as every reader says it (2 is for the
    command line)."""
    (tmp_path / "session.jsonl").write_bytes(b"")
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is empty" in err and not (tmp_path / "x.png").exists()


def test_a_torn_session(tmp_path):
    write_run(tmp_path / "session.jsonl", end=False)
    with open(tmp_path / "session.jsonl", "ab") as fh:
        fh.write(b'{"type":"step","step":30,"loss":0.5,"sca')
    result = plot(tmp_path, tmp_path / "torn.png")
    check_figure(result, tmp_path / "torn.png")
    assert result.data.steps == 30 and "no end record" in result.data.title
    assert any("incomplete last line" in note for note in result.data.notes)


def test_svg_and_an_unknown_format(tmp_path, capsys):
    write_run(tmp_path / "session.jsonl")
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "run.svg")]) == 0
    assert b"<svg" in (tmp_path / "run.svg").read_bytes()[:2000]
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "run.jpg")]) == 2
    assert ".png or an .svg" in capsys.readouterr().err and not (tmp_path / "run.jpg").exists()


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    write_run(tmp_path / "session.jsonl")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'amp-tui[plot]'" in err


def test_plot_draws_without_a_display_whatever_backend_is_set(tmp_path):
    write_run(tmp_path / "session.jsonl")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env["MPLBACKEND"] = "TkAgg"          # a display backend: the plot must not use it
    code = ("import sys; from amp_tui.cli import main; status = main(sys.argv[1:]); "
            "print('PYPLOT' if 'matplotlib.pyplot' in sys.modules else 'NO-PYPLOT'); sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, "plot", str(tmp_path), "-o", str(tmp_path / "p.png")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "NO-PYPLOT" and (tmp_path / "p.png").stat().st_size > 10_000


# ---- long runs, many layers ---------------------------------------------------------------------

def synthetic(path, steps: int, layers: int, *, bad_step=None, spike_step=None, origin=None, quiet=None):
    """A session of `steps` fp16 steps: layer i has max |act| 2**i (so less headroom the deeper it
    is) except `quiet`, which stays tiny; at `bad_step` layer 1's activation is inf, the update
    is skipped and a nonfinite event names `origin`; at `spike_step` the loss is 1e6."""
    names = [f"layer{i}" for i in range(layers)]
    writer = SessionWriter(path, {"script": "synthetic.py", "layers": names, "dtype": "float16"},
                           flush_interval=60)
    skipped_total = 0
    for step in range(steps):
        act = [0.5 if i == quiet else 2.0 ** min(i, 14) for i in range(layers)]
        bad = step == bad_step
        if bad:
            act[1] = math.inf
        skipped_total += bad
        figures = LayerFigures(act=act, grad=[1e-6] * layers, weight=[0.5] * layers)
        loss = 1e6 if step == spike_step else 1.0 + 1.0 / (step + 1)
        writer.write(step_record(StepResult(
            step=step, loss=loss, scale=1024.0, skipped=bad, skipped_total=skipped_total,
            updates_applied=step + 1 - skipped_total, dtype="float16", micro_batches=1,
            nonfinite="loss" if bad else None, figures=figures, duration=0.01, wall_time=1000.0 + step)))
        if bad:
            writer.write(event_record(step, "nonfinite", "non-finite loss", where="loss", layer=names[1],
                                      origin=origin or names[1]))
    writer.close({"step": steps, "status": "finished", "updates": steps - skipped_total,
                  "skipped_total": skipped_total, "dtype": "float16", "scale": 1024.0})


def test_a_long_run_keeps_a_single_bad_step_and_a_single_spike(tmp_path):
    """Folded into 50 columns and 100 points, one non-finite step and one loss spike among 2,000
    steps stay visible: each column keeps the worst of its steps (sampling would drop them)."""
    synthetic(tmp_path / "session.jsonl", 2000, 3, bad_step=1237, spike_step=733)
    with SessionIndex(tmp_path) as index:
        data = plot_data(index, columns=50, line_points=100)
    assert data.heat.shape == (3, 50)
    column = int(np.searchsorted(data.heat_edges, 1237, side="right")) - 1
    assert np.isneginf(data.heat[1, column]) and np.isfinite(data.heat[1]).sum() == 49
    assert len(data.loss.x) == 100 and data.loss.high.max() == 1e6
    assert list(data.skipped_x) == [1237] and list(data.nonfinite_loss_x) == [1237]
    assert data.skipped == 1 and data.origins == [(1237, 1)]


def test_many_layers_fold_to_the_worst_with_the_origin_kept(tmp_path):
    layers = 200
    synthetic(tmp_path / "session.jsonl", 6, layers, bad_step=3, origin="layer7", quiet=7)
    result = plot(tmp_path, tmp_path / "wide.png")
    check_figure(result, tmp_path / "wide.png")
    data = result.data
    assert len(data.layer_names) == MAX_LAYERS and data.layers_total == layers and data.folded
    assert any(f"{MAX_LAYERS} of {layers} layers" in note for note in data.notes)
    # layer7 (tiny activations, plenty of headroom) is shown only because a non-finite step started
    # there; layer1 because it went non-finite; the rest are the deepest (least headroom).
    assert {"layer1", "layer7"} <= set(data.layer_names)
    assert data.origin_rows == {data.layer_names.index("layer7")}
    rest = [n for n in data.layer_names if n not in ("layer1", "layer7")]
    assert all(int(n[5:]) >= 14 for n in rest)
    assert data.layer_names == sorted(data.layer_names, key=lambda n: int(n[5:]))     # model order


def test_a_single_nonfinite_step_among_many_stays_visible(tmp_path):
    """20,000 steps in 4,000 columns, four to a pixel: the one non-finite step is still drawn."""
    synthetic(tmp_path / "session.jsonl", 20_000, 3, bad_step=12_345)
    result = plot(tmp_path, tmp_path / "long.png", columns=4000)
    image = check_figure(result, tmp_path / "long.png")
    box = result.panels["heatmap"]
    bad = where(inside(image, box), NONFINITE, 6)
    assert len(bad) > 10
    x = bad[:, 1] + box[0] + 2
    assert abs(x.mean() - x_pixel(result, box, 12_345)) < 4


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch, suffix):
    write_run(tmp_path / "session.jsonl")
    from matplotlib.figure import Figure

    def full(self, fname, **kwargs):
        with open(fname, "wb") as fh:              # a part of the image, then the disk is full
            fh.write(b"\x89PNG\r\n" if suffix == ".png" else b"<?xml")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", full)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / f"out{suffix}")]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.jsonl"]
