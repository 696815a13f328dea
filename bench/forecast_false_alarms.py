"""The forecasts (docs/session-format.md, "Forecasts") on runs that never overflow, and on runs
that do: the false alarms, and the lead times.

False alarms: the healthy demo (demos/healthy.py, under `amp-tui train`) and the benchmark
models (bench/models.py: the MLP, the GPT-like transformer, the residual blocks, each in a
monitored loop of its own with AdamW and a GradScaler started at HEALTHY_INIT_SCALE), STEPS steps
each in fp16 and in bf16, every step probed (the most points a trend can be fitted to). None of
them overflows, by a wide margin, so a forecast alert there is a false alarm unless it came true (a
scale growth that did skip, as forecast, is no false alarm).

Lead times: the acceptance cases (bench/forecast_cases.py): the growth step the scale forecast
named against the step that skipped, and how many steps the layer alert came before the first
overflow of attention logits that grow.

    python bench/forecast_false_alarms.py            # 2,000 steps a run
    python bench/forecast_false_alarms.py --quick    # 200 steps a run, smaller models

Prints a table and writes it as JSON to bench/results/.
"""

from __future__ import annotations

import argparse
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

import amp_tui  # noqa: E402
from amp_tui.job.build import build_run  # noqa: E402
from amp_tui.job.config import RunConfig  # noqa: E402
from amp_tui.recording.forecast_outcomes import forecast_outcomes, is_forecast  # noqa: E402
from bench import common  # noqa: E402
from bench import forecast_cases as cases  # noqa: E402
from bench.forecast_cases import session_records  # noqa: E402
from bench.models import BlocksSpec, GptSpec, MlpSpec, build  # noqa: E402

DTYPES = ("float16", "bfloat16")
SPECS = (MlpSpec(), GptSpec(), BlocksSpec())
QUICK_SPECS = (MlpSpec(depth=6, width=64), GptSpec(layers=2, d_model=64, vocab=256, seq=32), BlocksSpec(blocks=6))
# The bench models' GradScaler starts here, not at its default 65536: at 65536 the quick GPT's
# scaled gradients reach 0.95 of fp16's max by step 110 and its backward overflows before step 150
# (at step 113 where the CPU computes fp16 without native kernels, 138 with them), the quick MLP's
# reach 0.53. Not a healthy run then, but one at the edge, which way it tips left to the CPU's fp16
# arithmetic. At 4096 the largest is 16 times below the max.
HEALTHY_INIT_SCALE = 4096.0


def bench_model_run(spec, dtype: str, steps: int, run_dir: Path, probe_every: int | str = 1) -> list[dict]:
    """A benchmark model in a loop of its own, as the user guide writes one (`probe_every`: the
    monitor's; "auto", its default, in bench/forecast_family.py)."""
    model, batches, loss_fn, _ = build(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=HEALTHY_INIT_SCALE, enabled=dtype == "float16")
    monitor = amp_tui.monitor(model, optimizer, scaler=scaler, run_dir=run_dir, dtype=dtype,
                              probe_every=probe_every, control=False, announce=False)
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with monitor.step() as step:
            with monitor.autocast():
                loss = loss_fn(model, batches[i % len(batches)])
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    monitor.close()
    return session_records(run_dir)


def healthy_demo_run(dtype: str, steps: int, run_dir: Path) -> list[dict]:
    config = RunConfig(script=ROOT / "demos" / "healthy.py", run_dir=run_dir, dtype=dtype, steps=steps,
                       probe_every=1, device="cpu", control=False)
    run = build_run(config).run
    run.run()
    return session_records(run_dir)


def tally(name: str, dtype: str, records: list[dict], seconds: float) -> dict:
    events = [r for r in records if r["type"] == "event"]
    steps = [r for r in records if r["type"] == "step"]
    outcomes = forecast_outcomes(events, steps[-1]["step"] if steps else None)
    # forecast_outcomes keeps the forecasts' order: each row's kind is its event's.
    kinds = [e["kind"] for e in events if is_forecast(e) and isinstance(e.get("step"), int)]
    rows = [r for r, kind in zip(outcomes, kinds) if kind == "alert"]
    said = [r for r, kind in zip(outcomes, kinds) if kind == "forecast"]
    return {"run": name, "dtype": dtype, "steps": len(steps),
            "skipped": sum(1 for s in steps if s["skipped"]),
            "nonfinite_events": sum(1 for e in events if e["kind"] == "nonfinite"),
            "forecast_alerts": len(rows),
            "layer_alerts": sum(1 for r in rows if r["reason"] == "forecast_layer"),
            "open": sum(1 for r in rows if r["came_true"] is None),
            "came_true": sum(1 for r in rows if r["came_true"]),
            "false_alarms": sum(1 for r in rows if r["came_true"] is False),
            # forecasts that need nothing done (a harmless skip) and did not come true: no alarm, but wrong
            "wrong_forecasts": sum(1 for r in said if r["came_true"] is False),
            "steps_with_eta": sum(1 for s in steps if "eta" in (s.get("layers") or {})),
            "seconds": round(seconds, 1)}


