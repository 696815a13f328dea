"""fp8 training of a model's nn.Linear layers with torchao, switched on and off at step boundaries.

Each chosen layer becomes torchao's `Float8Linear` in place: the same module object, with its
Parameters and its hooks, given Float8Linear's class and cast settings (those of
`Float8Linear.from_float`, torchao's own conversion). So whatever holds the module stays valid: the
optimizer's state, the probes' hooks, an fp32 module's forward. Back in bf16, the class and the
settings are taken off again, and the weights are the ones fp8 trained.

Which layers: a filter file's `module_filter_fn(module, fqn)` (`--fp8-filter FILE`, the file an fp8
what-if emits), or a what-if's verdict (`choose`), each with torchao's shape rule. A layer that runs
in fp32 (`--fp32-modules`, the autopilot's isolation) is taken out of fp8 while it does.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Callable, Iterable

import torch

from amp_tui.core.precision import FP8_SHAPE_MULTIPLE
from amp_tui.training.compiled import clean_name, original_module

ModuleFilter = Callable[[torch.nn.Module, str], bool]


class Fp8FilterError(ValueError):
    """A filter file that can't be used: missing, not Python, or without `module_filter_fn`."""


def load_filter(path: str | Path) -> ModuleFilter:
    """`module_filter_fn` from the Python file at `path` (as torchao's `convert_to_float8_training`
    takes it)."""
    path = Path(path)
    if not path.is_file():
        raise Fp8FilterError(f"--fp8-filter {path}: no such file")
    try:
        namespace = runpy.run_path(str(path))
    except Exception as exc:  # noqa: BLE001 - the user's file: whatever it raises, named
        raise Fp8FilterError(f"--fp8-filter {path}: {type(exc).__name__}: {exc}") from None
    found = namespace.get("module_filter_fn")
    if not callable(found):
        raise Fp8FilterError(f"--fp8-filter {path} defines no module_filter_fn(module, fqn)")
    return found


def shape_fits(module: torch.nn.Linear) -> bool:
    out_features, in_features = module.weight.shape
    return out_features % FP8_SHAPE_MULTIPLE == 0 and in_features % FP8_SHAPE_MULTIPLE == 0


def verdict_filter(verdict: dict[str, str]) -> ModuleFilter:
    """The filter a what-if's verdict implies: its fp8-ready layers that fit the shape rule."""
    ready = {name for name, said in verdict.items() if said == "fp8"}
    return lambda module, fqn: fqn in ready and shape_fits(module)


def _native(device: torch.device) -> bool:
    """fp8 GEMMs in hardware: NVIDIA from Ada/Hopper (compute capability 8.9) on; emulated elsewhere."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Layers:
    """The model's layers that train in fp8, and the switch between fp8 and bf16."""

    def __init__(self, model: torch.nn.Module, device: torch.device, filter_fn: ModuleFilter | None = None,
                 *, source: str | None = None):
        self.model = original_module(model)
        self.device = torch.device(device)
        self.filter_fn = filter_fn
        self.source = source                    # the filter file, for the record
        self.whatif_step: int | None = None     # ... or the step whose what-if chose (choose())
        self.kept_out: Callable[[], Iterable[str]] = tuple   # the modules that run in fp32
        self.active = False
        # Each converted layer: the module, the class it had, and Float8Linear's attributes set on it.
        self._held: dict[str, tuple[torch.nn.Module, type, tuple[str, ...]]] = {}
        self._config = None
        self._amax: dict[str, list] | None = None   # measure(): each layer's [input, weight, grad_output]
        self._hooks: list = []

    @property
    def chosen(self) -> bool:
        return self.filter_fn is not None

    @property
    def names(self) -> list[str]:
        """The layers that run in fp8 now."""
        return sorted(self._held)

    def choose(self, verdict: dict[str, str], step: int) -> None:
        """The layers `verdict` finds fp8-ready: the what-if of `step`'s."""
        self.filter_fn, self.source, self.whatif_step = verdict_filter(verdict), None, step

    def candidates(self) -> dict[str, torch.nn.Linear]:
        """Every plain nn.Linear by name (a subclass keeps its own forward, which fp8 would lose)."""
        return {clean_name(name): m for name, m in self.model.named_modules() if type(m) is torch.nn.Linear}

    def enter(self) -> list[str]:
        """Convert the chosen layers (those not in fp32); returns their names."""
        if self.filter_fn is None:
            raise RuntimeError("no fp8 filter chosen yet")
        self.active = True
        self.sync()
        return self.names

    def leave(self) -> list[str]:
        """Every layer back to what it was; returns those that were in fp8."""
        names = self.names
        for name in names:
            self._restore(name)
        self.active = False
        return names

    def sync(self) -> None:
        """Follow the fp32 modules: a layer inside one leaves fp8, and comes back when it no longer is."""
        if not self.active:
            return
        fp32 = tuple(self.kept_out())
        inside = lambda name: any(name == f or name.startswith(f + ".") for f in fp32)   # noqa: E731
        for name in [n for n in self._held if inside(n)]:
            self._restore(name)
        for name, module in self.candidates().items():
            if name not in self._held and not inside(name) and self.filter_fn(module, name):
                self._convert(name, module)

    # ---- what the casts scale by ------------------------------------------------------------
    def measure(self) -> None:
        """Keep each fp8 layer's amax this step: of its input, its weight and its output's
        gradient, what torchao's tensorwise casts divide the format's max by for their scale.
        Kept on the device, read by `read_amax()` in one transfer."""
        self._amax = {}
        for name, (module, _, _) in self._held.items():
            self._hooks.append(module.register_forward_hook(self._amax_hook(name)))

    def _amax_hook(self, name: str):
        def hook(module, inputs, output):
            found = self._amax.setdefault(name, [None, None, None])
            _keep_max(found, 0, inputs[0] if inputs else None)
            _keep_max(found, 1, module.weight)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: _keep_max(found, 2, grad))
        return hook

    def read_amax(self) -> dict[str, list[float | None]] | None:
        """The amax `measure()` kept, by layer: [input, weight, grad_output] (None: not seen)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        found, self._amax = self._amax, None
        if not found:
            return None
        values = [v for row in found.values() for v in row if v is not None]
        host = iter(torch.stack(values).tolist()) if values else iter(())
        return {name: [next(host) if v is not None else None for v in row] for name, row in found.items()}

    # ---- one layer ----------------------------------------------------------------------------
    def _float8_config(self):
        if self._config is None:
            # The fp8 extra, imported when fp8 is used.
            from torchao.float8 import Float8LinearConfig
            self._config = Float8LinearConfig(emulate=not _native(self.device))
        return self._config

    def _convert(self, name: str, module: torch.nn.Linear) -> None:
        from torchao.float8.float8_linear import Float8Linear
        made = Float8Linear.from_float(module, self._float8_config())   # shares module's Parameters
        added = tuple(k for k in vars(made) if k not in vars(module))
        for key in added:
            setattr(module, key, vars(made)[key])
        self._held[name] = (module, type(module), added)
        module.__class__ = type(made)

    def _restore(self, name: str) -> None:
        module, cls, added = self._held.pop(name)
        module.__class__ = cls
        for key in added:
            module.__dict__.pop(key, None)


def _keep_max(found: list, slot: int, tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
        return
    amax = tensor.detach().abs().amax().float()
    found[slot] = amax if found[slot] is None else torch.maximum(found[slot], amax)
