"""Checkpoint save and restore against `torch.save` / `torch.load` of the same state.

The state is a model of a few tens of MB with its AdamW state (a few real steps, so the moments
exist). Contenders, alternating within each round, in a temporary folder:

- ours, save: `save_checkpoint` (a private CPU snapshot of every tensor, a SHA-256 digest of the
  tensor bytes and of the header, `safetensors.torch.save_file` into a temporary file, fsync,
  rename, fsync of the folder);
- ours, restore: `read_checkpoint` (strict header check, `safetensors.torch.load_file` reading with
  pread into memory, digest check, shape/dtype checks against the live model and optimizer) +
  `.apply` (copies into the live objects);
- `torch.save({"model": ..., "optimizer": ...})` (pickle + zip, no fsync), and the same followed
  by an fsync of the file, for a like-for-like comparison of durability;
- `torch.load(weights_only=True)` + `load_state_dict` into the live model and optimizer.

MB/s = bytes of the file written or read / seconds. The files are read back right after they
were written, so reads come from the page cache on both sides.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from amp_tui.training.checkpoint import read_checkpoint, save_checkpoint
from bench import common
from bench.models import MlpSpec, build


def _state(spec: MlpSpec):
    model, batches, loss_fn, description = build(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for batch in batches[:2]:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
    return model, opt, description


def measure(spec: MlpSpec, *, rounds: int = 5, seed: int = 0) -> dict:
    model, opt, description = _state(spec)
    scaler_state = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                    "growth_interval": 2000, "_growth_tracker": 0}
    folder = Path(tempfile.mkdtemp(prefix="amp-tui-bench-ckpt-"))
    ours_path = folder / "ours.safetensors"
    torch_path = folder / "torch.pt"
    times: dict[str, list[float]] = {k: [] for k in
                                     ("ours save", "torch.save", "torch.save + fsync", "ours restore",
                                      "torch.load + load_state_dict")}
    target = copy.deepcopy(model)
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-4)
    target_opt.load_state_dict(copy.deepcopy(opt.state_dict()))

    def ours_save():
        save_checkpoint(ours_path, model=model, optimizer=opt, scheduler=None, scaler_state=scaler_state,
                        step=100, dtype="float16", extra={"bench": True})

    def torch_save(fsync: bool):
        def go():
            with open(torch_path, "wb") as fh:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, fh)
                if fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
        return go

    def ours_restore():
        loaded = read_checkpoint(ours_path, model=target, optimizer=target_opt)
        loaded.apply(target, target_opt)

    def torch_restore():
        state = torch.load(torch_path, weights_only=True)
        target.load_state_dict(state["model"])
        target_opt.load_state_dict(state["optimizer"])

    saves = [("ours save", ours_save), ("torch.save", torch_save(False)),
             ("torch.save + fsync", torch_save(True))]
    restores = [("ours restore", ours_restore), ("torch.load + load_state_dict", torch_restore)]
    rng = random.Random(seed)
    sizes = {}
    try:
        ours_save()
        torch_save(False)()
        for _, fn in restores:  # warm-up
            fn()
        for _ in range(rounds):
            rng.shuffle(saves)
            for name, fn in saves:
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
            # the torch file to read back is the last one written: both variants write the same bytes
            rng.shuffle(restores)
            for name, fn in restores:
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        sizes["ours"] = ours_path.stat().st_size
        sizes["torch"] = torch_path.stat().st_size
        # The restored state equals the saved one.
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    tensor_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tensor_bytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor))
    rows = {}
    for name, ts in times.items():
        size = sizes["ours"] if name.startswith("ours") else sizes["torch"]
        med = common.median(ts)
        rows[name] = {"median_ms": common.rnd(med * 1e3, 1), "iqr_ms": common.rnd(common.iqr(ts) * 1e3, 1),
                      "mb_per_s": common.rnd(size / med / 1e6, 1), "bytes": size}
    r = lambda a, b: common.rnd(rows[a]["median_ms"] / rows[b]["median_ms"], 3)  # noqa: E731
    return {
        "model": spec.name, "description": description + " + AdamW state",
        "state_mb": common.rnd(tensor_bytes / 1e6, 1), "rounds": rounds, "contenders": rows,
        "save_time_ratio_vs_torch_save": r("ours save", "torch.save"),
        "save_time_ratio_vs_torch_save_fsync": r("ours save", "torch.save + fsync"),
        "restore_time_ratio_vs_torch_load": r("ours restore", "torch.load + load_state_dict"),
        "restored_equal": same,
    }
