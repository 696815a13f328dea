"""The run state as a checkpoint file holds it: tensors under fixed names, everything else as
tagged JSON strings in the safetensors metadata, and a SHA-256 digest of both.

Tensor names: "model.<name>" (a name in the state_dict of the module torch.compile wrapped,
without `_orig_mod` parts; files from before have them and read the same), "optim.<param>.<key>"
(and "sched.…" for tensors in a scheduler's state), "rng.cpu", "rng.cuda.<device>". Metadata:
format, format_version, step, dtype, created, torch_version, extra, scaler, optimizer, scheduler,
[scheduler_note], digest, metadata_digest.
"""

from __future__ import annotations

import ctypes
import datetime
import hashlib
import math
import re
from typing import Any

import torch

from amp_tui.core import jsonsafe
from amp_tui.core.precision import DTYPES
from amp_tui.training.checkpoint.checks import scaler_problem
from amp_tui.training.checkpoint.errors import Problem, Unencodable, few, one_line, reason
from amp_tui.training.checkpoint.live import class_name, cuda_ready, flat_params, model_state, portable_names

FORMAT = "amp-tui-checkpoint"
FORMAT_VERSION = "1"
REQUIRED_METADATA = ("step", "dtype", "extra", "scaler", "optimizer", "scheduler", "digest",
                     "metadata_digest")
_TAGS = ("__tensor__", "__tuple__", "__float__", "__dict__")


# --------------------------------------------------------------------------- JSON with tags
# Optimizer/scheduler state holds tuples (Adam's betas), non-finite floats (ReduceLROnPlateau's
# best=inf), tensors (lr as a tensor) and int-keyed dicts. Plain JSON would lose all of these, so
# they are written as one-key tagged objects; tensors go into the file as tensors.


class _Sink:
    """Collects tensors met while encoding; each gets a unique file name."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def put(self, name: str, tensor: torch.Tensor) -> str:
        unique, n = name, 2
        while unique in self.tensors:
            unique, n = f"{name}~{n}", n + 1
        self.tensors[unique] = snapshot(tensor)
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
            raise Unencodable(f"{name} is a tensor")
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
    raise Unencodable(f"{name} is a {type(obj).__name__}")


def _decode(obj: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, used) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, value),) = obj.items()
        if tag == "__tensor__":
            if not isinstance(value, str) or value not in tensors:
                raise Problem(f"the header refers to tensor {value!r}, which is not in the file")
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
                raise Problem(f"the header holds a malformed dict ({e})") from None
        if tag in _TAGS:
            raise Problem(f"the header holds a malformed {tag} entry")
    return {k: _decode(v, tensors, used) for k, v in obj.items()}


def _dumps(obj: Any) -> str:
    # Python's float repr round-trips exactly through json (65536.0, 2**-24, 1e38 all survive).
    return jsonsafe.dumps(obj)


# --------------------------------------------------------------------------- tensors and digests


def snapshot(t: torch.Tensor) -> torch.Tensor:
    # Always a private CPU copy: the file then matches its digest even if training keeps going,
    # and tied weights (GPT-2's lm_head/wte) no longer share storage, which safetensors forbids.
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def raw_bytes(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor, without a copy (and without numpy, for bf16 too).

    The caller must keep `t` alive while using the result.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return b""
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(_dumps([name, str(t.dtype), list(t.shape)]).encode() + b"\n")
        h.update(raw_bytes(t))
    return h.hexdigest()


def metadata_digest(metadata: dict[str, str]) -> str:
    # Covers every header field (step, scaler, optimizer...) so a flipped byte there is caught.
    items = sorted((k, v) for k, v in metadata.items() if k not in ("digest", "metadata_digest"))
    return hashlib.sha256(_dumps(items).encode()).hexdigest()


# --------------------------------------------------------------------------- encoding


def encode(*, model, optimizer, scheduler, scaler_state: dict | None, step: int, dtype: str,
           extra: dict | None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a full checkpoint; raises Unencodable for state it cannot hold."""
    tensors: dict[str, torch.Tensor] = {}
    for k, v in model_state(model).tensors.items():
        if not isinstance(v, torch.Tensor):
            raise Unencodable(f"model state {k!r} is a {type(v).__name__}, not a tensor")
        tensors[f"model.{k}"] = snapshot(v)
    optim = _encode_optimizer(optimizer, tensors)
    extra_json = _dumps(_encode(extra or {}, None, "extra"))
    scaler_json = _dumps(_encode(scaler_state, None, "scaler state"))

    sched_json, sched_note = "null", None
    if scheduler is not None:
        local: dict[str, torch.Tensor] = {}
        try:
            encoded = {"class": type(scheduler).__name__,
                       "state": _encode(scheduler.state_dict(), _Sink(local), "sched")}
            sched_json = _dumps(encoded)
            tensors.update(local)
        except Exception as e:  # noqa: BLE001 - an odd scheduler must not cost the checkpoint
            sched_note = f"{type(scheduler).__name__} state not saved: {reason(e)}"

    tensors["rng.cpu"] = torch.get_rng_state()
    if cuda_ready():
        for i in range(torch.cuda.device_count()):
            tensors[f"rng.cuda.{i}"] = torch.cuda.get_rng_state(i)

    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": str(step),
        "dtype": dtype,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "extra": extra_json,
        "scaler": scaler_json,
        "optimizer": _dumps(optim),
        "scheduler": sched_json,
    }
    if sched_note:
        metadata["scheduler_note"] = sched_note
    metadata["digest"] = digest(tensors)
    metadata["metadata_digest"] = metadata_digest(metadata)
    return tensors, metadata


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
        "class": class_name(optimizer),
        "param_shapes": [list(p.shape) for p in flat_params(optimizer)],
        "state": state,
        "param_groups": groups,
    }


