"""The fp8 what-if's emulated casts against the hardware's: on a GPU with fp8 GEMMs (compute
capability 8.9 or more: H100, L4, B200), `torch._scaled_mm` run natively, and a torchao model
converted without emulation, trained a few steps. On the CPU, `torch._scaled_mm`'s CPU kernel.

    python bench/fp8_native.py [--device cuda]

Exits 1 when an emulated tensorwise GEMM's output SQNR is more than 0.1 dB from the native one,
or the converted model's loss is not finite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402

from amp_tui.training.fp8.casts import cast, fp8_bits, sqnr_db  # noqa: E402


def gemm_check(device: str) -> bool:
    torch.manual_seed(0)
    ok = True
    for outliers in (1.0, 1e3):
        x = torch.randn(256, 512, device=device)
        x[:, [7, 300]] *= outliers
        w = torch.randn(384, 512, device=device) * 0.05
        reference = x @ w.t()
        qx, sx = fp8_bits(x, "e4m3", "tensorwise")
        qw, sw = fp8_bits(w, "e4m3", "tensorwise")
        native = torch._scaled_mm(qx, qw.t(), scale_a=sx.reciprocal(), scale_b=sw.reciprocal(),
                                  out_dtype=torch.float32)
        emulated = cast(x, "e4m3", "tensorwise").values @ cast(w, "e4m3", "tensorwise").values.t()
        a, b = sqnr_db(reference, native), sqnr_db(reference, emulated)
        good = abs(a - b) <= 0.1
        ok &= good
        print(f"{'PASS' if good else 'FAIL'}  outliers x{outliers:g}: native {a:.2f} dB, emulated {b:.2f} dB")
    return ok


def torchao_check(device: str) -> bool:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        print("skip  torchao: not installed (pip install 'amp-tui[fp8]')")
        return True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(device)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=device == "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(128, 256, device=device)
    losses = []
    for _ in range(5):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = (model(x) - x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    good = all(torch.isfinite(torch.tensor(losses)))
    print(f"{'PASS' if good else 'FAIL'}  torchao float8 ({'emulated' if device == 'cpu' else 'native'}): "
          f"losses {', '.join(f'{v:.4f}' for v in losses)}")
    return good


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device.startswith("cuda") and torch.cuda.get_device_capability() < (8, 9):
        print(f"skip  native fp8: {torch.cuda.get_device_name()} has no fp8 GEMMs (compute capability < 8.9)")
        return 0
    return 0 if gemm_check(args.device) & torchao_check(args.device) else 1


if __name__ == "__main__":
    raise SystemExit(main())
