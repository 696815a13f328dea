"""A run in fp8, replayed: the layer table marks each fp8 layer and shows its casts' amax (input,
weight, output gradient) and log2 of their scales; a bf16 run's table has no fp8 column."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torchao")

from amp_tui.cli import main  # noqa: E402
from amp_tui.recording.reader import read_session  # noqa: E402
from amp_tui.sources.replay import ReplaySource  # noqa: E402
from amp_tui.ui.app import create_app  # noqa: E402

from support import DEMOS, SIZE, build_live, run_async, toasts, until  # noqa: E402


def recorded(run_dir, dtype):
    assert main(["train", str(DEMOS / "fp8_outliers.py"), "--headless", "--steps", "3", "--probe-every", "1",
                 "--dtype", dtype, "--run-dir", str(run_dir)]) == 0
    return run_dir


def rows_by_name(table):
    rows = [table.row_text(i).plain for i in range(len(table._ordered))]
    return {row.split()[1]: row for row in rows}


@run_async
async def test_the_fp8_layers_their_amax_and_scales(tmp_path):
    run_dir = recorded(tmp_path / "fp8", "fp8")
    last = read_session(run_dir).steps[-1]
    names = read_session(run_dir).header["layers"]
    amax = dict(zip(names, last["layers"]["fp8"]))
    app = create_app(ReplaySource(run_dir, autoplay=False))
    async with app.run_test(size=(200, 40)) as pilot:
        table = app.dashboard.layer_table
        await pilot.press("end")
        await until(pilot, lambda: any(" fp8 " in table.row_text(i).plain for i in range(len(table._ordered))),
                    "the fp8 rows")
        header = table.render_line(0).text
        assert "fp8 amax in/w/go · log2 scale" in header
        # The headroom is to bf16's max: the rest of the model runs in it.
        assert "bits to bf16 max (fp8 rows: outputs in bf16, inputs scaled to fit)" in str(table.border_title)
        rows = rows_by_name(table)
        fc1 = rows["blocks.0.fc1"]
        assert " fp8 " in fc1
        # The input's amax, and its scale's log2: e4m3's 448 over it.
        inp = amax["blocks.0.fc1"][0]
        assert f"{math.log2(448 / inp):.1f}" in fc1.split("·")[-1]
        assert "fp8" not in rows["blocks.2.fc2"].split("blocks.2.fc2")[1]   # kept in bf16
        await pilot.press("q")


@run_async
async def test_a_bf16_run_has_no_fp8_column(tmp_path):
    run_dir = recorded(tmp_path / "bf16", "bf16")
    app = create_app(ReplaySource(run_dir, autoplay=False))
    async with app.run_test(size=SIZE) as pilot:
        table = app.dashboard.layer_table
        await pilot.press("end")
        await until(pilot, lambda: bool(table._ordered) and table._ordered[0].act is not None, "the figures")
        assert "fp8" not in table.render_line(0).text
        await pilot.press("q")


@run_async
async def test_entering_fp8_says_so_in_a_toast_not_a_dialog_nobody_asked_for(tmp_path):
    run, source = build_live(DEMOS / "fp8_outliers.py", tmp_path / "live", at=["2:pause"], dtype="float8")
    app = create_app(source)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await until(pilot, lambda: source.snapshot().state == "paused", "the pause")
            await until(pilot, lambda: "9 of 10 Linear layers train in fp8" in toasts(app), "the fp8 toast")
            assert "fp8 what-if of step 0" in toasts(app)
            assert app.screen is app.dashboard
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, "the app to exit")
    finally:
        source.stop(5.0)
