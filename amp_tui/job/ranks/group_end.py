"""The process group ends where the ranks leave it, and gloo's threads with it.

gloo runs collectives on threads of its own, and such a thread lets go of a finished
collective's work a moment after the wait for it returned. A tensor that Python holds too is let
go of with the GIL taken; a thread that asks for the GIL once the interpreter has begun to
finalize is ended by Python (pthread_exit), and the unwinding through a noexcept destructor
aborts the process: "terminate called without an active exception", SIGABRT, exit -6, after the
run's work is done. Rare, because that thread must have waited for the CPU from the last
collective to the interpreter's end: a loaded machine's odds.

`destroy_process_group()` rules it out where it ends the group: the group's destructor waits for
its threads to finish what they hold (the GIL released meanwhile) and joins them, before the
interpreter finalizes. On torch 2.13 it did not end it once DistributedDataParallel was built:
DDP imports torch._dynamo, which imports torch.distributed.nn.functional, whose functions take
`group=group.WORLD` as a default argument. Imported after init_process_group, that default is the
group itself, held for as long as the interpreter lives, and the group's threads outlive it.
`forget_group()` gives those functions back the default they have when imported before the group
(None: the default group when called), so the last reference goes where the group is destroyed.
"""

from __future__ import annotations

import sys
import types

# Modules whose functions take the default group as a default argument, evaluated at import.
HOLDERS = ("torch.distributed.nn.functional",)


def forget_group(group) -> int:
    """Replace `group` by None in the default arguments of the HOLDERS' functions (those loaded);
    how many functions held it."""
    if group is None:
        return 0
    held = 0
    for name in HOLDERS:
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            if isinstance(value, types.FunctionType) and _drop_default(value, group):
                held += 1
    return held


def _drop_default(function: types.FunctionType, group) -> bool:
    positional, keywords = function.__defaults__ or (), function.__kwdefaults__ or {}
    if not any(d is group for d in (*positional, *keywords.values())):
        return False
    if positional:
        function.__defaults__ = tuple(None if d is group else d for d in positional)
    if keywords:
        function.__kwdefaults__ = {k: None if d is group else d for k, d in keywords.items()}
    return True
