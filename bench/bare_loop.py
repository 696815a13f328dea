"""The bare guarded loop a user would write by hand, over a script of amp-tui's script contract:
the reference of the whole-process benchmark (no amp_tui import, no probes, no recording).

    python bench/bare_loop.py SCRIPT.py --dtype bf16 --steps 400 [--device cuda] [-- SCRIPT ARGS]

Per step, PyTorch's AMP recipe with the guards amp-tui's unprobed step has: autocast around
loss_fn, a finite-loss check, the (scaled) backward, unscale, a non-finite gradient check in
bf16/fp32 (GradScaler's fused one), clipping when the script asks, and the update.
"""

import argparse
import importlib.util
import math
import sys
import types
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)   # this folder's modules are not the user's

import torch  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def to_device(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def main() -> int:
    argv = sys.argv[1:]
    script_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("script", type=Path)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--init-scale", type=float, default=65536.0)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    spec = importlib.util.spec_from_file_location("bare_loop_script", args.script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    s = module.setup(types.SimpleNamespace(device=str(device), argv=script_argv, dtype=str(dtype)))
    model, optimizer, loss_fn = s["model"].to(device), s["optimizer"], s["loss_fn"]
    clip = s.get("max_grad_norm")
    scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale) if dtype == torch.float16 else None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    found_inf, one = torch.zeros(1, device=device), torch.ones(1, device=device)
    batches, skipped = iter(()), 0

    for _ in range(args.steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(s["batches"])
            batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(model, to_device(batch, device))
        if not math.isfinite(float(loss.detach())):
            skipped += 1
            continue
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
            continue
        found_inf.zero_()
        grads = [p.grad for p in params if p.grad is not None]
        for group in {(g.dtype, g.device) for g in grads}:
            torch._amp_foreach_non_finite_check_and_unscale_(
                [g for g in grads if (g.dtype, g.device) == group], found_inf, one)
        if found_inf.item():
            skipped += 1
        else:
            optimizer.step()
    print(f"{args.steps} steps, {skipped} skipped, last loss {float(loss.detach()):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
