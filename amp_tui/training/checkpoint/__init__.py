"""Checkpoints: one safetensors file per save, written atomically and checked before use.

A full checkpoint holds the model weights, the optimizer state, the LR scheduler state, the
GradScaler state, the RNG states and a SHA-256 digest of every tensor. A weights-only file (what
``safetensors.torch.save_model`` writes, e.g. a model downloaded from a hub) can be restored too;
it sets the weights and leaves everything else as it is.

Restoring is two steps so that a bad file never leaves a half-restored run behind:
``read_checkpoint`` reads the file and checks everything against the live model and optimizer
without changing anything; ``LoadedCheckpoint.apply`` then changes the live objects.

Nothing here unpickles: files are read with a strict safetensors parser, and all non-tensor state
is JSON in the safetensors header.
"""

from __future__ import annotations

import copy
import ctypes
import datetime
import hashlib
import itertools
import json
import math
import os
import re
import stat
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from amp_tui.core.precision import DTYPES, canonical

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "WEIGHTS_NOTICE",
    "checkpoint_path",
    "cleanup_temporary_files",
    "list_checkpoints",
    "read_checkpoint",
    "save_checkpoint",
]

FORMAT = "amp-tui-checkpoint"
FORMAT_VERSION = "1"
WEIGHTS_NOTICE = "weights only: optimizer, scaler and RNG keep their current state"

# safetensors refuses headers above 100 MB; anything larger is not a safetensors file.
_MAX_HEADER = 100_000_000
_SUFFIX = ".safetensors"
_TMP_RE = re.compile(r"^\..+\.safetensors\.tmp-(\d+)(?:-\d+)?$")
_REQUIRED_META = ("step", "dtype", "extra", "scaler", "optimizer", "scheduler", "digest",
                  "metadata_digest")
_TAGS = ("__tensor__", "__tuple__", "__float__", "__dict__")

# safetensors dtype names. Optional entries only exist in newer torch builds.
_ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
                     ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        _ST_TO_TORCH[_name] = getattr(torch, _attr)
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}

# Temporary files of saves running in this process, so cleanup never removes one mid-write.
_in_progress: set[str] = set()
_in_progress_lock = threading.Lock()
_tmp_counter = itertools.count(1)


class CheckpointError(Exception):
    """A checkpoint could not be written, read or restored; str(e) is one line naming the file."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int | None  # None for a weights-only file
    dtype: str | None  # "float16" | "bfloat16" | "float32", None for a weights-only file
    kind: str  # "full" or "weights"
    mtime: float


class _Bad(Exception):
    """Internal: a problem with the file; the caller adds the file name."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return _one_line(str(exc)) or type(exc).__name__


def _few(names, limit: int = 3) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_little_endian() -> None:
    # safetensors stores little-endian bytes and we copy raw memory both ways.
    if sys.byteorder != "little":
        raise _Bad("checkpoints need a little-endian machine")


# --------------------------------------------------------------------------- JSON with tags
# Optimizer/scheduler state holds tuples (Adam's betas), non-finite floats (ReduceLROnPlateau's
# best=inf), tensors (lr as a tensor) and int-keyed dicts. Plain JSON would lose all of these, so
# they are written as one-key tagged objects; tensors go into the file as tensors.


class _Unencodable(Exception):
    pass


