"""`--on-nonfinite isolate` next to `--on-nonfinite fallback` on the same attention overflow in fp16
(the case tests/job/test_autopilot.py trains: attention scores past 65504 from the first step).

Each round trains the case twice, once per policy, in alternating order, in one process: a `Run`
built as `amp-tui train` builds it (headless, no control socket, the CPU). For each: steps/s over
the whole run (the failing steps, their replays and the decision included), steps/s once the
decision is made (the median step time of the last half of the run), the updates skipped, the
dtype and the modules in fp32 at the end, and the mean loss of the last 10 finite steps.

    python bench/autopilot.py [--steps 120] [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402

from amp_tui.job.build import build_run  # noqa: E402
from amp_tui.job.config import RunConfig  # noqa: E402
from amp_tui.recording.reader import read_session  # noqa: E402
from bench import common  # noqa: E402

POLICIES = ("isolate", "fallback")


def attention_case() -> str:
    """The test suite's attention overflow, one script for both (tests/autopilot_cases.py)."""
    spec = importlib.util.spec_from_file_location("autopilot_cases", ROOT / "tests" / "autopilot_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ATTENTION


def train(script: Path, run_dir: Path, policy: str, steps: int) -> dict:
    config = RunConfig(script=script, run_dir=run_dir, dtype="float16", steps=steps, on_nonfinite=policy,
                       device="cpu", control=False)
    run = build_run(config).run
    started = time.perf_counter()
    assert run.run() == 0
    seconds = time.perf_counter() - started
    records = read_session(run_dir).steps
    settled = [s["duration"] for s in records[len(records) // 2:]]
    finite = [s["loss"] for s in records if isinstance(s["loss"], float)][-10:]   # "NaN" is a string
    return {"steps_per_s": steps / seconds, "settled_steps_per_s": 1.0 / common.median(settled),
            "skipped": sum(s["skipped"] for s in records), "dtype": records[-1]["dtype"],
            "fp32": ",".join(run.local_fp32.names) or "-",
            "loss": sum(finite) / len(finite)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    results: dict[str, list[dict]] = {p: [] for p in POLICIES}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "attention.py"
        script.write_text(attention_case(), encoding="utf-8")
        train(script, Path(folder) / "warm", "isolate", 4)   # one-off costs (imports, first calls): not timed
        for r in range(args.rounds):
            for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                results[policy].append(train(script, Path(folder) / f"{policy}-{r}", policy, args.steps))
    rows = []
    for policy, runs in results.items():
        speed = [x["steps_per_s"] for x in runs]
        low, high = common.quartiles(speed)
        last = runs[-1]
        rows.append([f"--on-nonfinite {policy}", f"{common.median(speed):.1f} ({low:.1f}-{high:.1f})",
                     f"{common.median([x['settled_steps_per_s'] for x in runs]):.1f}", str(last["skipped"]),
                     last["dtype"], last["fp32"], f"{common.median([x['loss'] for x in runs]):.4f}"])
    print(f"Attention overflow in fp16, {args.steps} steps, CPU, one thread; median of {args.rounds} rounds "
          "(quartiles), the policies alternating:")
    print(common.table(rows, ["policy", "steps/s", "settled steps/s", "skipped", "dtype at the end",
                              "in fp32", "loss (last 10)"]))
    isolate, fallback = (common.median([x["steps_per_s"] for x in results[p]]) for p in POLICIES)
    print(f"\nisolate vs fallback: {isolate / fallback:.2f}× the steps/s "
          f"({time.perf_counter() - began:.1f} s in all; torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
