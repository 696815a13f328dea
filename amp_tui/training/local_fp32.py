"""Local fp32: run chosen modules with autocast off and their inputs cast to float32.

This is the usual remedy for one op that overflows under autocast (disable autocast locally around
it), applied by module name (fnmatch patterns such as ``blocks.*.attn``) without touching the
user's code.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any

import torch

from amp_tui.training.compiled import clean_name, original_module


class ModuleMatchError(ValueError):
    pass


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype != torch.float32 else value
    if isinstance(value, tuple):
        return tuple(_to_fp32(v) for v in value)
    if isinstance(value, list):
        return [_to_fp32(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def named_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules by name, in the original module's terms when torch.compile wrapped some."""
    out: dict[str, torch.nn.Module] = {}
    for name, module in original_module(model).named_modules():
        out.setdefault(clean_name(name), original_module(module))
    return out


def match_modules(model: torch.nn.Module, pattern: str) -> list[str]:
    names = [n for n in named_modules(model) if n]
    return [n for n in names if n == pattern or fnmatch.fnmatchcase(n, pattern)]


class LocalFp32:
    """Keeps track of which modules run in fp32, so they can be added and removed live."""

    def __init__(self, model: torch.nn.Module, device_type: str):
        self._model = model
        self._device_type = device_type
        self._modules = named_modules(model)
        self._originals: dict[str, Any] = {}
        self.patterns: list[str] = []

    @property
    def names(self) -> list[str]:
        return sorted(self._originals)

    def add(self, pattern: str) -> list[str]:
        """Run every module matching `pattern` in fp32; returns the names newly switched."""
        matched = match_modules(self._model, pattern)
        if not matched:
            raise ModuleMatchError(f"--fp32-modules {pattern!r} matches no module of the model")
        if pattern not in self.patterns:
            self.patterns.append(pattern)
        added = []
        for name in matched:
            if name in self._originals or any(name.startswith(o + ".") for o in self._originals):
                continue  # already fp32, or inside a module that is
            module = self._modules[name]
            self._originals[name] = module.__dict__.get("forward")
            module.forward = self._wrap(module.forward)
            added.append(name)
        return added

    def remove(self, pattern: str) -> list[str]:
        removed = []
        for name in match_modules(self._model, pattern):
            if name in self._originals:
                module = self._modules[name]
                original = self._originals.pop(name)
                if original is None:
                    del module.forward  # back to the class's forward
                else:
                    module.forward = original
                removed.append(name)
        self.patterns = [p for p in self.patterns if p != pattern]
        return removed

    def _wrap(self, forward):
        device_type = self._device_type

        @functools.wraps(forward)
        def fp32_forward(*args, **kwargs):
            with torch.autocast(device_type, enabled=False):
                return forward(*_to_fp32(args), **_to_fp32(kwargs))
        return fp32_forward