class _Sink:
    """Collects tensors met while encoding; each gets a unique file name."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def put(self, name: str, tensor: torch.Tensor) -> str:
        unique, n = name, 2
        while unique in self.tensors:
            unique, n = f"{name}~{n}", n + 1
        self.tensors[unique] = _snapshot(tensor)
        return unique


def _encode(obj: Any, sink: _Sink | None, name: str) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        return {"__float__": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, torch.Tensor):
        if sink is None:
            raise _Unencodable(f"{name} is a tensor")
        return {"__tensor__": sink.put(name, obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, sink, f"{name}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, sink, f"{name}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: _encode(v, sink, f"{name}.{k}") for k, v in obj.items()}
        return {"__dict__": [[_encode(k, None, f"{name} key"), _encode(v, sink, f"{name}.{k}")]
                             for k, v in obj.items()]}
    raise _Unencodable(f"{name} is a {type(obj).__name__}")


def _decode(obj: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, used) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, value),) = obj.items()
        if tag == "__tensor__":
            if not isinstance(value, str) or value not in tensors:
                raise _Bad(f"the header refers to tensor {value!r}, which is not in the file")
            used.add(value)
            return tensors[value]
        if tag == "__tuple__" and isinstance(value, list):
            return tuple(_decode(v, tensors, used) for v in value)
        if tag == "__float__" and value in ("nan", "inf", "-inf"):
            return float(value)
        if tag == "__dict__" and isinstance(value, list):
            try:
                return {_decode(k, tensors, used): _decode(v, tensors, used) for k, v in value}
            except (TypeError, ValueError) as e:
                raise _Bad(f"the header holds a malformed dict ({e})") from None
        if tag in _TAGS:
            raise _Bad(f"the header holds a malformed {tag} entry")
    return {k: _decode(v, tensors, used) for k, v in obj.items()}


def _dumps(obj: Any) -> str:
    # Python's float repr round-trips exactly through json (65536.0, 2**-24, 1e38 all survive).
    return json.dumps(obj, allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def _strict_pairs(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"duplicate key {_few({k for k in keys if keys.count(k) > 1}, 1)}")
    return dict(pairs)


def _reject_constant(token: str):
    raise ValueError(f"non-standard JSON token {token}")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_strict_pairs)


# --------------------------------------------------------------------------- raw tensor bytes


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    # Always a private CPU copy: the file then matches its digest even if training keeps going,
    # and tied weights (GPT-2's lm_head/wte) no longer share storage, which safetensors forbids.
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def _raw(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor, without a copy (and without numpy, for bf16 too).

    The caller must keep `t` alive while using the result.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return b""
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(_dumps([name, str(t.dtype), list(t.shape)]).encode() + b"\n")
        h.update(_raw(t))
    return h.hexdigest()


def _metadata_digest(metadata: dict[str, str]) -> str:
    # Covers every header field (step, scaler, optimizer...) so a flipped byte there is caught.
    items = sorted((k, v) for k, v in metadata.items() if k not in ("digest", "metadata_digest"))
    return hashlib.sha256(_dumps(items).encode()).hexdigest()


# --------------------------------------------------------------------------- safetensors I/O
# Written here rather than with safetensors.torch.save_file: since safetensors 0.8 that needs
# numpy, which amp-tui does not depend on. The layout is the standard one and the tests check
# that safetensors itself reads these files back.


def _write_safetensors(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    _check_little_endian()
    # Larger elements first, as safetensors does, so every tensor is aligned for mmap readers.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _TORCH_TO_ST:
            raise _Unencodable(f"tensor {name} has dtype {_dtype_name(t.dtype)}, "
                               "which safetensors cannot store")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name in order:
        f.write(_raw(tensors[name]))


@dataclass
class _Header:
    metadata: dict[str, str] | None
    entries: dict[str, tuple[torch.dtype, list[int], int, int]]  # name -> dtype, shape, begin, end
    data_start: int
    data_len: int


def _parse_header(f, size: int) -> _Header:
    """Read and check a safetensors header from an open file of `size` bytes."""
    if size == 0:
        raise _Bad("the file is empty")
    if size < 10:  # 8-byte length + "{}" is the smallest safetensors file
        raise _Bad(f"the file is only {size} bytes: it was cut off or is not a safetensors file")
    f.seek(0)
    prefix = f.read(9)
    if len(prefix) < 9:
        raise _Bad("the file changed while it was being read")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n < 2 or n > _MAX_HEADER or n > size - 8 or prefix[8:9] != b"{":
        # Not a plausible safetensors header: say what the file looks like instead.
        if prefix[0] == 0x80 and 2 <= prefix[1] <= 5:
            raise _Bad("it is a pickle file, not safetensors (amp-tui never unpickles files)")
        if prefix.startswith(b"PK\x03\x04"):
            raise _Bad("it is a zip archive (torch.save format?), not safetensors")
        if n <= _MAX_HEADER and n > size - 8:
            raise _Bad(f"the header is cut off ({size - 8} of {n} bytes): the file is "
                       "truncated or not a safetensors file")
        raise _Bad("it is not a safetensors file")
    raw = prefix[8:] + f.read(n - 1)
    if len(raw) != n:
        raise _Bad("the file changed while it was being read")
    try:
        header = _loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _Bad(f"the header is corrupted ({_one_line(e)})") from None
    if not isinstance(header, dict):
        raise _Bad("the header is corrupted (not a JSON object)")

    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise _Bad("the header is corrupted (__metadata__ is not a map of strings)")

    entries = {}
    for name, e in header.items():
        ok = (isinstance(e, dict) and set(e) == {"dtype", "shape", "data_offsets"}
              and isinstance(e["shape"], list) and isinstance(e["data_offsets"], list)
              and len(e["data_offsets"]) == 2
              and all(type(x) is int and x >= 0 for x in e["shape"] + e["data_offsets"]))
        if not ok:
            raise _Bad(f"the header is corrupted (bad entry for tensor {name!r})")
        dtype = _ST_TO_TORCH.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dtype is None:
            raise _Bad(f"tensor {name!r} has dtype {e['dtype']!r}, which amp-tui cannot read")
        begin, end = e["data_offsets"]
        numel = math.prod(e["shape"])
        if end - begin != numel * torch.empty((), dtype=dtype).element_size():
            raise _Bad(f"the header is corrupted (tensor {name!r} has the wrong byte size)")
        entries[name] = (dtype, e["shape"], begin, end)

    # Tensors must tile the data section exactly, as safetensors requires.
    expected = 0
    for _, _, begin, end in sorted(entries.values(), key=lambda v: (v[2], v[3])):
        if begin != expected:
            raise _Bad("the header is corrupted (tensor data offsets overlap or leave gaps)")
        expected = end
    data_len = size - 8 - n
    if data_len < expected:
        raise _Bad(f"the tensor data is cut off ({data_len} of {expected} bytes): the file is "
                   "truncated, probably by an interrupted save or copy")
    if data_len > expected:
        raise _Bad(f"the file has {data_len - expected} unexpected bytes after the tensor data")
    return _Header(metadata, entries, 8 + n, data_len)


def _open_regular(path: Path):
    try:
        st = path.stat()
    except FileNotFoundError:
        raise _Bad("the file does not exist") from None
    except OSError as e:
        raise _Bad(_reason(e)) from None
    if stat.S_ISDIR(st.st_mode):
        raise _Bad("it is a folder, not a checkpoint file")
    if not stat.S_ISREG(st.st_mode):
        raise _Bad("it is not a regular file")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise _Bad(_reason(e)) from None
    return f


def _read_file(path: Path) -> tuple[_Header, dict[str, torch.Tensor], float]:
    _check_little_endian()
    f = _open_regular(path)
    with f:
        try:
            st = os.fstat(f.fileno())
            head = _parse_header(f, st.st_size)
            # Read into memory once: checks and apply then use the same bytes even if the file
            # is replaced or truncated meanwhile (an mmap would crash on truncation).
            buf = bytearray(head.data_len)
            got = f.readinto(buf) if head.data_len else 0
        except OSError as e:
            raise _Bad(f"could not read it ({_reason(e)})") from None
    if got != head.data_len:
        raise _Bad("the file changed while it was being read")
    tensors = {}
    for name, (dtype, shape, begin, end) in head.entries.items():
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=begin)
            tensors[name] = raw.view(dtype).reshape(shape)
    return head, tensors, st.st_mtime


# --------------------------------------------------------------------------- checks


def _scaler_problem(state: Any) -> str | None:
    if not isinstance(state, dict):
        return f"the scaler state is a {type(state).__name__}, not a dict"
    if not state:
        return None  # a disabled GradScaler's state_dict() is {}
    if "scale" not in state:
        return "the scaler state has no 'scale'"
    # key -> (must be an int, smallest allowed value is 0 rather than just above 0)
    rules = {"scale": (False, False), "growth_factor": (False, False),
             "backoff_factor": (False, False), "growth_interval": (True, False),
             "_growth_tracker": (True, True)}
    for key, (integer, zero_ok) in rules.items():
        if key not in state:
            continue
        value = state[key]
        kinds = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return f"scaler {key} is {value!r}, not {'an integer' if integer else 'a number'}"
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            return f"scaler {key} is {value!r}; it must be finite and {'>= 0' if zero_ok else '> 0'}"
    return None


def _aliases(live: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """Names of the live state_dict that are the very same tensor (tied weights)."""
    groups: dict[tuple, list[str]] = {}
    for k, t in live.items():
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype,
                   tuple(t.shape), t.stride())
            groups.setdefault(key, []).append(k)
    return {k: set(g) - {k} for g in groups.values() if len(g) > 1 for k in g}


def _flat_params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


# --------------------------------------------------------------------------- loaded checkpoint


class LoadedCheckpoint:
    """A checkpoint read into memory and checked; `apply` restores it onto live objects."""

    def __init__(self, info: CheckpointInfo, *, model_state: dict[str, torch.Tensor],
                 optimizer: dict | None = None, scheduler: dict | None = None,
                 scheduler_class: str | None = None, scheduler_note: str | None = None,
                 scaler_state: dict | None = None, extra: dict | None = None,
                 rng_cpu: torch.Tensor | None = None,
                 rng_cuda: dict[int, torch.Tensor] | None = None):
        self.info = info
        self.kind = info.kind
        self.step = info.step
        self.dtype = info.dtype
        self.scaler_state = scaler_state
        self.extra = extra if extra is not None else {}
        self.notice: str | None = WEIGHTS_NOTICE if info.kind == "weights" else None
        self._model_state = model_state
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._scheduler_class = scheduler_class
        self._scheduler_note = scheduler_note
        self._rng_cpu = rng_cpu
        self._rng_cuda = rng_cuda or {}

    def __repr__(self) -> str:
        return (f"LoadedCheckpoint(path={str(self.info.path)!r}, kind={self.kind!r}, "
                f"step={self.step!r}, dtype={self.dtype!r})")

    # -- checks against live objects (change nothing)

    def _check(self, model, optimizer, scheduler) -> dict[str, str]:
        """Raise _Bad if this checkpoint cannot be applied; return the alias plan for weights."""
        aliases = self._check_model(model)
        if self.kind == "full":
            self._check_optimizer(optimizer)
            if scheduler is not None and self._scheduler is not None:
                live = type(scheduler).__name__
                if live != self._scheduler_class:
                    raise _Bad(f"the scheduler was a {self._scheduler_class} when saved, "
                               f"but the live scheduler is a {live}")
            self._check_rng()
        return aliases

    def _check_model(self, model) -> dict[str, str]:
        live = model.state_dict()
        odd = [k for k, v in live.items() if not isinstance(v, torch.Tensor)]
        if odd:
            raise _Bad(f"the model has non-tensor state {_few(odd)}, which checkpoints cannot hold")
        saved = self._model_state
        # Like safetensors.torch.load_model: a name missing from the file is fine when it is
        # the same tensor as a name that is present (save_model keeps one name per tied pair).
        tied = _aliases(live)
        plan, missing = {}, []
        for k in live:
            if k in saved:
                continue
            twin = sorted(a for a in tied.get(k, ()) if a in saved)
            if twin:
                plan[k] = twin[0]
            else:
                missing.append(k)
        unexpected = [k for k in saved if k not in live]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing {_few(missing)}")
            if unexpected:
                parts.append(f"unexpected {_few(unexpected)}")
            raise _Bad("the weights do not match the model: " + "; ".join(parts))
        shapes = [k for k in saved if tuple(saved[k].shape) != tuple(live[k].shape)]
        if shapes:
            k = shapes[0]
            more = f" (and {len(shapes) - 1} more)" if len(shapes) > 1 else ""
            raise _Bad(f"model tensor {k!r} has shape {list(saved[k].shape)} in the file but "
                       f"{list(live[k].shape)} in the model{more}")
        dtypes = [k for k in saved if saved[k].dtype != live[k].dtype]
        if dtypes:
            k = dtypes[0]
            more = f" (and {len(dtypes) - 1} more)" if len(dtypes) > 1 else ""
            raise _Bad(f"model tensor {k!r} is {_dtype_name(saved[k].dtype)} in the file but "
                       f"{_dtype_name(live[k].dtype)} in the model{more}")
        return plan

    def _check_optimizer(self, optimizer) -> None:
        saved = self._optimizer
        live_class = type(optimizer).__name__
        if saved["class"] != live_class:
            raise _Bad(f"the optimizer was {saved['class']} when saved, but the live optimizer "
                       f"is {live_class}")
        groups, saved_groups = optimizer.param_groups, saved["param_groups"]
        if len(groups) != len(saved_groups):
            raise _Bad(f"the file has {len(saved_groups)} optimizer parameter groups, the live "
                       f"optimizer has {len(groups)}")
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise _Bad(f"optimizer parameter group {i} has {len(sg['params'])} parameters "
                           f"in the file but {len(g['params'])} in the live optimizer")
        params = _flat_params(optimizer)
        for i, (p, shape) in enumerate(zip(params, saved["param_shapes"])):
            if list(p.shape) != shape:
                raise _Bad(f"optimizer parameter {i} has shape {shape} in the file but "
                           f"{list(p.shape)} in the live optimizer")
        index = {idx: pos for pos, idx in enumerate(i for sg in saved_groups for i in sg["params"])}
        for idx, pstate in saved["state"].items():
            live_state = optimizer.state.get(params[index[idx]], {})
            for key, value in pstate.items():
                have = live_state.get(key)
                # Without live state (a fresh optimizer) there is nothing to compare with; the
                # parameter shapes above and the digest already vouch for the saved state.
                if (isinstance(value, torch.Tensor) and isinstance(have, torch.Tensor)
                        and value.shape != have.shape):
                    raise _Bad(f"optimizer state {key!r} of parameter {idx} has shape "
                               f"{list(value.shape)} in the file but {list(have.shape)} in the "
                               "live optimizer")

    def _check_rng(self) -> None:
        if self._rng_cpu is not None:
            live = torch.get_rng_state()
            if self._rng_cpu.dtype != live.dtype or self._rng_cpu.shape != live.shape:
                raise _Bad("the CPU RNG state in the file has the wrong size")
        if self._rng_cuda and _cuda_ready():
            for i, state in self._rng_cuda.items():
                if i < torch.cuda.device_count():
                    live = torch.cuda.get_rng_state(i)
                    if state.dtype != live.dtype or state.shape != live.shape:
                        raise _Bad(f"the CUDA RNG state of device {i} has the wrong size")

    # -- apply

    def apply(self, model, optimizer, scheduler=None) -> None:
        """Restore onto the live objects: weights; for full checkpoints also the optimizer,
        the scheduler (if saved and given) and the RNG states.

        Everything is checked and prepared first, so a file that read_checkpoint accepted is
        not left half-applied.
        """
        try:
            plan = self._check(model, optimizer, scheduler)
        except _Bad as e:
            raise CheckpointError(f"cannot restore {self.info.path}: {e}") from None

        weights = dict(self._model_state)
        for alias, present in plan.items():
            weights[alias] = self._model_state[present]

        if self.kind == "full":
            osd = self._optimizer_state_dict(optimizer)
            sched = (copy.deepcopy(self._scheduler)
                     if scheduler is not None and self._scheduler is not None else None)
            cuda = ({i: s for i, s in self._rng_cuda.items() if i < torch.cuda.device_count()}
                    if self._rng_cuda and _cuda_ready() else {})

        with torch.no_grad():
            model.load_state_dict(weights, strict=True)
        if self.kind != "full":
            return
        optimizer.load_state_dict(osd)
        if sched is not None:
            scheduler.load_state_dict(sched)
        if self._rng_cpu is not None:
            torch.set_rng_state(self._rng_cpu.clone())
        for i, state in cuda.items():
            torch.cuda.set_rng_state(state.clone(), i)

    def _optimizer_state_dict(self, optimizer) -> dict:
        saved = self._optimizer

        def fresh(value):
            # Clones so the optimizer owns its state (no views into the file buffer, and a
            # second apply starts from the file's values again).
            if isinstance(value, torch.Tensor):
                return value.clone()
            if isinstance(value, tuple):
                return tuple(fresh(v) for v in value)
            if isinstance(value, list):
                return [fresh(v) for v in value]
            if isinstance(value, dict):
                return {k: fresh(v) for k, v in value.items()}
            return value

        groups = []
        for live, sg in zip(optimizer.param_groups, saved["param_groups"]):
            group = fresh(sg)
            for key, value in group.items():
                # A tensor hyperparameter (lr as a tensor) goes back to where the live one lives.
                have = live.get(key)
                if isinstance(value, torch.Tensor) and isinstance(have, torch.Tensor):
                    group[key] = value.to(have.device)
            groups.append(group)
        return {"state": {idx: fresh(s) for idx, s in saved["state"].items()},
                "param_groups": groups}


def _cuda_ready() -> bool:
    # Only touch CUDA RNG when CUDA is already in use: setting it before initialisation is
    # deferred by torch and would fail later, far from here.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


# --------------------------------------------------------------------------- public functions


def checkpoint_path(folder: Path, step: int) -> Path:
    """folder/"step-0000123.safetensors", or "-2", "-3"... if that name is taken."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    folder = Path(folder)
    base = f"step-{step:07d}"
    path, n = folder / f"{base}{_SUFFIX}", 2
    while path.exists():
        path, n = folder / f"{base}-{n}{_SUFFIX}", n + 1
    return path


