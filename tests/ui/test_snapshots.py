"""Snapshot tests of the dashboard (pytest-textual-snapshot).

Every picture comes from a FixedSource fed with a synthetic run and a frozen clock: no training
thread, no wall time, so the SVGs are byte-for-byte stable. Update them after an intended change
with `pytest tests/ui/test_snapshots.py --snapshot-update` and look at the report.

`python tests/ui/test_snapshots.py` writes the same scenes to docs/images/ for docs/dashboard.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from amp_tui.training.checkpoint import CheckpointInfo
from amp_tui.ui.app import create_app

from fixed_source import SYNTHETIC_START, SYNTHETIC_STEP_S, FixedSource, synthetic_records
from support import REPO

STEPS = 400
FROZEN_NOW = SYNTHETIC_START + STEPS * SYNTHETIC_STEP_S   # "now" is when the last step ended
RUN_DIR = Path("runs/20260101-120000-gpt_tiny")
CHECKPOINTS = [
    CheckpointInfo(RUN_DIR / "checkpoints" / f"step-{step:07d}.safetensors", step, "float16", "full",
                   0.0)
    for step in (400, 300, 200, 100)
]


def dashboard(ending: str = "running", **source_options):
    source = FixedSource(synthetic_records(STEPS, ending=ending), checkpoints=CHECKPOINTS,
                         run_dir=RUN_DIR, session_path=RUN_DIR / "session.jsonl", **source_options)
    return create_app(source, clock=lambda: FROZEN_NOW)


# scene name -> (app factory, keys to press, terminal size)
SCENES = {
    "running": (lambda: dashboard(), (), (120, 40)),
    "running_80x24": (lambda: dashboard(), (), (80, 24)),
    "nonfinite_pause": (lambda: dashboard("nonfinite"), (), (120, 40)),
    "script_error": (lambda: dashboard("error"), (), (120, 40)),
    "restore_picker": (lambda: dashboard(), ("r",), (120, 40)),
    "terminal_too_small": (lambda: dashboard(), (), (70, 20)),
}


# The scenes docs/dashboard.md shows.
DOCS_SCENES = ("running", "running_80x24", "nonfinite_pause", "script_error", "restore_picker",
               "terminal_too_small")


async def settled(pilot) -> None:
    """Let the layout, the logs' deferred writes and their scroll to the end finish before the
    picture: on a loaded machine the event log could be caught mid-scroll."""
    for _ in range(3):
        await pilot.pause()
        await pilot.wait_for_scheduled_animations()


def check(snap_compare, scene: str) -> None:
    factory, press, size = SCENES[scene]
    assert snap_compare(factory(), press=press, terminal_size=size, run_before=settled)


def test_running(snap_compare):
    check(snap_compare, "running")


def test_running_80x24(snap_compare):
    check(snap_compare, "running_80x24")


def test_nonfinite_pause(snap_compare):
    check(snap_compare, "nonfinite_pause")


def test_script_error(snap_compare):
    check(snap_compare, "script_error")


def test_restore_picker(snap_compare):
    check(snap_compare, "restore_picker")


def test_terminal_too_small(snap_compare):
    check(snap_compare, "terminal_too_small")


def write_docs_images(folder: Path) -> None:
    """The snapshot scenes as SVG screenshots for the documentation (Textual's own export)."""
    import asyncio

    async def shoot(scene: str) -> None:
        factory, press, size = SCENES[scene]
        app = factory()
        async with app.run_test(size=size, notifications=True) as pilot:
            await pilot.pause()
            await pilot.press(*press)
            await pilot.pause(0.2)
            app.save_screenshot(f"{scene}.svg", path=str(folder))
        print(f"wrote {folder / scene}.svg")

    folder.mkdir(parents=True, exist_ok=True)
    for scene in DOCS_SCENES:
        asyncio.run(shoot(scene))


if __name__ == "__main__":
    write_docs_images(Path(sys.argv[1]) if len(sys.argv) > 1 else
                      REPO / "docs" / "images")
