"""Several processes, one run: what the ranks of a torchrun job agree on, and how.

Every rank runs the same loop and the same guarded step on its own batches, and DDP all-reduces
the gradients, so they are bitwise the same on every rank after backward: GradScaler's found_inf,
the skip, the new scale, clipping and the scheduler agree with nothing of ours. What one rank
alone can see is agreed here.

Under `amp-tui train`, where the model's DDP allows it (`carry_in_gradients`), each step's words
and the last probed step's figures ride on DDP's own gradient all-reduce, in slots that a
communication hook appends to its first bucket (job/ranks/gradient_channel.py): no step runs a
collective of ours. The answer to the loss check comes with the backward of the step's last
micro-batch (the others are `no_sync`), and the probed step's figures with the next step's; where
they are wanted before that (a pause, a stop, a save, a restore, the end) they go in a gather of
their own. Otherwise (FSDP, a DDP with a hook of its own, fp16/bf16 gradients, a loop of one's
own under `amp_tui.monitor`), each with one collective of PyTorch's own process group:

- **the step's one collective**, the finite-loss check of each micro-batch: an
  `all_reduce(MAX)` of a small fixed-size int64 tensor, started before the micro-batch's
  backward and waited for after it, so it goes round while the backward runs instead of being
  a meeting point of its own ahead of DDP's all-reduce. Every rank runs that backward whatever
  its loss (a rank that skipped it alone would leave DDP's all-reduce of the others waiting for
  it until the timeout); where the first word, "the first rank whose loss is not finite", says
  one was not, every rank throws the gradients away (a NaN/inf loss only made NaN/inf ones) and
  skips the update without touching the scaler, and the step's remaining micro-batches are not
  run. Every rank learns the answer at the same point, after the same micro-batch's backward,
  and gloo matches the collectives in the order they were issued: the check before the
  backward's bucket all-reduces, on every rank. The other words are the next step boundary's: rank
  0's command code and the length of its payload, and every rank's stop request (the other
  ranks add zeros to rank 0's words, so it is rank 0's broadcast, which also carries a stop that
  a signal brought to any rank). What reached rank 0 after step k's check applies at the
  boundary after step k + 1.
- **the boundary**, where no loss check came before it (the first step, the heartbeat of a
  pause): the same tensor goes round on its own. The payload (the command's value, a broadcast
  from rank 0) only when there is one. Every rank then applies the same commands at the same
  step. While the run is paused the tensor goes round about once a second (HEARTBEAT_S): the
  heartbeat that keeps the process group's timeout from firing.
- **the figures**, once per probed step: one gather to rank 0 of a packed float vector from
  every rank (its loss, its step time up to the start of the step's first loss check: its own
  compute, before it waits for any other rank; and its per-layer maxima). Rank 0 records the
  maximum over the ranks for each layer, and each rank's loss and step time. A `Run` starts the
  gather at the end of the step and goes on (`gather_later`); it waits for it during the next
  step, once that step's loss check has been answered (every rank issued the gather before
  it), so the gather is no meeting point at the end of the step. Rank 0 holds the step's record,
  and every record after it, until then (job/run.py). A non-finite step's gather, and a loop of
  one's own under `amp_tui.monitor`, wait for it at once (`gather_step`).
- **checkpoints**: every rank's RNG state is gathered into rank 0's file; a restore's file, and
  whether every rank could read it, are agreed before any rank loads it.

Rank 0 alone records the session and serves the control socket. A rank that dies makes the
collective that waits for it fail at once (its connection closes); a rank that stops answering,
after the timeout given to `init_process_group` (`--dist-timeout`, DEFAULT_TIMEOUT_S). Either way
the collective raises `RanksLost`, which ends the run on every rank that is left, with the
session kept. docs/distributed.md tells the whole story.

This module holds the process group and the step's collectives; the gathers to rank 0 (the
figures, the checkpoints' RNG states) are job/ranks/rank_gathers.py's, `RanksLost` with
`communication_failure` job/ranks/ranks_lost.py's, and `StopVote` job/ranks/stop_votes.py's.
What they carry is laid out in modules of its own: the words (job/ranks/boundary_words.py), the
commands (job/ranks/command_codec.py), the figures (job/ranks/rank_figures.py), the probe schedule's
words (job/ranks/rank_probes.py), the checkpoints' RNG states (job/ranks/rng_states.py).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from amp_tui.core.commands import Command
from amp_tui.job.ranks.boundary_words import BoundaryWords
from amp_tui.job.ranks.command_codec import decode_commands, encode_commands
from amp_tui.job.ranks.gradient_channel import GradientChannel, unsuitable
from amp_tui.job.ranks.group_end import forget_group
from amp_tui.job.ranks.in_flight import InFlight
from amp_tui.job.ranks.rank_gathers import RankGathers
from amp_tui.job.ranks.rank_output import rank_log_path
from amp_tui.job.ranks.rank_probes import RankProbes
from amp_tui.job.ranks.ranks_lost import RanksLost, backend_words, communication_failure
from amp_tui.job.ranks.stop_votes import StopVote, signal_name, signal_number
from amp_tui.training.sharding import is_sharded

DEFAULT_TIMEOUT_S = 300.0   # init_process_group's timeout: how long a collective waits for a rank
HEARTBEAT_S = 1.0           # while paused, the boundary's own all-reduce runs at least this often
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")   # what torchrun sets in every worker

__all__ = ["DEFAULT_TIMEOUT_S", "HEARTBEAT_S", "RANK_VARIABLES", "Ranks", "RanksLost", "StopVote",
           "communication_failure", "decode_commands", "encode_commands", "launched_by_torchrun"]


@dataclass(frozen=True)
class _Agreed:
    """The step's words (this rank's, or all-reduced), rank 0's payload and the vote sent."""

    words: BoundaryWords
    payload: bytes
    vote: StopVote | None


