"""Our collectives' tensors are held until the process group's threads let go of them
(job/ranks/in_flight.py): a tensor gloo still holds in a work is never freed on gloo's thread, and
settle() returns once nothing but ours holds any of them. Another holder is simulated here by a
view (it holds its base, as a work holds its tensors), let go of by another thread."""

from __future__ import annotations

import threading

import torch

from amp_tui.job.ranks.in_flight import InFlight


def test_a_tensor_still_held_elsewhere_is_kept_and_one_let_go_of_is_dropped():
    in_flight = InFlight()
    done, busy = torch.ones(3), torch.ones(3)
    work = busy.view(3)   # what a collective's work holds
    in_flight.hold(done, busy)
    del done
    in_flight.hold()
    assert [t._use_count() for t in in_flight._held] == [2]   # the one still in a work, held
    del work
    in_flight.hold()
    assert in_flight._held == []


def test_settle_waits_until_the_other_holder_lets_go():
    in_flight = InFlight()
    tensor = torch.ones(3)
    holder = [tensor.view(3)]
    in_flight.hold(tensor)
    del tensor
    waiting = threading.Event()
    letting_go = threading.Thread(target=lambda: (waiting.wait(30), holder.clear()))
    letting_go.start()
    assert not in_flight.settle(timeout_s=0)   # still held elsewhere: kept
    waiting.set()
    assert in_flight.settle(timeout_s=60)
    letting_go.join()
    assert in_flight._held == []
