"""A model sharded with FSDP2 saved and restored shard by shard, with `torch.distributed.checkpoint`
and its `HuggingFaceStorageWriter` / `HuggingFaceStorageReader`: no rank ever holds the whole
model (the folder and its manifest: checkpoint/manifest.py).

What goes through torch's checkpoint is tensors only: the model's sharded state dict
(`get_model_state_dict`) as "model.<name>", and the optimizer's (`get_optimizer_state_dict`) as
"optim.<parameter name>.<key>". Anything else (the optimizer's parameter groups, the scheduler,
the scaler, extra) goes into the manifest as JSON, tagged as in the single-file checkpoints
(codec.py): torch would write a non-tensor value with `torch.save`, which is a pickle.

Saving and applying are collectives: every rank calls them at the same point. Reading
(`read_sharded`) is not: it checks the manifest and the shard files against the live model,
optimizer and scheduler, changing nothing. Applying loads the shards into fresh tensors of each
rank's shard shapes first and only then sets them, so a load that fails (on any rank: torch's
checkpoint agrees on failures) leaves the run as it was.
"""

from __future__ import annotations

import datetime
import os
import shutil
from pathlib import Path

import torch

from amp_tui.core.precision import canonical
from amp_tui.training.checkpoint import checks, io, live, manifest
from amp_tui.training.checkpoint.codec import _decode, _encode, _Sink
from amp_tui.training.checkpoint.errors import CheckpointError, Problem, Unencodable, dtype_name, reason
from amp_tui.training.checkpoint.files import CheckpointInfo


class _Refs(_Sink):
    """Collects the tensors met while encoding under their names, as they are (DTensors stay
    sharded: torch's checkpoint writes each rank's shard)."""

    def __init__(self, tensors: dict, make=None):
        super().__init__(tensors)
        self._make = make or (lambda t: t)

    def put(self, name: str, tensor: torch.Tensor) -> str:
        if name in self.tensors:
            raise Unencodable(f"two tensors of the optimizer state are both named {name}")
        self.tensors[name] = self._make(tensor)
        return name


def _flat(model, optimizer, make=None) -> tuple[dict, object, object, list[str]]:
    """The tensors torch's checkpoint writes or fills, by name, and the optimizer's state and
    parameter groups as JSON referring to them, and the parameter names in the optimizer's order.
    A collective where torch's state-dict helpers are."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    make = make or (lambda t: t)
    weights = get_model_state_dict(model)
    optim = get_optimizer_state_dict(model, optimizer)
    tensors: dict = {}
    for k, v in weights.items():
        if not isinstance(v, torch.Tensor):
            raise Unencodable(f"model state {k!r} is a {type(v).__name__}, not a tensor")
        tensors[f"model.{k}"] = make(v)
    state = _encode(optim["state"], _Refs(tensors, make), "optim")
    groups = _encode(optim["param_groups"], None, "optimizer parameter groups")
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for p in live.flat_params(optimizer)]
    return tensors, state, groups, order


def save_sharded(path: Path, temporary: Path, *, model, optimizer, scheduler, scaler_state: dict | None,
                 step: int, dtype: str, extra: dict, world_size: int, is_main: bool) -> CheckpointInfo | None:
    """Every rank writes its shards into `temporary` (the same folder on every rank); rank 0 then
    writes the manifest and renames the folder to `path`, returning its info (None elsewhere)."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"could not write checkpoint {path}: {problem}")

    problem = checks.scaler_problem(scaler_state) if scaler_state is not None else None
    if problem:
        raise fail(problem)
    try:
        tensors, state, groups, order = _flat(model, optimizer)
        extra_json = _encode(extra, None, "extra")
        scaler_json = _encode(scaler_state, None, "scaler state")
    except Unencodable as e:
        raise fail(f"{e} (not JSON-serialisable)") from None
    sched, sched_note = None, None
    if scheduler is not None:
        try:
            sched = {"class": type(scheduler).__name__, "state": _encode(scheduler.state_dict(), None, "sched")}
        except Exception as e:  # noqa: BLE001 - an odd scheduler must not cost the checkpoint
            sched_note = f"{type(scheduler).__name__} state not saved: {reason(e)}"
    try:
        save(tensors, storage_writer=HuggingFaceStorageWriter(str(temporary), save_distributed=True))
    except Exception as e:   # torch's checkpoint raises the same on every rank
        if is_main:
            shutil.rmtree(temporary, ignore_errors=True)
        raise fail(reason(e)) from e
    if not is_main:
        return None
    try:
        described = {
            "step": step, "dtype": canonical(dtype), "world_size": world_size,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch_version": torch.__version__,
            "extra": extra_json, "scaler": scaler_json, "scheduler": sched,
            "model": {k[len("model."):]: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
                      for k, t in tensors.items() if k.startswith("model.")},
            "optimizer": {"class": live.class_name(optimizer), "param_names": order,
                          "param_shapes": [list(p.shape) for p in live.flat_params(optimizer)],
                          "state": state, "param_groups": groups},
            "tensors": sorted(tensors),
            "files": manifest.describe_files(temporary),
        }
        if sched_note:
            described["scheduler_note"] = sched_note
        manifest.write_manifest(temporary, described)
        os.rename(temporary, path)
        io.fsync_folder(path.parent)
        mtime = (path / manifest.MANIFEST).stat().st_mtime
    except Exception as e:
        shutil.rmtree(temporary, ignore_errors=True)
        raise fail(reason(e)) from e
    return CheckpointInfo(path=path, step=step, dtype=canonical(dtype), kind="full", mtime=mtime)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


