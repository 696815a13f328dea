"""The tensors handed to the process group's collectives, held until its threads let go of them.

gloo runs a collective on a thread of its own. `wait()` returns once the result is in; that thread
lets go of the work, and of the tensors in it, a moment later, and takes the GIL to let go of a
tensor that has a Python object; a thread that asks for the GIL while the interpreter finalizes
is ended by Python (pthread_exit), and the unwinding through a noexcept destructor aborts the
process: "terminate called without an active exception", SIGABRT, after the run's work is done.
A group amp-tui set up ends with the run, its threads joined (job/ranks/group_end.py); a loop's own
group may outlive the loop (its DistributedDataParallel holds it), its threads with it. So the
tensors of our collectives stay held here until gloo has let go of them (their use count is ours
alone again), and `settle()`, before the ranks part, waits until it has let go of all of them:
what gloo's threads do with the GIL for them is done while the interpreter is whole.
"""

from __future__ import annotations

import time

import torch

SETTLE_POLL_S = 0.001   # how often settle() looks again, the GIL released meanwhile


def _let_go(tensor: torch.Tensor) -> bool:
    """Nothing but this reference holds the tensor (a collective's work no longer does)."""
    return tensor._use_count() <= 1


class InFlight:
    """Tensors given to collectives, until the process group's threads let go of them."""

    def __init__(self):
        self._held: list[torch.Tensor] = []

    def hold(self, *tensors: torch.Tensor | None) -> None:
        """Keep `tensors` (a collective's, waited for) until gloo lets go of them; let go of the
        ones it has let go of since."""
        self._held = [t for t in self._held if not _let_go(t)]
        self._held += [t for t in tensors if t is not None]

    def settle(self, timeout_s: float) -> bool:
        """Wait until the group's threads have let go of every tensor held (they do, a moment
        after each wait, whenever they next run), at most `timeout_s`. False: one is still
        held (a thread stuck in a broken group); it is kept, never freed on such a thread."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._held = [t for t in self._held if not _let_go(t)]
            if not self._held:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(SETTLE_POLL_S)
