"""Load a user's training script and check it against the script contract.

Every problem becomes a ScriptError with one line that names it; the CLI turns that into exit 2
before any run directory exists.
"""

from __future__ import annotations

import importlib.util
import inspect
import numbers
import sys
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

REQUIRED = ("model", "optimizer", "loss_fn", "batches")
OPTIONAL = ("scheduler", "max_grad_norm", "accumulate", "eval_batches", "predict", "fsdp_blocks")


class ScriptError(Exception):
    """A problem in the user's script, worded for the user."""


@dataclass
class SetupContext:
    """What `setup(ctx)` may read: the run's device and the script's own arguments; under
    `--nproc` or torchrun, which rank of how many this process is (shard the data with them)."""

    device: str
    argv: list[str]
    dtype: str = "float16"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


@dataclass
class TrainSetup:
    """What `setup()` returns; a plain dict with the same keys works too."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    batches: Iterable
    scheduler: Any = None
    max_grad_norm: float | None = None
    accumulate: int = 1
    eval_batches: Iterable | None = None
    predict: Callable | None = None
    fsdp_blocks: list | None = None   # --fsdp: the modules to shard one by one (names or classes)
    warnings: list[str] = field(default_factory=list)


def where_in_script(exc: BaseException, script: Path) -> str:
    """' (script.py line N)' for the deepest frame inside the user's file, or ''."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == script.resolve():
            line = frame.lineno
    return f" ({script.name} line {line})" if line else ""


def describe_exception(exc: BaseException, script: Path) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}{': ' + text if text else ''}{where_in_script(exc, script)}"


