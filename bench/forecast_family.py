"""The forecasts under the defaults, over a seeded family of runs (bench/forecast_scenarios.py):
a value growing 0.5%..5% a step, at a module's output or inside its forward, early, middle or
last, behind a LayerNorm, a tanh or a softmax, in MLPs and small transformers, under `amp-tui
train`, a monitored loop and the Lightning callback, in fp16 (where it overflows) and bf16
(where it doesn't); and healthy runs of 2,000 steps (the family's models without growth, the
healthy demo and the bench models at their quick sizes), in fp16 and bf16. Every run with
amp-tui's defaults: the adaptive probe schedule at its 1% budget.

    python bench/forecast_family.py             # 36 growing runs, 8 in bf16, healthy runs of 2,000 steps
    python bench/forecast_family.py --quick     # 12 growing runs, 2 in bf16, healthy runs of 400 steps

Prints, and writes as JSON to bench/results/:
- recall: the share of fp16 overflows a `forecast_layer` alert named (the module, or the op in
  it) at least LEAD steps before the first overflow;
- the median lead and the median ETA error (|step named - overflow| / steps that were left);
- false alarms per 1,000 healthy steps: forecast alerts (`forecast_layer`, `forecast_scale`) on
  runs that never overflow (bf16 growing runs counted apart), and alerts that named another module;
- what the probes cost: the share of steps probed and the cost the run measured (its `probes`
  field, percent of the training time).

The truth is the model's own: the first update at which the growing value is past fp16's max
(the model records it; behind a tanh an overflow makes no non-finite loss), not an event the run
may or may not record.
"""

from __future__ import annotations

import argparse
import statistics
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
from amp_tui.recording.forecast_outcomes import same_module  # noqa: E402
from amp_tui.recording.reader import read_session  # noqa: E402
from bench import common  # noqa: E402
from bench.forecast_scenarios import Scenario, build, family  # noqa: E402

LEAD = 50
SCRIPT = ROOT / "bench" / "cases" / "forecast_scenario.py"


# ---- the three drivers ----------------------------------------------------------------------------
def run_monitor(scenario: Scenario, run_dir: Path, steps: int):
    model, batches, optimizer = build(scenario)
    scaler = torch.amp.GradScaler("cpu", enabled=scenario.dtype == "float16")
    monitor = amp_tui.monitor(model, optimizer, scaler=scaler, run_dir=run_dir, dtype=scenario.dtype,
                              control=False, announce=False)
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with monitor.step() as step:
            with monitor.autocast():
                loss = model.loss(batches[i % len(batches)])
            step.loss = loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        if model.overflow_update() is not None:
            break   # the overflow's step is recorded: what follows is not forecast
    monitor.close()
    return model


def run_train(scenario: Scenario, run_dir: Path, steps: int):
    config = RunConfig(script=SCRIPT, script_argv=scenario.argv(), run_dir=run_dir, dtype=scenario.dtype,
                       steps=steps, device="cpu", control=False, on_nonfinite="stop")
    run = build_run(config).run
    run.run()
    return run.driver.model


def run_lightning(scenario: Scenario, run_dir: Path, steps: int):
    import lightning.pytorch as pl

    from amp_tui.integrations.lightning import AmpTuiCallback

    model, batches, optimizer = build(scenario)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, _index):
            return self.model.loss(batch)

        def configure_optimizers(self):
            return optimizer

    class StopOnOverflow(pl.Callback):
        def on_train_batch_end(self, trainer, _module, outputs, *_):
            if model.overflow_update() is not None:   # after amp-tui's callback recorded the step
                trainer.should_stop = True

    # On the CPU, Lightning's "16-mixed" means bf16: its MixedPrecision plugin is the one way to an
    # fp16 GradScaler there.
    precision = ({"plugins": [pl.plugins.MixedPrecision("16-mixed", "cpu")]} if scenario.dtype == "float16"
                 else {"precision": "bf16-mixed"})
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **precision,
                         callbacks=[AmpTuiCallback(run_dir=run_dir, control=False, announce=False),
                                    StopOnOverflow()])
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    trainer.fit(Module(), loader)
    return model


DRIVERS = {"monitor": run_monitor, "train": run_train, "lightning": run_lightning}