def save_checkpoint(path: Path, *, model, optimizer, scheduler=None, scaler_state: dict | None,
                    step: int, dtype: str, extra: dict | None = None) -> CheckpointInfo:
    """Write a full checkpoint atomically: either the complete file appears at `path` or
    nothing changes (earlier checkpoints are never touched)."""
    path = Path(path)

    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"could not write checkpoint {path}: {problem}")

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise fail(f"step must be a non-negative integer, got {step!r}")
    try:
        dtype_name = canonical(dtype)
    except ValueError as e:
        raise fail(str(e)) from None
    if scaler_state is not None:
        problem = _scaler_problem(scaler_state)
        if problem:
            # Such a file would be refused on restore, so don't write it.
            raise fail(problem)
    if extra is not None and not isinstance(extra, dict):
        raise fail(f"extra must be a dict, got {type(extra).__name__}")

    tensors: dict[str, torch.Tensor] = {}
    try:
        for k, v in model.state_dict().items():
            if not isinstance(v, torch.Tensor):
                raise _Unencodable(f"model state {k!r} is a {type(v).__name__}, not a tensor")
            tensors[f"model.{k}"] = _snapshot(v)
        optim = _encode_optimizer(optimizer, tensors)
        extra_json = _dumps(_encode(extra or {}, None, "extra"))
        scaler_json = _dumps(_encode(scaler_state, None, "scaler state"))
    except _Unencodable as e:
        raise fail(f"{e} (not JSON-serialisable)") from None

    sched_json, sched_note = "null", None
    if scheduler is not None:
        local: dict[str, torch.Tensor] = {}
        try:
            encoded = {"class": type(scheduler).__name__,
                       "state": _encode(scheduler.state_dict(), _Sink(local), "sched")}
            sched_json = _dumps(encoded)
            tensors.update(local)
        except Exception as e:  # noqa: BLE001 - an odd scheduler must not cost the checkpoint
            sched_note = f"{type(scheduler).__name__} state not saved: {_reason(e)}"

    tensors["rng.cpu"] = torch.get_rng_state()
    if _cuda_ready():
        for i in range(torch.cuda.device_count()):
            tensors[f"rng.cuda.{i}"] = torch.cuda.get_rng_state(i)

    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": str(step),
        "dtype": dtype_name,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "extra": extra_json,
        "scaler": scaler_json,
        "optimizer": _dumps(optim),
        "scheduler": sched_json,
    }
    if sched_note:
        metadata["scheduler_note"] = sched_note
    metadata["digest"] = _digest(tensors)
    metadata["metadata_digest"] = _metadata_digest(metadata)

    _atomic_write(path, tensors, metadata, fail)
    try:
        mtime = path.stat().st_mtime
    except OSError as e:
        raise fail(f"it vanished right after saving ({_reason(e)})") from None
    return CheckpointInfo(path=path, step=step, dtype=dtype_name, kind="full", mtime=mtime)