def import_script(path: str | Path, argv: list[str] | None = None):
    """Import the user's file as `python script.py ARGV...` would run it: `sys.argv` is
    `[script, *argv]` while its module code runs, so argparse at import level sees its own
    arguments, not amp-tui's command line."""
    script = Path(path)
    if not script.exists():
        raise ScriptError(f"script not found: {script}")
    if not script.is_file():
        raise ScriptError(f"script is not a file: {script}")
    spec = importlib.util.spec_from_file_location(f"amp_tui_user_{script.stem}", script)
    if spec is None or spec.loader is None:
        raise ScriptError(f"cannot import {script}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # The script's own folder comes first on sys.path so its sibling modules import.
    sys.path.insert(0, str(script.resolve().parent))
    saved_argv = sys.argv
    sys.argv = [str(script), *(argv or [])]
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ScriptError(f"{script.name} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    except SystemExit as exc:
        raise ScriptError(f"{script.name} called sys.exit({exc.code}) while being imported") from None
    except BaseException as exc:  # noqa: BLE001 - any failure in user code is reported, not dumped
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ScriptError(f"importing {script.name} failed: {describe_exception(exc, script)}") from None
    finally:
        sys.argv = saved_argv
    return module


def _accepts_argument(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _as_mapping(result: Any, script: Path) -> dict:
    if isinstance(result, Mapping):
        return dict(result)
    if result is not None and all(hasattr(result, k) for k in REQUIRED):
        return {k: getattr(result, k) for k in REQUIRED + OPTIONAL if hasattr(result, k)}
    raise ScriptError(
        f"setup() in {script.name} returned {type(result).__name__}; it must return a dict with "
        f"keys {', '.join(REQUIRED)}")


def load_script(path: str | Path, *, device: str, argv: list[str], dtype: str = "float16",
                rank: int = 0, local_rank: int = 0, world_size: int = 1) -> TrainSetup:
    """Import the script, call setup() and validate what it returns."""
    script = Path(path)
    module = import_script(script, argv)
    setup_fn = getattr(module, "setup", None)
    if setup_fn is None:
        raise ScriptError(f"{script.name} has no setup() function; the script contract needs one")
    if not callable(setup_fn):
        raise ScriptError(f"setup in {script.name} is a {type(setup_fn).__name__}, not a function")
    ctx = SetupContext(device=device, argv=list(argv), dtype=dtype, rank=rank, local_rank=local_rank,
                       world_size=world_size)
    saved_argv = sys.argv
    sys.argv = [str(script), *argv]
    try:
        result = setup_fn(ctx) if _accepts_argument(setup_fn) else setup_fn()
    except SystemExit as exc:
        raise ScriptError(f"setup() in {script.name} called sys.exit({exc.code})") from None
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ScriptError(f"setup() in {script.name} raised {describe_exception(exc, script)}") from None
    finally:
        sys.argv = saved_argv
    return validate_setup(_as_mapping(result, script), script)


def untrained_warning(model: torch.nn.Module, optimizer: torch.optim.Optimizer, name: str) -> list[str]:
    """Trainable parameters in no param group get gradients but never an update: say so once."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if not names:
        return []
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return [f"'model' from {name} has trainable parameters in no optimizer param group; they get "
            f"gradients but train nothing: {shown} (set requires_grad=False on them, or give them "
            "to the optimizer)"]


def is_one_shot(batches: Any) -> bool:
    """A generator, map(), iter(list)...: an iterator whose iter() is itself, so it can't start
    over. One of the user's own classes whose __iter__ is Python code may start over in there;
    it is judged when it runs out (BatchFeed). No iter() call here: a DataLoader's starts workers."""
    if not isinstance(batches, Iterator):
        return False
    return not inspect.isfunction(inspect.getattr_static(type(batches), "__iter__", None))


def validate_setup(values: dict, script: Path) -> TrainSetup:
    name = script.name
    missing = [k for k in REQUIRED if k not in values]
    if missing:
        raise ScriptError(f"setup() in {name} returned no {', '.join(repr(k) for k in missing)} "
                          f"(required: {', '.join(REQUIRED)})")
    warnings = [f"setup() returned unknown key {k!r}; it is ignored"
                for k in values if k not in REQUIRED + OPTIONAL]

    model, optimizer = values["model"], values["optimizer"]
    _check_model_and_optimizer(model, optimizer, name)
    warnings += untrained_warning(model, optimizer, name)
    loss_fn = values["loss_fn"]
    if not callable(loss_fn):
        raise ScriptError(f"'loss_fn' from {name} is a {type(loss_fn).__name__}, not callable")
    batches = values["batches"]
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Iterable):
        raise ScriptError(f"'batches' from {name} is a {type(batches).__name__}, not an iterable of batches")
    if is_one_shot(batches):
        raise ScriptError(f"'batches' from {name} is a {type(batches).__name__}, an iterator that can be read "
                          "only once, but amp-tui starts 'batches' over whenever they run out: return the "
                          "list or DataLoader itself (an endless stream: an object whose __iter__ makes a "
                          "new iterator)")

    scheduler = values.get("scheduler")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise ScriptError(f"'scheduler' from {name} has no step() method")
    clip = values.get("max_grad_norm")
    if clip is not None:
        if isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not clip > 0:
            raise ScriptError(f"'max_grad_norm' from {name} must be a positive number, got {clip!r}")
        clip = float(clip)
    accumulate = values.get("accumulate", 1)
    if accumulate is None:
        accumulate = 1
    if isinstance(accumulate, bool) or not isinstance(accumulate, numbers.Integral) or accumulate < 1:
        raise ScriptError(f"'accumulate' from {name} must be a positive integer, got {accumulate!r}")
    predict = values.get("predict")
    if predict is not None and not callable(predict):
        raise ScriptError(f"'predict' from {name} is not callable")
    eval_batches = values.get("eval_batches")
    if eval_batches is not None and not isinstance(eval_batches, Iterable):
        raise ScriptError(f"'eval_batches' from {name} is not an iterable")
    blocks = values.get("fsdp_blocks")
    if blocks is not None and (isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable)):
        raise ScriptError(f"'fsdp_blocks' from {name} must be a list of module names or classes")
    return TrainSetup(model=model, optimizer=optimizer, loss_fn=loss_fn, batches=batches,
                      scheduler=scheduler, max_grad_norm=clip, accumulate=int(accumulate),
                      eval_batches=eval_batches, predict=predict,
                      fsdp_blocks=list(blocks) if blocks is not None else None, warnings=warnings)


def _check_model_and_optimizer(model, optimizer, name: str) -> None:
    """A module with parameters, and an optimizer that steps only the model's."""
    if not isinstance(model, torch.nn.Module):
        raise ScriptError(f"'model' from {name} is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ScriptError(f"'optimizer' from {name} is a {type(optimizer).__name__}, "
                          "not a torch.optim.Optimizer")
    model_params = {id(p) for p in model.parameters()}
    if not model_params:
        raise ScriptError(f"'model' from {name} has no parameters to train")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_params:
                raise ScriptError(f"'optimizer' from {name} holds a parameter that is not in 'model'; "
                                  "build it from model.parameters()")