# ---- judging ---------------------------------------------------------------------------------------
def _related(named: str, module: str) -> bool:
    """Whether a forecast's module is the scenario's, inside it or holding it (the Lightning
    module holds the model as `model`)."""
    return same_module(named.removeprefix("model."), module)


def judge(scenario: Scenario, session, overflow_update: int | None, seconds: float) -> dict:
    """One run's figures: the first overflow (as a step of the recording), the forecast alerts, the
    first that named the growing module, its lead and ETA error, and the probes' cost."""
    steps = session.steps
    overflow = None
    if overflow_update is not None:   # the step whose forward ran after that many updates
        updates = 0
        for record in steps:
            if updates == overflow_update:
                overflow = record["step"]
                break
            updates += 0 if record.get("skipped") else 1
    alerts = [e for e in session.events if e["kind"] == "alert" and str(e.get("reason")).startswith("forecast")]
    named = [e for e in alerts if e.get("reason") == "forecast_layer"
             and _related(str((e.get("forecast") or {}).get("layer")), scenario.module)]
    first = named[0] if named else None
    row = {"scenario": scenario.__dict__ | {"module": scenario.module}, "steps": len(steps),
           "overflow": overflow, "alerts": len(alerts), "other_alerts": len(alerts) - len(named),
           "alert_step": first["step"] if first else None, "op": (first or {}).get("forecast", {}).get("op"),
           "lead": None, "eta_error": None,
           "probed": sum(1 for r in steps if "layers" in r) / max(1, len(steps)),
           "cost_percent": _cost(steps), "seconds": round(seconds, 1)}
    if first is not None and overflow is not None and first["step"] < overflow:
        left = overflow - first["step"]
        row["lead"] = left
        row["eta_error"] = abs(first["forecast"]["at_step"] - overflow) / left
    return row


def _cost(steps: list[dict]) -> float | None:
    """The probes' cost the run measured, at its last step (percent of the training time)."""
    for record in reversed(steps):
        probes = record.get("probes")
        if isinstance(probes, list) and probes and probes[0] == "auto":
            return probes[2]
    return None


def run_scenario(scenario: Scenario, folder: Path, steps: int | None = None) -> dict:
    run_dir = folder / f"{scenario.seed}-{scenario.driver}-{scenario.dtype}"
    started = time.perf_counter()
    model = DRIVERS[scenario.driver](scenario, run_dir, steps or scenario.steps())
    overflow = model.overflow_update() if scenario.dtype == "float16" else None   # bf16 has fp32's range
    return judge(scenario, read_session(run_dir), overflow, time.perf_counter() - started)


def healthy_runs(steps: int, folder: Path, *, bench_models: bool = True) -> list[dict]:
    """Runs that never overflow: the family's models without growth (a monitored loop and `amp-tui
    train`), the healthy demo, and the bench models, in fp16 and bf16, with the defaults."""
    rows = []
    for dtype in ("float16", "bfloat16"):
        for i, (model, driver) in enumerate((("mlp", "monitor"), ("transformer", "train"))):
            scenario = Scenario(seed=900 + i, model=model, rate=0.0, dtype=dtype, driver=driver)
            rows.append(run_scenario(scenario, folder, steps) | {"run": f"{model} ({driver})"})
        rows.append(_healthy_demo(dtype, steps, folder))
        if bench_models:
            rows += _bench_models(dtype, steps, folder)
    return rows


def _healthy_demo(dtype: str, steps: int, folder: Path) -> dict:
    run_dir = folder / f"demo-{dtype}"
    started = time.perf_counter()
    config = RunConfig(script=ROOT / "demos" / "healthy.py", run_dir=run_dir, dtype=dtype, steps=steps,
                       device="cpu", control=False)
    build_run(config).run.run()
    return _healthy_row("demos/healthy.py", dtype, read_session(run_dir), time.perf_counter() - started)


def _bench_models(dtype: str, steps: int, folder: Path) -> list[dict]:
    from bench.forecast_false_alarms import QUICK_SPECS, bench_model_run

    rows = []
    for spec in QUICK_SPECS:   # their full sizes, every step probed: bench/forecast_false_alarms.py
        run_dir = folder / f"{spec.name}-{dtype}"
        started = time.perf_counter()
        bench_model_run(spec, dtype, steps, run_dir, probe_every="auto")
        rows.append(_healthy_row(spec.name, dtype, read_session(run_dir), time.perf_counter() - started))
    return rows