class ShardedCheckpoint:
    """A sharded checkpoint whose manifest and files were checked against the live objects;
    `apply` (a collective) loads each rank's shards into them."""

    sharded = True

    def __init__(self, path: Path, described: dict, mtime: float):
        self.info = CheckpointInfo(path=path, step=described["step"], dtype=described["dtype"], kind="full",
                                   mtime=mtime)
        self.kind, self.step, self.dtype = "full", described["step"], described["dtype"]
        self.world_size = described["world_size"]
        self._manifest = described
        used: set[str] = set()
        self.extra = _decode(described["extra"], {}, used)
        self.scaler_state = _decode(described["scaler"], {}, used)
        sched = described["scheduler"]
        self._scheduler = _decode(sched["state"], {}, used) if sched else None
        self._scheduler_class = sched["class"] if sched else None
        self.notice: str | None = None

    def __repr__(self) -> str:
        return f"ShardedCheckpoint(path={str(self.info.path)!r}, step={self.step!r}, dtype={self.dtype!r})"

    def check(self, model, optimizer, scheduler) -> None:
        """Raise Problem unless the checkpoint fits the live objects (a sharded model seen whole
        or the script's own model before sharding: the names, full shapes and dtypes)."""
        m = self._manifest
        standins = {name: torch.empty((), dtype=getattr(torch, e["dtype"])).expand(e["shape"])
                    for name, e in m["model"].items()}
        checks.check_model(standins, live.model_state(model))
        optim = m["optimizer"]
        index = {name: i for i, name in enumerate(optim["param_names"])}
        try:
            groups = [{"params": [index[n] for n in g["params"]]} for g in optim["param_groups"]]
        except (KeyError, TypeError):
            raise Problem("the optimizer entry of its manifest is malformed") from None
        checks.check_optimizer({"class": optim["class"], "param_shapes": optim["param_shapes"],
                                "param_groups": groups, "state": {}}, optimizer)
        checks.check_scheduler(self._scheduler_class, scheduler)
        if self.extra.get("world_size", self.world_size) != self.world_size:
            raise Problem("its manifest's world sizes disagree: the checkpoint is corrupted")

    def apply(self, model, optimizer, scheduler=None) -> None:
        """Load each rank's shards into the live FSDP2 model and its optimizer, then the scheduler.
        A collective. The RNG states are the caller's (every rank's own, from `extra`)."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        path = self.info.path
        # Fresh tensors of each rank's shard shapes: nothing live changes until all are read.
        tensors, _, _, _ = _flat(model, optimizer, make=torch.empty_like)
        saved = set(self._manifest["tensors"])
        if set(tensors) != saved:
            differ = sorted(saved ^ set(tensors))
            raise CheckpointError(f"cannot restore {path}: the live state differs from the checkpoint's "
                                  f"in {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''}")
        try:
            load(tensors, storage_reader=HuggingFaceStorageReader(str(path)))
        except Exception as e:   # raised on every rank alike
            raise CheckpointError(f"cannot restore {path}: {reason(e)}") from e
        optim = self._manifest["optimizer"]
        used: set[str] = set()
        weights = {k[len("model."):]: t for k, t in tensors.items() if k.startswith("model.")}
        state = {"state": _decode(optim["state"], tensors, used),
                 "param_groups": _decode(optim["param_groups"], {}, used)}
        with torch.no_grad():
            set_model_state_dict(model, weights)
        set_optimizer_state_dict(model, optimizer, state)
        if scheduler is not None and self._scheduler is not None:
            scheduler.load_state_dict(self._scheduler)


def read_sharded(path: Path, *, model, optimizer, scheduler=None) -> ShardedCheckpoint:
    """A sharded checkpoint's folder read (its manifest; the shard files' sizes and digests) and
    checked against the live objects, changing nothing; raises CheckpointError."""
    path = Path(path)
    try:
        described = manifest.read_manifest(path)
        manifest.check_files(path, described)
        mtime = (path / manifest.MANIFEST).stat().st_mtime
        loaded = ShardedCheckpoint(path, described, mtime)
        loaded.check(model, optimizer, scheduler)
    except Problem as e:
        raise CheckpointError(f"cannot restore {path}: {e}") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"cannot restore {path}: its manifest is malformed ({reason(e)})") from None
    if scheduler is not None and loaded._scheduler is None:
        why = described.get("scheduler_note") or "the checkpoint has no scheduler state"
        loaded.notice = f"{why}; the scheduler keeps its current state"
    return loaded


def consolidate(path: Path, output_dir: Path) -> Path:
    """The model weights of a sharded checkpoint as one safetensors file, `output_dir/model.safetensors`,
    named as the model's state_dict names them: what a single process loads
    (`safetensors.torch.load_model`, or amp-tui's restore as a weights-only file). torch's own
    consolidation (`consolidate_safetensors_files`) joins the shards; this process then holds the
    whole weights once, to name them. No collective: run it anywhere the folder can be read."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    path, output_dir = Path(path), Path(output_dir)
    try:
        described = manifest.read_manifest(path)
        manifest.check_files(path, described)
    except Problem as e:
        raise CheckpointError(f"cannot consolidate {path}: {e}") from None
    joined = output_dir / f".consolidating-{os.getpid()}"
    joined.mkdir(parents=True, exist_ok=True)
    try:
        consolidate_safetensors_files(str(path), str(joined), dict.fromkeys(
            (f"model.{name}" for name in described["model"]), 1))
        [single] = [p for p in joined.iterdir() if p.name.endswith(manifest.SHARD_SUFFIX)]
        weights = io.read_file(single)[1]
        target = output_dir / "model.safetensors"
        io.write_atomically(target, {k[len("model."):]: t for k, t in weights.items()}, {"format": "pt"})
    except (OSError, Problem, ValueError) as e:
        raise CheckpointError(f"cannot consolidate {path}: {reason(e)}") from e
    finally:
        shutil.rmtree(joined, ignore_errors=True)
    return target
