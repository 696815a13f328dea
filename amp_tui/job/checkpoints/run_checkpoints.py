"""A run's checkpoints: saving its whole state, restoring it mid-run, and resuming from it.

A full checkpoint holds the weights, the optimizer, the scheduler, the GradScaler and the RNG
states, the applied and skipped counts, and what the host adds (`amp-tui train`: how many
micro-batches were consumed, so a resume reads the data in the same order). Each operation
records what it did as an event; a save the disk refuses is handed to the host's full-disk policy.

The host is the run controller (job/controller.py), as `CheckpointHost` declares it: the training
state it saves and restores comes from whatever drives the steps (`TrainingState`).

With several ranks the replicas are identical, so rank 0 alone writes the file, with every
rank's RNG state in it (a model sharded with FSDP2 is gathered whole on rank 0 for it first:
training/checkpoint/sharded.py, or, where that would not fit or `--fsdp-checkpoint sharded` asks,
each rank writes its own shards into one folder: training/checkpoint/dcp.py, the choice in
job/checkpoints/checkpoint_layout.py); a restore or a resume loads it on every rank at the same step (DDP
broadcasts parameters only when it wraps the model), each rank taking its own RNG state back, or
on none: which file, and whether every rank could read it, are agreed first.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from amp_tui.core.commands import Command, Outcome
from amp_tui.core.numfmt import byte_size
from amp_tui.core.text import plural
from amp_tui.job.checkpoints import checkpoint_layout as layouts
from amp_tui.job.ranks.rng_states import restore_rng, rng_problem, saved_world_size
from amp_tui.job.records.probe_events import escalate_probes
from amp_tui.recording.reader import read_session
from amp_tui.training import checkpoint as ckpt
from amp_tui.training.checkpoint.dcp import ShardedCheckpoint, folder_bytes, save_sharded
from amp_tui.training.checkpoint.manifest import sharded_path, temporary_dir
from amp_tui.training.checkpoint.sharded import gathered_views, loading_views
from amp_tui.training.sharding import is_sharded


class TrainingState(Protocol):
    """What a checkpoint saves and restores, as a trainer (or a monitored loop) holds it."""

    model: Any
    optimizer: Any
    scheduler: Any
    dtype: str
    step_index: int
    updates_applied: int
    skipped_total: int

    precision: Any    # training.precision_state.PrecisionState

    def scaler_state(self) -> dict | None: ...

    def restore_scaler(self, state: dict | None) -> None: ...

    def checkpoint_extra(self) -> dict: ...

    def describe_precision(self) -> dict: ...

    def set_dtype(self, dtype: str) -> dict: ...

    def discard_started_step(self) -> None: ...


class CheckpointHost(Protocol):
    """What the checkpoints need of the run they belong to."""

    training: TrainingState
    run_dir: Path
    session_path: Path
    ranks: Any        # job.distributed.Ranks, or None for one process

    def event(self, kind: str, message: str, **fields: Any) -> dict: ...

    def checkpoint_refused(self, source: str, message: str) -> None: ...

    def saved_extra(self) -> dict: ...


class RunCheckpoints:
    def __init__(self, run: CheckpointHost):
        self.run = run
        self.folder = run.run_dir / "checkpoints"

    def list(self) -> list[ckpt.CheckpointInfo]:
        return ckpt.list_checkpoints(self.folder)

    def relative(self, path: Path) -> str:
        """`path` as the recording names it: relative to the run directory where it is inside."""
        try:
            return str(Path(path).relative_to(self.run.run_dir))
        except ValueError:
            return str(path)

    def save(self, *, source: str) -> ckpt.CheckpointInfo | None:
        """Write a full checkpoint (rank 0; the other ranks hand over their RNG state and get None)."""
        run, t = self.run, self.run.training
        extra = {**t.checkpoint_extra(), **run.saved_extra()}
        layout, why = self._layout()
        if layout == "sharded":
            return self._save_sharded(extra, why, source=source)
        model, optimizer = self._live(gather=True)
        if run.ranks:
            states = run.ranks.gather_rng()
            if not run.ranks.is_main:
                run.event("checkpoint_saved", f"rank 0 writes the checkpoint of step {t.step_index}, "
                          "with this rank's RNG state in it", source=source)
                return None
            extra.update(run.ranks.checkpoint_extra(states))
        path = ckpt.checkpoint_path(self.folder, t.step_index)
        started = time.perf_counter()
        try:
            info = ckpt.save_checkpoint(
                path, model=model, optimizer=optimizer, scheduler=t.scheduler,
                scaler_state=t.scaler_state(), step=t.step_index, dtype=t.dtype, extra=extra)
        except ckpt.CheckpointError as exc:
            run.event("error", str(exc), during="save", source=source)
            if isinstance(exc.__cause__, OSError):  # a full disk, not a bad model state
                run.checkpoint_refused(source, str(exc))
            return None
        size = os.path.getsize(info.path)
        run.event("checkpoint_saved", f"checkpoint {self.relative(info.path)} saved at step {t.step_index} "
                  f"({byte_size(size)}, {time.perf_counter() - started:.2f}s)",
                  path=self.relative(info.path), checkpoint_step=t.step_index, dtype=t.dtype, bytes=size,
                  source=source, layout=layout, layout_reason=why)
        return info

    def _layout(self) -> tuple[str, str]:
        """("full" or "sharded", why): how this save writes the model (a model not sharded with
        FSDP2: always one file). Rank 0 decides; a collective with ranks."""
        run, t = self.run, self.run.training
        if not is_sharded(t.model):
            return "full", "the model is not sharded: one file"
        mode = run.fsdp_checkpoint
        chosen = None
        if not run.ranks or run.ranks.is_main:
            whole = layouts.state_bytes(t.model, t.optimizer) if mode == "auto" else 0
            chosen = layouts.choose(mode, whole, layouts.available_memory())
        return tuple(run.ranks.share(chosen)) if run.ranks else chosen

    def _save_sharded(self, extra: dict, why: str, *, source: str) -> ckpt.CheckpointInfo | None:
        """Every rank writes its shards; rank 0 the manifest (with every rank's RNG state)."""
        run, t = self.run, self.run.training
        states = run.ranks.gather_rng() if run.ranks else None
        if run.ranks and run.ranks.is_main:
            extra.update(run.ranks.checkpoint_extra(states))
        where = None
        if not run.ranks or run.ranks.is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = sharded_path(self.folder, t.step_index)
            where = (str(path), str(temporary_dir(path, os.getpid())))
        path, temporary = (Path(p) for p in (run.ranks.share(where) if run.ranks else where))
        started = time.perf_counter()
        try:
            info = save_sharded(path, temporary, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler,
                                scaler_state=t.scaler_state(), step=t.step_index, dtype=t.dtype, extra=extra,
                                world_size=run.ranks.world_size if run.ranks else 1,
                                is_main=not run.ranks or run.ranks.is_main)
        except ckpt.CheckpointError as exc:
            run.event("error", str(exc), during="save", source=source)
            if isinstance(exc.__cause__, OSError):
                run.checkpoint_refused(source, str(exc))
            return None
        if info is None:
            run.event("checkpoint_saved", f"this rank wrote its shards of the checkpoint of step {t.step_index}; "
                      "rank 0 the manifest, with this rank's RNG state in it", source=source)
            return None
        size = folder_bytes(info.path)
        run.event("checkpoint_saved", f"sharded checkpoint {self.relative(info.path)} saved at step "
                  f"{t.step_index} ({byte_size(size)} in {plural(len(list(info.path.glob('*.safetensors'))), 'file')}, "
                  f"{time.perf_counter() - started:.2f}s; {why})",
                  path=self.relative(info.path), checkpoint_step=t.step_index, dtype=t.dtype, bytes=size,
                  source=source, layout="sharded", layout_reason=why)
        return info

    def _target(self, command: Command) -> Path | None:
        """The file a restore command names (None: `latest`, and there is no checkpoint yet)."""
        target = str(command.value or "latest")
        if target == "latest":
            found = self.list()
            return found[0].path if found else None
        path = Path(target).expanduser()
        if not path.is_absolute() and not path.exists() and (self.run.run_dir / path).exists():
            path = self.run.run_dir / path
        return path

    def restore(self, command: Command) -> Outcome:
        run, t = self.run, self.run.training
        path = self._target(command)
        if run.ranks:
            path = run.ranks.share(path)   # rank 0's file, whatever the others' listing says
        if path is None:
            return run.refused(command, "restore refused: this run has no checkpoint yet")
        problem = loaded = None
        model, optimizer = self._live()
        try:
            loaded = ckpt.read_checkpoint(path, model=model, optimizer=optimizer, scheduler=t.scheduler)
        except ckpt.CheckpointError as exc:
            problem = str(exc)
        if problem is None and isinstance(loaded, ShardedCheckpoint):
            problem = self._sharded_problem(loaded)
        if run.ranks:   # every rank loads it, or none does
            if problem is None:
                why = rng_problem(loaded.extra, run.ranks.rank)
                problem = f"cannot restore {path}: {why}" if why else None
            problem = run.ranks.first_problem(problem)
        if problem is not None:
            return run.refused(command, f"restore refused: {problem}", path=str(path))
        before = t.describe_precision()
        try:
            self._apply(loaded)
        except ckpt.CheckpointError as exc:   # a sharded load that failed, alike on every rank
            return run.refused(command, f"restore refused: {exc}", path=str(path))
        after = t.describe_precision()
        ck_step = loaded.step
        note = f" ({loaded.notice})" if loaded.notice else ""
        saved = f"saved at step {ck_step}, {loaded.dtype}" if ck_step is not None else "weights only"
        message = (f"restored {self.relative(path)} ({saved}) before step {t.step_index}; the step counter "
                   f"goes on from {t.step_index}{note}")
        run.event("checkpoint_restored", message, path=self.relative(path), checkpoint_step=ck_step,
                  checkpoint_dtype=loaded.dtype, checkpoint_kind=loaded.kind, source=command.source,
                  before=before, after=after)
        escalate_probes(run, "restore", f"restored {self.relative(path)}")
        return Outcome(True, message)

    def resume(self, path: Path, *, steps: int | None, skipped: list[tuple[str, str]],
               skip_batches: Callable[[int], None]) -> int | None:
        """Continue a crashed or stopped run from a checkpoint; the step counter goes on from the
        last recorded step, like a restore, so the recording stays one forward timeline, and
        --steps counts the iterations of this command: a resume runs that many more (returned:
        the step to stop before). `skipped`: newer checkpoints refused, (path, why);
        `skip_batches(n)` reads past the micro-batches the checkpoint had consumed."""
        run, t = self.run, self.run.training
        last_step = max((r["step"] for r in read_session(run.session_path).steps), default=-1)
        model, optimizer = self._live()
        loaded = ckpt.read_checkpoint(path, model=model, optimizer=optimizer, scheduler=t.scheduler)
        saved, world = saved_world_size(loaded.extra), run.ranks.world_size if run.ranks else 1
        if saved != world:
            how = f"with --nproc {saved} (or torchrun with {saved} processes)" if saved > 1 else "without --nproc"
            raise ValueError(f"{self.relative(path)} was saved by a run of {plural(saved, 'rank')} and this "
                             f"one has {world}: every rank's data shard and RNG state belong to that "
                             f"world size; resume it {how}")
        why = rng_problem(loaded.extra, run.ranks.rank) if run.ranks else None
        if why:
            raise ValueError(f"{self.relative(path)}: {why}")
        if isinstance(loaded, ShardedCheckpoint):
            why = self._sharded_problem(loaded)
            if why:
                raise ValueError(why)
        self._apply(loaded)
        t.step_index = last_step + 1
        stop = steps + t.step_index if steps is not None else None
        extra = loaded.extra or {}
        skip_batches(int(extra.get("micro_batches_consumed", 0)))  # same data order as before
        start = t.step_index
        rolled_back = max(0, start - (loaded.step or 0))
        undone = (f"the {plural(rolled_back, 'recorded step')} after it "
                  f"{'are' if rolled_back != 1 else 'is'} rolled back, " if rolled_back else "")
        runs = (f"--steps {stop - start} runs steps {start}-{stop - 1}" if stop is not None
                else "it runs until stopped")
        passed = (f"; skipped {plural(len(skipped), 'newer checkpoint')} "
                  f"that failed the checks: {', '.join(p for p, _ in skipped)}" if skipped else "")
        run.event("resumed", f"resumed from {self.relative(path)} (saved at step {loaded.step}, "
                  f"{loaded.dtype}) after the recording's step {last_step}: {undone}the step counter "
                  f"goes on from {start}, and {runs}{passed}",
                  path=self.relative(path), checkpoint_step=loaded.step, checkpoint_dtype=loaded.dtype,
                  previous_last_step=last_step, rolled_back=rolled_back,
                  steps=None if stop is None else stop - start, until_step=stop,
                  updates=t.updates_applied, skipped_total=t.skipped_total,
                  skipped_checkpoints=[{"path": p, "reason": why} for p, why in skipped],
                  fp32_modules=run.local_fp32.names, min_scale=run.guard.config.min_scale)
        escalate_probes(run, "resume", f"resumed from {self.relative(path)}")
        return stop

    def _live(self, *, gather: bool = False):
        """The model and optimizer as a checkpoint reads and loads them: a model sharded with
        FSDP2 seen whole (`gather`: its full state gathered on rank 0 first, a collective)."""
        t = self.run.training
        if not is_sharded(t.model):
            return t.model, t.optimizer
        return (gathered_views if gather else loading_views)(t.model, t.optimizer)

    def _sharded_problem(self, loaded: ShardedCheckpoint) -> str | None:
        """Why a sharded checkpoint can't load into this run: its shards belong to the world size
        that wrote them, and to a model sharded with FSDP2."""
        run, t = self.run, self.run.training
        world = run.ranks.world_size if run.ranks else 1
        name = self.relative(loaded.info.path)
        if loaded.world_size != world:
            return (f"{name} is a sharded checkpoint of {plural(loaded.world_size, 'rank')} and this run has "
                    f"{world}: each rank's shards, data shard and RNG state belong to that world size; "
                    f"load it into a run of --nproc {loaded.world_size} --fsdp")
        if not is_sharded(t.model):
            return f"{name} is a sharded checkpoint: it loads into a model sharded with FSDP2 (--fsdp)"
        return None

    def _apply(self, loaded: ckpt.LoadedCheckpoint | ShardedCheckpoint) -> None:
        t, ranks = self.run.training, self.run.ranks
        if isinstance(loaded, ShardedCheckpoint):
            loaded.apply(t.model, t.optimizer, t.scheduler)   # a collective: each rank its shards
        else:
            loaded.apply(*self._live(), t.scheduler)
        if ranks:   # each rank its own RNG state (the file's own is rank 0's)
            restore_rng(loaded.extra or {}, ranks.rank, ranks.device)
        t.restore_scaler(loaded.scaler_state)
        # The applied and skipped counts are part of the state a full checkpoint brings back:
        # after a restore or a resume they count what the weights went through, not the
        # updates rolled back with them.
        extra = loaded.extra or {}
        if "updates_applied" in extra:
            t.updates_applied = int(extra["updates_applied"])
        if "skipped_total" in extra:
            t.skipped_total = int(extra["skipped_total"])
        t.discard_started_step()  # it ran on the weights before the restore
