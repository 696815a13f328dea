"""The ranks' words carried in DistributedDataParallel's own gradient all-reduce.

A collective of its own, however small, costs a DDP step on the CPU about a millisecond (gloo's
threads wake, meet and hand the result back while the backward computes; measured in
bench/ddp_overhead.py: some 4-5% of a 25 ms step), while a few more elements in an all-reduce
that runs anyway cost nothing that shows. So where the model's DDP lets us, a communication hook
appends a short float vector to the first bucket's gradients (the bucket DDP all-reduces first,
at most 1 MB once the buckets are rebuilt after the first step), all-reduces both at once (a sum,
gradients divided by the world size first, as DDP's own hook does) and splits them again.

The sum carries what the ranks agree on because each value is written by one rank only, in its
own slot, with zeros from every other rank (x + 0 is x exactly, inf and NaN included):

    [command code, payload bytes, spacing]    rank 0's (the others write 0)
    [not finite] x W                          1 where that rank's loss was not finite
    [low headroom] x W                        1 where that rank's last probed step was short of it
    [stop, checkpoint, signal] x W            that rank's stop vote
    [present, loss, step time, act...] x W    that rank's figures of the last probed step

Every value is an integer below 2**24, a figure that fp32 holds exactly (a loss, a maximum of
fp16, bf16 or fp32 outputs) or a step time (to fp32's seven digits), so the vector travels in the
gradients' dtype, fp32 or fp64. A model whose gradients are in another dtype (or whose DDP has a
hook of its own, or reduces in Python) keeps the collectives of job/ranks/distributed.py.

The vector has the same length on every rank at every backward (its slots are zeros when there
is nothing to send), and only a backward that `send()` prepared keeps what came back: another
one (a diagnosis re-running a bad step) only all-reduces its gradients.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from amp_tui.training.sharding import is_sharded

HEAD = 3             # rank 0's command code, payload length and probe spacing
FLAGS = 2            # each rank's loss not finite, and its low headroom
VOTE = 3             # each rank's stop, checkpoint and signal number
ROW_HEAD = 3         # present, loss, step time: then one maximum per layer


def ddp_of(model: torch.nn.Module):
    """The DistributedDataParallel in `model` (a compiled model's too), or None."""
    from torch.nn.parallel import DistributedDataParallel
    inner = getattr(model, "_orig_mod", model)   # torch.compile's OptimizedModule
    return inner if isinstance(inner, DistributedDataParallel) else None


def unsuitable(model: torch.nn.Module) -> str | None:
    """Why the words can't ride on this model's gradient all-reduce (None: they can)."""
    ddp = ddp_of(model)
    if ddp is None and is_sharded(model):
        return "the model is sharded with FSDP2 (fully_shard)"
    if ddp is None:
        return "the model is not in DistributedDataParallel"
    if getattr(ddp, "_comm_hooks", None):
        return "its DistributedDataParallel has a communication hook of its own"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "its DistributedDataParallel reduces in a mixed precision of its own"
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        return "its DistributedDataParallel reduces the gradients in its own way"
    dtypes = {p.dtype for p in ddp.parameters() if p.requires_grad}
    if not dtypes or not dtypes <= {torch.float32, torch.float64}:
        return f"its gradients are {', '.join(sorted(str(d) for d in dtypes)) or 'none'} (fp32 or fp64 carry the words)"
    return None


@dataclass(frozen=True)
class Received:
    """What every rank sent, summed: read back per rank."""

    code: int
    payload_bytes: int
    nonfinite: list[bool]
    stops: list[tuple[bool, bool, int]]      # per rank: stop asked, with a checkpoint, signal number
    rows: torch.Tensor | None                # per rank [loss, step time, act...]; None: not every rank sent one
    probe_spacing: int = 0                   # rank 0's spacing of the probed steps (0: none)
    low_headroom: tuple[bool, ...] = ()      # per rank: its last probed step was short of headroom


class Slots:
    """Where each rank writes its words in the vector (the module docstring has the layout)."""

    def __init__(self, world_size: int, layers: int):
        self.world_size = world_size
        self.row_size = ROW_HEAD + layers
        self._votes_at = HEAD + FLAGS * world_size
        self._rows_at = self._votes_at + VOTE * world_size
        self.size = self._rows_at + world_size * self.row_size

    def pack(self, *, rank: int, code: int, payload_bytes: int, finite: bool,
             stop: tuple[bool, bool, int] | None, row: torch.Tensor | None, probe_spacing: int = 0,
             low_headroom: bool = False) -> torch.Tensor:
        """This rank's vector: its own slots written, zeros in every other rank's."""
        values = [0.0] * self.size
        if rank == 0:
            values[0], values[1], values[2] = float(code), float(payload_bytes), float(probe_spacing)
        values[HEAD + rank] = 0.0 if finite else 1.0
        values[HEAD + self.world_size + rank] = 1.0 if low_headroom else 0.0
        if stop is not None:
            base = self._votes_at + VOTE * rank
            values[base:base + VOTE] = [float(stop[0]), float(stop[1]), float(stop[2])]
        if row is not None:
            base = self._rows_at + rank * self.row_size
            values[base] = 1.0   # present
            values[base + 1:base + 1 + row.numel()] = row.tolist()
        return torch.tensor(values, dtype=torch.float64)

    def read(self, summed: torch.Tensor) -> Received:
        """Every rank's words from the summed vector (one transfer; the rest in Python)."""
        values = summed.tolist()
        w, r = self.world_size, self.row_size
        votes = values[self._votes_at:self._rows_at]
        rows = [values[self._rows_at + k * r:self._rows_at + (k + 1) * r] for k in range(w)]
        present = all(row[0] == 1.0 for row in rows)
        return Received(code=int(values[0]), payload_bytes=int(values[1]), probe_spacing=int(values[2]),
                        nonfinite=[v != 0 for v in values[HEAD:HEAD + w]],
                        low_headroom=tuple(v != 0 for v in values[HEAD + w:self._votes_at]),
                        stops=[(votes[k] != 0, votes[k + 1] != 0, int(votes[k + 2])) for k in range(0, VOTE * w, VOTE)],
                        rows=torch.tensor([row[1:] for row in rows], dtype=torch.float64) if present else None)


class GradientChannel:
    """The communication hook on one DDP model, and what its next backward sends and brought."""

    def __init__(self, model: torch.nn.Module, layers: int):
        ddp = ddp_of(model)
        # DDP's reducer holds the hook, and so this channel: a strong reference back to the DDP
        # would make a cycle through C++ that Python's collector can't see, and the DDP would
        # outlive its process group, to be torn down as the interpreter exits (where gloo's
        # threads abort the process).
        self._ddp = weakref.ref(ddp)
        self._group = ddp.process_group
        self.world_size = self._group.size()
        self.slots = Slots(self.world_size, layers)
        self.enabled = True      # False: the hook only all-reduces the gradients (DDP's own way)
        self._outbox: torch.Tensor | None = None
        self._inbox: torch.Tensor | None = None

    def install(self) -> str | None:
        """Register the hook; why it could not be (None: it is)."""
        try:
            self._ddp().register_comm_hook(self._group, self._hook)
        except (RuntimeError, ValueError) as exc:   # a built-in hook registered already
            return f"its DistributedDataParallel refused a communication hook ({exc})"
        return None

    def syncs(self) -> bool:
        """The next backward all-reduces the gradients (not a `no_sync` micro-batch)."""
        ddp = self._ddp()
        return ddp is not None and bool(ddp.require_backward_grad_sync) and torch.is_grad_enabled()

    def send(self, **words) -> None:
        """What this rank's next synchronising backward carries (`Slots.pack`'s words)."""
        self._outbox, self._inbox = self.slots.pack(**words), None

    def take(self) -> Received | None:
        """What the last prepared backward brought back (None: no such backward ran)."""
        got, self._inbox = self._inbox, None
        return self.slots.read(got) if got is not None else None

    def _hook(self, group, bucket):   # (DDP checks a return annotation by identity: none given)
        buffer = bucket.buffer()
        buffer.div_(self.world_size)
        if not self.enabled or bucket.index() != 0:
            work = dist.all_reduce(buffer, group=group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        extra, self._outbox = self._outbox, None
        keep = extra is not None
        if extra is None:
            extra = torch.zeros(self.slots.size, dtype=buffer.dtype, device=buffer.device)
        joined = torch.cat([buffer, extra.to(device=buffer.device, dtype=buffer.dtype)])
        n = buffer.numel()
        work = dist.all_reduce(joined, group=group, async_op=True)

        def split(fut) -> torch.Tensor:
            summed = fut.value()[0]
            if keep:
                self._inbox = summed[n:]
            return summed[:n]
        return work.get_future().then(split)