def false_alarm_run(name: str, dtype: str, steps: int, folder: Path, spec=None) -> dict:
    """One healthy run's tally: the healthy demo (`spec` None) or a bench model."""
    run_dir = folder / f"{name.replace('/', '_')}-{dtype}"
    started = time.perf_counter()
    records = (healthy_demo_run(dtype, steps, run_dir) if spec is None
               else bench_model_run(spec, dtype, steps, run_dir))
    return tally(name, dtype, records, time.perf_counter() - started)


def false_alarms(steps: int, specs, folder: Path) -> list[dict]:
    out = []
    for dtype in DTYPES:
        for name, spec in [("demos/healthy.py", None), *((spec.name, spec) for spec in specs)]:
            out.append(false_alarm_run(name, dtype, steps, folder, spec))
            print(f"  {name:<22} {dtype:<9} {out[-1]}", flush=True)
    return out


def lead_times(folder: Path) -> dict:
    near = cases.near_half(folder / "near_half", steps=3 * cases.GROWTH_INTERVAL + 5)
    skipped = [r["step"] for r in near if r["type"] == "step" and r["skipped"]]
    scale = [{"alert_step": r["step"], "growth_step": r["forecast"]["growth_step"],
              "skipped_at": next((s for s in skipped if s >= r["forecast"]["growth_step"]), None)}
             for r in near if is_forecast(r) and r["reason"] == "forecast_scale"]
    ample = cases.ample(folder / "ample", steps=3 * cases.GROWTH_INTERVAL + 5)
    logits = cases.growing_logits(folder / "logits")
    alert = next(r for r in logits if is_forecast(r) and r["reason"] == "forecast_layer")
    overflow = min(r["step"] for r in logits if r["type"] == "event" and r["kind"] == "nonfinite")
    return {"scale": scale,
            "ample_alerts": sum(1 for r in ample if is_forecast(r)),
            "layer": {"layer": alert["forecast"]["layer"], "alert_step": alert["step"],
                      "eta": alert["forecast"]["eta"], "forecast_step": alert["forecast"]["at_step"],
                      "first_overflow": overflow, "lead": overflow - alert["step"]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 steps a run, smaller models")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default 2000; --quick 200)")
    args = parser.parse_args()
    steps = args.steps or (200 if args.quick else 2000)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print(f"false alarms: {steps} steps a run, every step probed", flush=True)
        runs = false_alarms(steps, QUICK_SPECS if args.quick else SPECS, folder)
        leads = lead_times(folder)
    print()
    print(f"{'run':<22} {'dtype':<9} {'steps':>6} {'skips':>6} {'alerts':>7} {'layer':>6} {'true':>5} "
          f"{'false':>6} {'open':>5} {'wrong':>6} {'ETA steps':>10}")
    for r in runs:
        print(f"{r['run']:<22} {r['dtype']:<9} {r['steps']:>6} {r['skipped']:>6} {r['forecast_alerts']:>7} "
              f"{r['layer_alerts']:>6} {r['came_true']:>5} {r['false_alarms']:>6} {r['open']:>5} "
              f"{r['wrong_forecasts']:>6} {r['steps_with_eta']:>10}")
    print(f"false alarms in all: {sum(r['false_alarms'] for r in runs)} "
          f"(forecast alerts {sum(r['forecast_alerts'] for r in runs)}, came true {sum(r['came_true'] for r in runs)})")
    for s in leads["scale"]:
        print(f"scale forecast at step {s['alert_step']}: growth step {s['growth_step']}, skipped at {s['skipped_at']} "
              f"(lead {s['growth_step'] - s['alert_step']} steps)")
    print(f"ample headroom: {leads['ample_alerts']} forecast alerts")
    layer = leads["layer"]
    print(f"layer forecast: {layer['layer']} at step {layer['alert_step']} (ETA {layer['eta']}, step ~"
          f"{layer['forecast_step']}); first overflow at step {layer['first_overflow']}: lead {layer['lead']} steps")
    result = {"when": common.now_iso(), "machine": common.machine("cpu"), "versions": common.versions(),
              "checkout": common.checkout(ROOT), "steps": steps, "runs": runs, "lead_times": leads}
    out = common.write_results(ROOT, f"forecasts{'-quick' if args.quick else ''}", result)
    print(f"written: {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