def launched_by_torchrun(environ=os.environ) -> bool:
    """This process is one rank of a job with more than one (torchrun set its variables)."""
    if not all(name in environ for name in RANK_VARIABLES):
        return False
    try:
        return int(environ["WORLD_SIZE"]) > 1
    except ValueError:
        return False


class Ranks(RankGathers):
    """The ranks of this job, as one rank sees them, over the default process group."""

    def __init__(self, *, device: torch.device, timeout_s: float | None, owns_group: bool):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.is_main = self.rank == 0
        self.device = device                 # the training device of this rank
        self.timeout_s = timeout_s           # None: the group's own (set up by the user's loop)
        self.owns_group = owns_group         # we set it up, so we tear it down
        self.run_dir: Path | None = None     # where the other ranks' output goes, once agreed
        # NCCL reduces tensors on the GPU, gloo on the CPU.
        self._comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
        self._words = torch.zeros(BoundaryWords.SIZE, dtype=torch.int64, device=self._comm)
        self._in_flight = InFlight()   # our collectives' tensors, until gloo's threads let go of them
        # Set by a run whose loss checks carry the next boundary's words: the commands queued for
        # it so far (taken on every rank, encoded on rank 0 alone).
        self.upcoming: Callable[[], list[Command]] | None = None
        self._carried: _Agreed | None = None      # the next boundary's words, agreed at a loss check
        self._carried_commands: list[Command] = []  # rank 0's commands in them
        self.voting = True                   # stops are votes until the loop has ended
        self._vote: StopVote | None = None   # replaced whole, never mutated: a signal handler sets it
        self._synced_at = time.perf_counter()
        self._compute_s: float | None = None  # this step's time up to its first loss check
        self.nonfinite_rank: int | None = None  # of the last agreed loss check that failed
        # Where DDP's own gradient all-reduce carries the step's words and figures
        # (carry_in_gradients): the hook, this step's losses so far (a no_sync micro-batch sends
        # nothing), this rank's figures of the last probed step until they go, and once they came,
        # (that row, every rank's).
        self._channel: GradientChannel | None = None
        self._step_finite = True
        self._rows_out: torch.Tensor | None = None
        self._rows_in: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # How the words go round, once carry_in_gradients decided: for the session's header.
        self.coordination: str | None = None
        # The adaptive probe schedule's words (job/ranks/rank_probes.py), where a run has one.
        self.probes: RankProbes | None = None

    # ---- joining ----------------------------------------------------------------------------
    @classmethod
    def join(cls, requested_device: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Ranks:
        """Set up the process group of a torchrun job: nccl on cuda:LOCAL_RANK where there is a
        GPU (or one is asked for), gloo on the CPU otherwise; `timeout_s` is how long any
        collective waits for the other ranks before it fails."""
        local_rank = int(os.environ["LOCAL_RANK"])
        kind = torch.device(requested_device).type if requested_device else (
            "cuda" if torch.cuda.is_available() else "cpu")
        if kind == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group("nccl" if kind == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(device=device, timeout_s=timeout_s, owns_group=True)

    @classmethod
    def of_loop(cls, model: torch.nn.Module) -> Ranks | None:
        """The process group a user's own loop set up, when it has more than one rank."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        ranks = cls(device=device, timeout_s=None, owns_group=False)
        if is_sharded(model):   # the words go in collectives of their own, and the header says why
            ranks.coordination = "collectives: the model is sharded with FSDP2 (fully_shard)"
        return ranks

    def close(self) -> None:
        """Leave the process group, once its threads have let go of our collectives' tensors
        (job/ranks/in_flight.py), so that it ends here, its threads joined, rather than as the
        interpreter finalizes, where one of them can abort the process (job/ranks/group_end.py).
        A group of the user's own is left to them, with nothing of ours holding it."""
        self.voting = False
        self._in_flight.settle(self.timeout_s or DEFAULT_TIMEOUT_S)
        # What the run attached holds its DDP, and the DDP the group.
        self.upcoming, self._channel = None, None
        gc.collect()   # a DDP wrapper left in a reference cycle holds the group: freed first
        if dist.is_initialized():
            forget_group(dist.group.WORLD)
        if self.owns_group and dist.is_initialized():
            with contextlib.suppress(Exception):  # noqa: BLE001 - a broken group goes all the same
                dist.destroy_process_group()

    # ---- what the run is made of ------------------------------------------------------------
    def replicate(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model in DistributedDataParallel, unless the script wrapped it already (DDP or
        FSDP). DDP broadcasts rank 0's parameters and buffers here, so every replica starts the
        same."""
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        from torch.nn.parallel import DistributedDataParallel
        # FSDPModule: a model given to fully_shard (FSDP2), whose class torch renames FSDP<Name>.
        if isinstance(model, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)):
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return self._collective("wrapping the model in DistributedDataParallel",
                                lambda: DistributedDataParallel(model, device_ids=ids))

    def carry_in_gradients(self, model: torch.nn.Module, layers: int) -> str | None:
        """Have each step's words (the loss check, the next boundary's commands, the stop votes)
        and the last probed step's figures ride on DDP's own gradient all-reduce instead of
        collectives of their own (job/ranks/gradient_channel.py), where every rank's model allows it.
        Returns why they can't (None: they ride). A collective: every rank calls it."""
        problem = unsuitable(model)
        channel = None
        if problem is None:
            channel = GradientChannel(model, layers)
            problem = channel.install()
            if problem is not None:
                channel = None
        agreed = self.first_problem(problem)
        if agreed is not None:
            if channel is not None:
                channel.enabled = False   # another rank's can't: this one's hook reduces as DDP's does
            self.coordination = f"collectives: {agreed}"
            return agreed
        self._channel = channel
        self.coordination = "gradients"
        return None

    def header_fields(self) -> dict:
        fields: dict[str, Any] = {"world_size": self.world_size}
        if self.coordination is not None:
            fields["coordination"] = self.coordination
        return fields

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size}"

    # ---- collectives ------------------------------------------------------------------------
    def _collective(self, what: str, call):
        try:
            return call()
        except RuntimeError as exc:
            raise RanksLost(self.lost_message(exc, what)) from exc

    def _let_go(self, work: list, what: str, *tensors: torch.Tensor) -> None:
        """Wait for a started collective (`work`: its one Work, taken out once done), then hold
        its tensors until gloo's thread lets go of them too (job/ranks/in_flight.py)."""
        if work:
            self._collective(what, work[0].wait)
            work.clear()
            self._in_flight.hold(*tensors)

    def lost_message(self, exc: BaseException, what: str | None = None) -> str:
        if isinstance(exc, RanksLost):
            return str(exc)
        words = backend_words(exc)
        lower = words.lower()
        if "timed out" in lower or "timeout" in lower:
            limit = f"{self.timeout_s:g} s (--dist-timeout)" if self.timeout_s else "the process group's timeout"
            why = f"no answer from another rank within {limit}"
        else:
            why = "another rank is gone (its process ended or closed its connection)"
        during = f" while {what}" if what else ""
        logs = (f"; each rank's own output says why it ended (rank 0's here, the others' in "
                f"{rank_log_path(self.run_dir, 1).with_name('rank<N>.log')})" if self.run_dir else "")
        return f"{why} ({words}){during}: the run stops here, with what was recorded so far{logs}"

    def share(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (a small picklable object)."""
        box = [value if self.is_main else None]
        self._collective("agreeing with rank 0", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def first_problem(self, problem: str | None) -> str | None:
        """Every rank says whether it can go on; all get the first rank's problem (None: every
        rank can), worded with its rank when it is not rank 0."""
        t = torch.tensor([self.rank if problem is not None else self.world_size], dtype=torch.int64,
                         device=self._comm)
        self._collective("agreeing on a check", lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN))
        self._in_flight.hold(t)
        first = int(t.item())
        if first == self.world_size:
            return None
        box = [problem if self.rank == first else None]
        self._collective("agreeing on a check", lambda: dist.broadcast_object_list(box, src=first))
        return box[0] if first == 0 else f"rank {first}: {box[0]}"

    # ---- stops ------------------------------------------------------------------------------
    def vote_stop(self, *, checkpoint: bool = False, reason: str | None = None) -> None:
        """A stop asked for on this rank (from any thread, a signal handler too): every rank
        stops at the next boundary."""
        old = self._vote
        self._vote = StopVote(checkpoint=checkpoint or (old is not None and old.checkpoint),
                              reason=(old.reason if old is not None and old.reason else reason),
                              signum=(old.signum if old is not None and old.signum else signal_number(reason)))

    # ---- step boundaries --------------------------------------------------------------------
    def _local_words(self, commands: list[Command], *, finite: bool = True) -> _Agreed:
        """This rank's words of the step's tensor, before the all-reduce."""
        code, payload = encode_commands(commands) if self.is_main else (0, b"")
        vote = self._vote   # read once: a signal may replace it meanwhile, the next collective has it
        if self.probes is not None and self.probes.nonfinite_here():
            finite = False   # a loop of one's own: this rank's loss or figures, agreed on here
        nonfinite = None if finite else self.rank
        spacing, low_headroom = self.probes.words() if self.probes is not None else (0, False)
        words = {"nonfinite_rank": nonfinite, "command": code, "payload_bytes": len(payload),
                 "probe_spacing": spacing, "headroom_rank": self.rank if low_headroom else None}
        if vote is None:
            local = BoundaryWords(**words)
        else:
            local = BoundaryWords(**words, stop_rank=self.rank, checkpoint=vote.checkpoint, signum=vote.signum)
        return _Agreed(local, payload, vote)

    def _all_reduce(self, mine: _Agreed, what: str) -> _Agreed:
        return self._start_all_reduce(mine, what)()

    def _start_all_reduce(self, mine: _Agreed, what: str) -> Callable[[], _Agreed]:
        """The all-reduce of the step's words, started: the function returned waits for it.
        Nothing else of ours runs meanwhile (the words' buffer is the all-reduce's until then)."""
        words = self._words
        words.copy_(mine.words.pack(self.world_size))
        work = [self._collective(what, lambda: dist.all_reduce(words, op=dist.ReduceOp.MAX, async_op=True))]

        def agreed() -> _Agreed:
            self._let_go(work, what)   # (the words' buffer is ours for as long as the ranks are)
            return _Agreed(BoundaryWords.unpack(words, self.world_size), mine.payload, mine.vote)
        return agreed

    def agree_commands(self, take: Callable[[], list[Command]]) -> tuple[list[Command], StopVote | None]:
        """Rank 0's commands on every rank (the others' are ignored), and the stop that any
        rank asked for, if one did: those the last loss check carried, or where none came
        since the last boundary, `take()`'s, agreed here."""
        agreed, self._carried = self._carried, None
        if agreed is not None:
            commands, self._carried_commands = self._carried_commands, []
        else:
            commands = take()
            agreed = self._all_reduce(self._local_words(commands),
                                      "agreeing on the commands at a step boundary")
        words, payload = agreed.words, agreed.payload
        size = words.payload_bytes
        if size:
            buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._comm) if self.is_main
                      else torch.empty(size, dtype=torch.uint8, device=self._comm))
            self._collective("sending a command to every rank", lambda: dist.broadcast(buffer, src=0))
            self._in_flight.hold(buffer)
            payload = bytes(buffer.cpu().tolist())
        self._synced_at, self._compute_s, self.nonfinite_rank = time.perf_counter(), None, None
        self._step_finite = True
        if self.probes is not None:
            self.probes.agreed(words.probe_spacing, words.headroom_rank, words.nonfinite_rank)
        if not self.is_main:
            commands = decode_commands(words.command, payload)
        first = words.stop_rank
        if first is None:
            return commands, None
        vote = agreed.vote
        if vote is not None and self.rank == first and vote.reason:
            reason = vote.reason
        elif words.signum:
            reason = f"{signal_name(words.signum)} on rank {first}"
        else:
            reason = f"a stop asked for on rank {first}"
        return commands, StopVote(checkpoint=words.checkpoint, reason=reason, signum=words.signum)

    def hold(self, commands) -> None:
        """Paused: rank 0 waits for a command at most HEARTBEAT_S, then the boundary's tensor goes
        round again; the other ranks wait in that collective."""
        if self.is_main:
            commands.wait(HEARTBEAT_S)

    # ---- the step ---------------------------------------------------------------------------
    def agree_finite(self, value: float) -> Callable[[], bool]:
        """The finite-loss check of one micro-batch, started; the function returned waits for
        its answer: False on every rank when any rank's loss is not finite. The step starts it
        before the micro-batch's backward and asks after it, so the all-reduce goes round while
        the backward runs (every rank runs it, whatever its loss: a step that is not finite
        somewhere then throws its gradients away on every rank). Where `upcoming` is set, the
        same all-reduce agrees on the next boundary's commands and stop votes: the boundary then
        needs no collective of its own. A later check of the same step (micro-batches) adds
        what was queued meanwhile; rank 0 sends the whole list each time.

        The rank's step time ends where the step's first check starts: its own compute since the
        boundary (the forward), before anything that waits for another rank (this check's
        answer, DDP's all-reduce in the backward)."""
        if self._compute_s is None:
            self._compute_s = time.perf_counter() - self._synced_at
        finite = math.isfinite(value)
        carry = self.upcoming is not None
        if carry:
            self._carried_commands += self.upcoming()
        if self._channel is not None:
            return self._finite_by_gradients(finite, carry)
        mine = self._local_words(self._carried_commands if carry else [], finite=finite)
        pending = self._start_all_reduce(mine, "agreeing on the finite-loss check")

        return lambda: self._answer(pending(), carry)

    def _answer(self, agreed: _Agreed, carry: bool) -> bool:
        """The loss check's answer from its agreed words (True: finite on every rank); the
        next boundary's words kept for it where they came with the check."""
        if carry:
            self._carried = agreed
        if agreed.words.nonfinite_rank is not None:
            self.nonfinite_rank = agreed.words.nonfinite_rank
            return False
        return True

    def _finite_by_gradients(self, finite: bool, carry: bool) -> Callable[[], bool]:
        """agree_finite where DDP's all-reduce carries the words. A `no_sync` micro-batch sends
        nothing: its loss is told with the step's last one, whose backward all-reduces the
        gradients, so a loss that is not finite skips the step after all its micro-batches ran
        (their backward is all that can go round). The last probed step's figures go with it."""
        channel = self._channel
        self._step_finite = self._step_finite and finite
        if not channel.syncs():
            return lambda: True
        mine = self._local_words(self._carried_commands if carry else [], finite=self._step_finite)
        self._step_finite = True
        row, self._rows_out = self._rows_out, None
        vote = mine.vote
        channel.send(rank=self.rank, code=mine.words.command, payload_bytes=mine.words.payload_bytes,
                     finite=mine.words.nonfinite_rank is None,
                     stop=(True, vote.checkpoint, vote.signum) if vote is not None else None, row=row,
                     probe_spacing=mine.words.probe_spacing, low_headroom=mine.words.headroom_rank is not None)

        def finite_everywhere() -> bool:
            got = channel.take()
            if got is None:
                # The backward all-reduced no gradients of this model (a loss_fn that calls its
                # inner module, say), on every rank alike: from now on, collectives of our own.
                self._channel, self._rows_out = None, row
                agreed = self._all_reduce(mine, "agreeing on the finite-loss check")
            else:
                agreed = _Agreed(BoundaryWords.from_received(got), mine.payload, mine.vote)
                if row is not None:
                    self._rows_in = (row, got.rows)
            return self._answer(agreed, carry)
        return finite_everywhere

    def forward_done(self, *_args) -> None:
        """A forward hook on the user's DDP model (own loops): its step time ends here, before
        the backward's all-reduce."""
        if self._compute_s is None:
            self._compute_s = time.perf_counter() - self._synced_at
