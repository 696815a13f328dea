"""Toasts never hide the state: they sit over the charts, never over the status bar, the pause
notice, the layer table or the events panel, and a burst of them (an alert every step, a key
pressed again and again) gives a few toasts at most, one per kind, counting the rest."""

import time

import pytest
from textual.widgets._toast import Toast, ToastRack

from amp_tui.core.commands import Outcome
from amp_tui.ui.app import create_app
from amp_tui.ui.toasts import MAX_TOASTS, ToastShelf, box_id

from fixed_source import FixedSource, synthetic_records
from support import run_async

ALERTS = 10


def alert(step: int, n: int) -> dict:
    return {"type": "event", "step": step, "kind": "alert", "time": 0.0, "reason": "scale_below_one",
            "message": f"alert {n}: the loss scale fell below 1 and keeps falling; GradScaler skips every "
                       "update. Fix: --init-scale 2048"}


async def settled_toasts(pilot, app, timeout: float = 15.0) -> list[Toast]:
    """The toasts once they stopped moving: the same toasts at the same places three looks in a row."""
    deadline = time.monotonic() + timeout
    seen, same = None, 0
    while same < 3:
        assert time.monotonic() < deadline, "the toasts never settled"
        await pilot.pause(0.05)
        now = [(id(t), t.region) for t in app.screen.query(Toast)]
        same = same + 1 if now == seen else 0
        seen = now
    return list(app.screen.query(Toast))


def covered(app, toasts: list[Toast]) -> list[str]:
    """The widgets that must stay in sight that a toast covers."""
    screen = app.dashboard
    keep = {"status bar": screen.status_bar, "pause notice": screen.pause_notice,
            "layer table": screen.layer_table, "events panel": screen.event_log}
    return [f"{name} under {toast.render().plain.splitlines()[0]!r}" for toast in toasts
            for name, widget in keep.items()
            if widget.region.area and toast.region.overlaps(widget.region)]


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
@pytest.mark.parametrize("ending", ["running", "nonfinite"])
@run_async
async def test_alerts_in_a_row_give_one_toast_that_covers_nothing_essential(size, ending):
    records = synthetic_records(100, ending=ending)
    source = FixedSource(records, answer=Outcome(True, "loss scale 4096 → 2048"))
    app = create_app(source)
    async with app.run_test(size=size, notifications=True) as pilot:
        await pilot.pause()
        await pilot.press("s")                        # a command's answer: a toast of its own
        for n in range(ALERTS):
            source.buffer.feed(alert(99, n))
            app.refresh_view()
            await pilot.pause()
        toasts = await settled_toasts(pilot, app)
        assert 1 <= len(toasts) <= MAX_TOASTS, [t.render().plain for t in toasts]
        titles = [t.render().plain.splitlines()[0] for t in toasts]
        assert sum(title.startswith("alert at step") for title in titles) == 1, titles
        assert f"alert at step 99 (latest of {ALERTS})" in titles, titles
        assert f"alert {ALERTS - 1}:" in "\n".join(t.render().plain for t in toasts)
        assert not covered(app, toasts)
        if ending == "nonfinite":
            assert app.dashboard.pause_notice.region.area, "the pause notice is up"


@run_async
async def test_a_key_pressed_again_and_again_keeps_one_toast():
    source = FixedSource(synthetic_records(100), answer=Outcome(True, "checkpoint saved: c.safetensors"))
    app = create_app(source)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await pilot.pause()
        for _ in range(6):
            await pilot.press("c")
        toasts = await settled_toasts(pilot, app)
        assert [t.render().plain.splitlines()[0] for t in toasts] == ["checkpoint (latest of 6)"]
        assert not covered(app, toasts)


@run_async
async def test_toasts_of_many_kinds_keep_to_the_room_over_the_charts():
    source = FixedSource(synthetic_records(100))
    app = create_app(source)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await pilot.pause()
        for n in range(6):
            app.notify(f"message {n} " * 12, title=f"kind {n}")
        toasts = await settled_toasts(pilot, app)
        assert toasts and not covered(app, toasts)
        assert "kind 5" in toasts[-1].render().plain, "the newest stays"
        charts = app.dashboard.chart_row.region
        assert all(t.region.bottom <= charts.bottom for t in toasts)