def _encode_optimizer(optimizer, tensors: dict[str, torch.Tensor]) -> dict:
    sd = optimizer.state_dict()
    sink = _Sink(tensors)
    state = {}
    for idx, pstate in sd["state"].items():
        state[str(idx)] = {key: _encode(value, sink, f"optim.{idx}.{key}")
                           for key, value in pstate.items()}
    groups = []
    for g, group in enumerate(sd["param_groups"]):
        groups.append({key: _encode(value, sink, f"optim.group.{g}.{key}")
                       for key, value in group.items()})
    return {
        "class": type(optimizer).__name__,
        "param_shapes": [list(p.shape) for p in _flat_params(optimizer)],
        "state": state,
        "param_groups": groups,
    }


def _atomic_write(path: Path, tensors, metadata, fail) -> None:
    folder = path.parent
    # Same folder as the target so os.replace is an atomic rename, never a cross-device copy.
    tmp = folder / f".{path.name}.tmp-{os.getpid()}-{next(_tmp_counter)}"
    with _in_progress_lock:
        _in_progress.add(tmp.name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            _write_safetensors(f, tensors, metadata)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(e, Exception):
            raise fail(_reason(e)) from e
        raise
    finally:
        with _in_progress_lock:
            _in_progress.discard(tmp.name)
    # Make the rename itself durable; not possible on every platform/filesystem.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_checkpoint(path: Path, *, model, optimizer, scheduler=None) -> LoadedCheckpoint:
    """Read a checkpoint and check it against the live objects, changing nothing.

    Raises CheckpointError naming the file and the problem.
    """
    path = Path(path)
    try:
        ckpt = _load(path)
        ckpt._check(model, optimizer, scheduler)
    except _Bad as e:
        raise CheckpointError(f"cannot restore {path}: {e}") from None
    if ckpt.kind == "full" and scheduler is not None and ckpt._scheduler is None:
        why = ckpt._scheduler_note or "the checkpoint has no scheduler state"
        ckpt.notice = f"{why}; the scheduler keeps its current state"
    return ckpt


def _load(path: Path) -> LoadedCheckpoint:
    head, tensors, mtime = _read_file(path)
    kind = _kind(head)
    if kind == "weights":
        info = CheckpointInfo(path=path, step=None, dtype=None, kind="weights", mtime=mtime)
        return LoadedCheckpoint(info, model_state=tensors)
    meta = head.metadata

    step, dtype = _check_full_metadata(meta)
    if _digest(tensors) != meta["digest"]:
        raise _Bad("tensor data does not match its digest: the file is corrupted")

    parsed = {}
    for key in ("extra", "scaler", "optimizer", "scheduler"):
        try:
            parsed[key] = _loads(meta[key])
        except ValueError as e:
            raise _Bad(f"the {key} entry of the header is not valid JSON ({_one_line(e)})") from None

    used: set[str] = set()
    extra = _decode(parsed["extra"], {}, used)
    if not isinstance(extra, dict):
        raise _Bad("the extra entry of the header is not a JSON object")
    scaler = _decode(parsed["scaler"], {}, used)
    if scaler is not None:
        problem = _scaler_problem(scaler)
        if problem:
            raise _Bad(problem)
    optimizer = _parse_optimizer(parsed["optimizer"], tensors, used)
    sched = parsed["scheduler"]
    sched_class = sched_state = None
    if sched is not None:
        if not (isinstance(sched, dict) and isinstance(sched.get("class"), str)
                and isinstance(sched.get("state"), dict)):
            raise _Bad("the scheduler entry of the header is malformed")
        sched_class = sched["class"]
        sched_state = _decode(sched["state"], tensors, used)

    model_state = {k[len("model."):]: t for k, t in tensors.items() if k.startswith("model.")}
    rng_cpu = tensors.get("rng.cpu")
    rng_cuda = {}
    for k, t in tensors.items():
        m = re.fullmatch(r"rng\.cuda\.(\d+)", k)
        if m:
            rng_cuda[int(m.group(1))] = t
    for t in [rng_cpu, *rng_cuda.values()]:
        if t is not None and (t.dtype != torch.uint8 or t.dim() != 1):
            raise _Bad("an RNG state in the file is not a byte vector")
    known = used | {f"model.{k}" for k in model_state} | {"rng.cpu"} | {
        f"rng.cuda.{i}" for i in rng_cuda}
    stray = [k for k in tensors if k not in known]
    if stray:
        raise _Bad(f"the file holds tensors the header does not explain: {_few(stray)}")

    info = CheckpointInfo(path=path, step=step, dtype=dtype, kind="full", mtime=mtime)
    return LoadedCheckpoint(info, model_state=model_state, optimizer=optimizer,
                            scheduler=sched_state, scheduler_class=sched_class,
                            scheduler_note=meta.get("scheduler_note"), scaler_state=scaler,
                            extra=extra, rng_cpu=rng_cpu, rng_cuda=rng_cuda)


def _kind(head: _Header) -> str:
    """ "full", "weights", or raise _Bad for files amp-tui cannot restore."""
    meta = head.metadata or {}
    fmt = meta.get("format")
    if fmt == FORMAT:
        return "full"
    # A damaged amp-tui header must not pass for a weights-only file.
    if "metadata_digest" in meta or "rng.cpu" in head.entries:
        raise _Bad("the header is corrupted (its format entry is damaged or missing)")
    if fmt in (None, "pt"):
        return "weights"
    raise _Bad(f"it holds {fmt!r} tensors, not a PyTorch model or amp-tui checkpoint")


def _check_full_metadata(meta: dict[str, str]) -> tuple[int, str]:
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise _Bad(f"it has checkpoint format version {version!r}; this amp-tui reads version "
                   f"{FORMAT_VERSION}")
    missing = [k for k in _REQUIRED_META if k not in meta]
    if missing:
        raise _Bad(f"the header lacks {_few(missing)}: the file is corrupted")
    if _metadata_digest(meta) != meta["metadata_digest"]:
        raise _Bad("the header does not match its digest: the file is corrupted")
    if not re.fullmatch(r"\d+", meta["step"]):
        raise _Bad(f"the step in the header is {meta['step']!r}, not a number")
    if meta["dtype"] not in DTYPES:
        raise _Bad(f"the dtype in the header is {meta['dtype']!r}, not one of {', '.join(DTYPES)}")
    return int(meta["step"]), meta["dtype"]


def _parse_optimizer(raw: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> dict:
    def bad(what: str) -> _Bad:
        return _Bad(f"the optimizer entry of the header is malformed ({what})")

    if not (isinstance(raw, dict) and isinstance(raw.get("class"), str)
            and isinstance(raw.get("param_shapes"), list)
            and isinstance(raw.get("state"), dict) and isinstance(raw.get("param_groups"), list)):
        raise bad("missing fields")
    shapes = raw["param_shapes"]
    if not all(isinstance(s, list) and all(type(x) is int and x >= 0 for x in s) for s in shapes):
        raise bad("parameter shapes")
    groups = _decode(raw["param_groups"], tensors, used)
    indices = []
    for g in groups:
        if not (isinstance(g, dict) and isinstance(g.get("params"), list)
                and all(type(i) is int for i in g["params"])):
            raise bad("parameter groups")
        indices.extend(g["params"])
    if len(indices) != len(set(indices)) or len(indices) != len(shapes):
        raise bad("parameter indices")
    state = {}
    for idx, pstate in raw["state"].items():
        if not re.fullmatch(r"\d+", idx) or int(idx) not in indices or not isinstance(pstate, dict):
            raise bad(f"state for parameter {idx!r}")
        state[int(idx)] = _decode(pstate, tensors, used)
    return {"class": raw["class"], "param_shapes": shapes, "state": state, "param_groups": groups}


def _peek(path: Path) -> CheckpointInfo | None:
    """Header-only look at a file; None if it is not a restorable checkpoint."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None
            head = _parse_header(f, st.st_size)
    except (OSError, _Bad):
        return None
    try:
        if _kind(head) == "weights":
            return CheckpointInfo(path=path, step=None, dtype=None, kind="weights",
                                  mtime=st.st_mtime)
        step, dtype = _check_full_metadata(head.metadata)
    except _Bad:
        return None
    return CheckpointInfo(path=path, step=step, dtype=dtype, kind="full", mtime=st.st_mtime)


def _is_temporary(name: str) -> bool:
    return name.startswith(".") or ".tmp" in name


def checkpoint_files(folder: Path) -> list[Path]:
    """Every checkpoint file in `folder`, readable or not (temporary files of saves left out)."""
    try:
        return sorted(Path(e.path) for e in os.scandir(folder)
                      if e.name.endswith(_SUFFIX) and not _is_temporary(e.name))
    except OSError:
        return []


def list_checkpoints(folder: Path) -> list[CheckpointInfo]:
    """Checkpoints in `folder`, newest first (highest step, then latest mtime; weights-only
    files, which have no step, after the full ones). Reads headers only; skips temporary,
    partial and unreadable files."""
    folder = Path(folder)
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise CheckpointError(f"cannot list checkpoints in {folder}: {_reason(e)}") from None
    infos = []
    for entry in entries:
        if not entry.name.endswith(_SUFFIX) or _is_temporary(entry.name):
            continue
        info = _peek(Path(entry.path))
        if info is not None:
            infos.append(info)
    infos.sort(key=lambda i: (i.step is not None, i.step or 0, i.mtime), reverse=True)
    return infos


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own saves are tracked in _in_progress
    if os.name != "posix":
        return False  # os.kill would terminate it on Windows; open files can't be removed there
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def cleanup_temporary_files(folder: Path) -> int:
    """Remove temporary files left by interrupted saves; return how many were removed.

    Files of saves still running (in this process, or in another live process) are kept.
    """
    folder = Path(folder)
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    except OSError as e:
        raise CheckpointError(f"cannot clean up {folder}: {_reason(e)}") from None
    removed = 0
    for entry in entries:
        m = _TMP_RE.match(entry.name)
        if not m or not entry.is_file(follow_symlinks=False):
            continue
        with _in_progress_lock:
            busy = entry.name in _in_progress
        if busy or _pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed += 1
    return removed