# --------------------------------------------------------------------------- decoding


def kind(metadata: dict[str, str] | None, names) -> str:
    """ "full", "weights", or raise Problem for files amp-tui cannot restore."""
    meta = metadata or {}
    fmt = meta.get("format")
    if fmt == FORMAT:
        return "full"
    # A damaged amp-tui header must not pass for a weights-only file.
    if "metadata_digest" in meta or "rng.cpu" in names:
        raise Problem("the header is corrupted (its format entry is damaged or missing)")
    if fmt in (None, "pt"):
        return "weights"
    raise Problem(f"it holds {fmt!r} tensors, not a PyTorch model or amp-tui checkpoint")


def check_metadata(meta: dict[str, str]) -> tuple[int, str]:
    """The step and dtype of a full checkpoint's metadata, checked against its digest."""
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise Problem(f"it has checkpoint format version {version!r}; this amp-tui reads version "
                      f"{FORMAT_VERSION}")
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise Problem(f"the header lacks {few(missing)}: the file is corrupted")
    if metadata_digest(meta) != meta["metadata_digest"]:
        raise Problem("the header does not match its digest: the file is corrupted")
    if not re.fullmatch(r"\d+", meta["step"]):
        raise Problem(f"the step in the header is {meta['step']!r}, not a number")
    if meta["dtype"] not in DTYPES:
        raise Problem(f"the dtype in the header is {meta['dtype']!r}, not one of {', '.join(DTYPES)}")
    return int(meta["step"]), meta["dtype"]


def decode(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> tuple[int, str, dict]:
    """Step, dtype and the run state (LoadedCheckpoint's keyword arguments) of a full checkpoint."""
    step, dtype = check_metadata(meta)
    if digest(tensors) != meta["digest"]:
        raise Problem("tensor data does not match its digest: the file is corrupted")

    parsed = {}
    for key in ("extra", "scaler", "optimizer", "scheduler"):
        try:
            parsed[key] = jsonsafe.loads(meta[key], unique_keys=True)
        except ValueError as e:
            raise Problem(f"the {key} entry of the header is not valid JSON ({one_line(e)})") from None

    used: set[str] = set()
    extra = _decode(parsed["extra"], {}, used)
    if not isinstance(extra, dict):
        raise Problem("the extra entry of the header is not a JSON object")
    scaler = _decode(parsed["scaler"], {}, used)
    if scaler is not None:
        problem = scaler_problem(scaler)
        if problem:
            raise Problem(problem)
    optimizer = _decode_optimizer(parsed["optimizer"], tensors, used)
    sched = parsed["scheduler"]
    sched_class = sched_state = None
    if sched is not None:
        if not (isinstance(sched, dict) and isinstance(sched.get("class"), str)
                and isinstance(sched.get("state"), dict)):
            raise Problem("the scheduler entry of the header is malformed")
        sched_class = sched["class"]
        sched_state = _decode(sched["state"], tensors, used)

    weights = saved_weights({k[len("model."):]: t for k, t in tensors.items()
                             if k.startswith("model.")})
    rng_cpu = tensors.get("rng.cpu")
    rng_cuda = {}
    for k, t in tensors.items():
        m = re.fullmatch(r"rng\.cuda\.(\d+)", k)
        if m:
            rng_cuda[int(m.group(1))] = t
    for t in [rng_cpu, *rng_cuda.values()]:
        if t is not None and (t.dtype != torch.uint8 or t.dim() != 1):
            raise Problem("an RNG state in the file is not a byte vector")
    known = used | {k for k in tensors if k.startswith("model.")} | {"rng.cpu"} | {
        f"rng.cuda.{i}" for i in rng_cuda}
    stray = [k for k in tensors if k not in known]
    if stray:
        raise Problem(f"the file holds tensors the header does not explain: {few(stray)}")

    return step, dtype, dict(model_state=weights, optimizer=optimizer, scheduler=sched_state,
                             scheduler_class=sched_class, scheduler_note=meta.get("scheduler_note"),
                             scaler_state=scaler, extra=extra, rng_cpu=rng_cpu, rng_cuda=rng_cuda)


def saved_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A file's model tensors by portable name."""
    portable = portable_names(tensors)
    return {portable[k]: t for k, t in tensors.items()}


def _decode_optimizer(raw: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> dict:
    def bad(what: str) -> Problem:
        return Problem(f"the optimizer entry of the header is malformed ({what})")

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
