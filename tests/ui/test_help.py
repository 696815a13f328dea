"""`?`: the help lists the keys that work in the mode at hand, and only those, and explains every
column of the layer table."""

import pytest
from rich.console import Console

from amp_tui.ui.actions import KEY_ACTIONS, key_label
from amp_tui.ui.app import create_app
from amp_tui.ui.screens.help_screen import HelpScreen, help_text
from amp_tui.ui.widgets.layer_table import COLUMNS

from fixed_source import FixedSource, synthetic_records
from support import SIZE, run_async

REPLAY_ONLY = {"+", "-", "←", "→", "[", "]", "home", "end", "g"}
STEERING = {"d", "s", "S", "c", "r", "n", "m", "p", "u", "x"}   # they steer a run: not a recording's
JOB_ONLY = {"Q", "o"}


def listed_keys(mode: str) -> set[str]:
    return {str(cell) for cell in help_text(mode=mode).columns[0]._cells} - {""}


def plain(mode: str) -> str:
    console = Console(width=96, record=True)
    console.print(help_text(mode=mode))
    return console.export_text()


@pytest.mark.parametrize("mode", ["live", "attached", "launched"])
def test_the_help_of_a_run_lists_no_replay_key(mode):
    listed = listed_keys(mode)
    assert not listed & REPLAY_ONLY, listed & REPLAY_ONLY
    assert STEERING - {"m"} <= listed or mode != "live"
    assert {"d", "space", "?", "q"} <= listed
    assert (JOB_ONLY <= listed) == (mode != "live")
    assert "replays only" not in plain(mode)


def test_the_help_of_a_replay_lists_no_key_that_steers_a_run():
    listed = listed_keys("replay")
    assert not listed & (STEERING | JOB_ONLY), listed & (STEERING | JOB_ONLY)
    assert REPLAY_ONLY | {"space", "f", "?", "q"} <= listed
    assert "live or attached runs only" not in plain("replay")


@pytest.mark.parametrize("mode", ["live", "attached", "launched", "replay"])
def test_every_key_listed_works_in_that_mode(mode):
    listed = listed_keys(mode)
    for action in KEY_ACTIONS:
        if key_label(action) in listed:
            assert mode in action.modes, (mode, action.key)


@pytest.mark.parametrize("mode", ["live", "replay"])
def test_the_help_explains_every_column_of_the_layer_table(mode):
    listed = listed_keys(mode)
    text = plain(mode)
    for column in COLUMNS:
        assert column.label in listed, column.label
        assert column.help and " ".join(column.help.split()[:4]) in " ".join(text.split()), column.label
    assert "forecast" in COLUMNS[[c.key for c in COLUMNS].index("eta")].help


@run_async
async def test_question_mark_shows_the_help_of_the_mode_at_hand():
    source = FixedSource(synthetic_records(20, ending="finished"), mode="replay")
    app = create_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen) and app.screen.mode == "replay"
        await pilot.press("escape")
        assert app.screen is app.dashboard