def test_the_shelf_counts_a_kind_while_it_is_shown_and_keeps_a_few():
    shelf = ToastShelf(limit=2)
    first, gone = shelf.add(("alert", "warning"), "a", "alert at step 1", "warning", 60, False)
    assert gone == [] and first.title == "alert at step 1"
    second, gone = shelf.add(("alert", "warning"), "b", "alert at step 2", "warning", 60, False)
    assert gone == [first] and second.title == "alert at step 2 (latest of 2)"
    other, gone = shelf.add(("dtype", "information"), "c", "dtype", "information", 60, False)
    assert gone == []
    third, gone = shelf.add(("scale", "information"), "d", "loss scale", "information", 60, False)
    assert gone == [second], "past the limit the oldest goes"
    assert shelf.give_way() is other and shelf.give_way() is None, "the newest always stays"
    # out of room, the least severe of the older ones gives way first, the oldest of them first
    shelf = ToastShelf(limit=4)
    answer, _ = shelf.add(("dtype", "information"), "g", "dtype", "information", 60, False)
    error, _ = shelf.add(("the script raised", "error"), "h", "the script raised", "error", 60, False)
    warning, _ = shelf.add(("alert", "warning"), "i", "alert at step 3", "warning", 60, False)
    newest, _ = shelf.add(("scale", "information"), "j", "loss scale", "information", 60, False)
    assert [shelf.give_way() for _ in range(4)] == [answer, warning, error, None]
    # a kind whose toast is gone starts counting again
    expired, _ = shelf.add(("note", "information"), "e", "note", "information", 0, False)
    again, gone = shelf.add(("note", "information"), "f", "note", "information", 60, False)
    assert gone == [expired] and again.title == "note"


def test_the_room_counts_the_toasts_on_the_shelf_only():
    """A toast taken off a moment ago may still be laid out: it must not push out another."""
    shelf = ToastShelf()
    gone, _ = shelf.add(("alert", "warning"), "a", "alert at step 1", "warning", 60, False)
    alert, _ = shelf.add(("alert", "warning"), "b", "alert at step 2", "warning", 60, False)
    answer, _ = shelf.add(("dtype", "information"), "c", "dtype", "information", 60, False)
    heights = {box_id(gone): 6, box_id(alert): 6, box_id(answer): 4}
    assert not shelf.outgrows(heights, room=10)
    assert shelf.outgrows(heights, room=9)
    alone = ToastShelf()
    only, _ = alone.add(("dtype", "information"), "d", "dtype", "information", 60, False)
    assert not alone.outgrows({box_id(only): 40}, room=9), "one toast alone stays, clipped"


@pytest.mark.parametrize("key", ["question_mark", "r"])
@run_async
async def test_toasts_over_a_dialog_keep_off_the_layer_table_and_the_events(key):
    """A dialog (the help, the restore picker) has a toast rack of its own, at the bottom right
    unless placed: the toasts shown while it is open went over the layer table and the events."""
    source = FixedSource(synthetic_records(100), answer=Outcome(True, "checkpoint saved: c.safetensors"))
    app = create_app(source)
    async with app.run_test(size=(160, 48), notifications=True) as pilot:
        await pilot.pause()
        await pilot.press("c")
        await pilot.press(key)
        await pilot.pause()
        assert app.screen is not app.dashboard, "the dialog is open"
        app.notify("an alert while the dialog is open", title="alert at step 99")
        toasts = await settled_toasts(pilot, app)
        assert toasts and not covered(app, toasts)
        # the dashboard's own copies, under the dialog's, are hidden until it closes
        assert app.dashboard.query_one(ToastRack).display is False
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.dashboard and app.dashboard.query_one(ToastRack).display
