"""What the fp8 what-if of one step costs, in training steps of the same model: one `fp8_whatif`
call (training/fp8/whatif.py: every nn.Linear's input, weight and output gradient cast in six
formats and scalings, their GEMMs' outputs computed from the casts) over the median bf16 training
step (autocast forward, backward, AdamW), measured interleaved in one process on the bench models.
Target: <= 10 steps.

    python bench/fp8_cost.py            # the bench models, 7 rounds of 10 steps and one what-if
    python bench/fp8_cost.py --quick    # 3 rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402

from amp_tui.training.fp8.whatif import fp8_whatif  # noqa: E402
from bench import common  # noqa: E402
from bench.models import BlocksSpec, GptSpec, MlpSpec, build  # noqa: E402

TARGET_STEPS = 10


def measure(spec, rounds: int) -> dict:
    model, batches, loss_fn, description = build(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch) -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    def whatif(batch) -> tuple[float, dict]:
        started = time.perf_counter()
        result = fp8_whatif(model, lambda: loss_fn(model, batch), dtype="bf16")
        return time.perf_counter() - started, result

    for batch in batches:   # warm both up
        step(batch)
    whatif(batches[0])
    steps, calls = [], []
    result: dict = {}
    for r in range(rounds):
        steps += [step(batches[i % len(batches)]) for i in range(10)]
        seconds, result = whatif(batches[r % len(batches)])
        calls.append(seconds)
    step_s, call_s = statistics.median(steps), statistics.median(calls)
    return {"model": spec.name, "description": description, "step_median_s": step_s,
            "whatif_median_s": call_s, "ratio_steps": call_s / step_s, "layers": len(result["verdict"]),
            "rows": len(result["rows"]), "kept_in_bf16": sorted(m for m, v in result["verdict"].items() if v != "fp8")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = 3 if args.quick else 7
    models = [measure(spec, rounds) for spec in (MlpSpec(), GptSpec(), BlocksSpec())]
    rows = [[m["model"], f"{m['step_median_s'] * 1e3:.1f} ms", f"{m['whatif_median_s'] * 1e3:.0f} ms",
             f"{m['ratio_steps']:.1f}", str(m["layers"])] for m in models]
    print(common.table(rows, ["model", "bf16 step", "what-if", "in steps", "Linear layers"]))
    worst = max(m["ratio_steps"] for m in models)
    print(f"worst: {worst:.1f} steps (target <= {TARGET_STEPS})")
    path = common.write_results(ROOT, "fp8-cost", {
        "machine": common.machine("cpu"), "versions": common.versions(), "checkout": common.checkout(ROOT),
        "threads": args.threads, "rounds": rounds, "target_steps": TARGET_STEPS, "models": models})
    print(f"written: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