def _healthy_row(name: str, dtype: str, session, seconds: float) -> dict:
    steps = session.steps
    alerts = [e for e in session.events if e["kind"] == "alert" and str(e.get("reason")).startswith("forecast")]
    return {"run": name, "scenario": {"dtype": dtype}, "steps": len(steps), "overflow": None,
            "alerts": len(alerts), "other_alerts": len(alerts),
            "skipped": sum(1 for r in steps if r.get("skipped")),
            "probed": sum(1 for r in steps if "layers" in r) / max(1, len(steps)),
            "cost_percent": _cost(steps), "seconds": round(seconds, 1)}


def summary(growing: list[dict], healthy: list[dict]) -> dict:
    """The family's figures (the module docstring's)."""
    fp16 = [r for r in growing if r["scenario"]["dtype"] == "float16" and r["overflow"] is not None]
    leads = [r["lead"] for r in fp16 if r["lead"] is not None]
    errors = [r["eta_error"] for r in fp16 if r["eta_error"] is not None]
    bf16 = [r for r in growing if r["scenario"]["dtype"] == "bfloat16"]
    healthy_steps = sum(r["steps"] for r in healthy)
    costs = [r["cost_percent"] for r in healthy if r["cost_percent"] is not None]
    return {
        "overflows": len(fp16),
        "not_overflowed": sum(1 for r in growing if r["scenario"]["dtype"] == "float16" and r["overflow"] is None),
        "recall": sum(1 for lead in leads if lead >= LEAD) / len(fp16) if fp16 else None,
        "median_lead": statistics.median(leads) if leads else None,
        "median_eta_error": statistics.median(errors) if errors else None,
        "worst_eta_error": max(errors) if errors else None,
        "healthy_steps": healthy_steps,
        "false_alarms_per_1000": 1000 * sum(r["alerts"] for r in healthy) / max(1, healthy_steps),
        "bf16_growing_alerts": sum(r["alerts"] for r in bf16),
        "alerts_naming_another_module": sum(r["other_alerts"] for r in growing),
        "healthy_probed_share": statistics.median(r["probed"] for r in healthy) if healthy else None,
        "healthy_cost_percent": statistics.median(costs) if costs else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 growing runs, healthy runs of 400 steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    count, bf16, healthy_steps = (12, 2, 400) if args.quick else (36, 8, 2000)
    scenarios = family(count, args.seed) + [
        s.__class__(**(s.__dict__ | {"dtype": "bfloat16", "seed": s.seed + 500}))
        for s in family(bf16, args.seed + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        growing = []
        for scenario in scenarios:
            growing.append(run_scenario(scenario, folder))
            r = growing[-1]
            s, error = r["scenario"], "-" if r["eta_error"] is None else f"{r['eta_error']:.0%}"
            print(f"  {s['model']:<11} {s['where']:<6} {s['position']:<6} {s['after']:<9} {s['rate']:>6.2%} "
                  f"{s['driver']:<9} {s['dtype']:<8} overflow {r['overflow']}  alert {r['alert_step']} "
                  f"{r['op'] or ''}  lead {r['lead']}  ETA error {error}  ({r['seconds']} s)", flush=True)
        healthy = healthy_runs(healthy_steps, folder)
        for r in healthy:
            print(f"  healthy {r['run']:<22} {r['scenario']['dtype']:<8} {r['steps']} steps, alerts {r['alerts']}, "
                  f"probed {r['probed']:.1%}, cost {r['cost_percent']}%  ({r['seconds']} s)", flush=True)
    figures = summary(growing, healthy)
    print()
    for key, value in figures.items():
        print(f"{key:<30} {value:.3g}" if isinstance(value, float) else f"{key:<30} {value}")
    result = {"when": common.now_iso(), "machine": common.machine("cpu"), "versions": common.versions(),
              "checkout": common.checkout(ROOT), "seed": args.seed, "summary": figures, "growing": growing,
              "healthy": healthy}
    out = common.write_results(ROOT, f"forecast-family{'-quick' if args.quick else ''}", result)
    print(f"written: {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
