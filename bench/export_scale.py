"""Export and plot at scale: the replay benchmark's 100,000-step, 50-layer recording written as
TensorBoard event files, as CSV (per step, per step and layer), and drawn by `amp-tui plot`; and
what the live TensorBoard writer costs the training thread per step.

    python bench/export_scale.py            # 100,000 steps x 50 layers (written once, ~1-2 min)
    python bench/export_scale.py --quick    # 20,000 steps
    python bench/export_scale.py --steps 300000 --layers 80 --dir DIR

The recording is bench/replay_scale.py's (reused when present). Each export runs in a fresh
interpreter, as `amp-tui export` / `amp-tui plot` would: its wall and CPU seconds (index, reading,
writing: everything after the imports), its peak resident memory (the process's whole
footprint: Python, numpy, matplotlib or the protocol buffers included), the size written, and
whether torch was imported (it must not be). Targets: <= 15 s and <= 500 MB for each export,
<= 10 s for the plot; the three exports at once (one pass, shared reading) are reported with the
memory target only. The live writer: `TensorBoardObserver` fed the recording's records one at a time, as a
run's recorder hands them over on the training thread: microseconds per step record.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

EXPORT_TARGET_S = 15.0
PLOT_TARGET_S = 10.0
MEMORY_TARGET_MB = 500.0
OBSERVED_STEPS = 5000          # step records fed to the live writer
JOBS = {
    "tensorboard": "export --tensorboard",
    "csv": "export --csv",
    "layers_csv": "export --layers-csv",
    "all": "export, all three in one pass",
    "plot": "plot -o run.png",
}


def child(job: str, session: str, out: str) -> dict:
    """One job in this (fresh) process; its figures as a dict."""
    from amp_tui.recording.export import export
    from amp_tui.recording.plot import plot

    out_dir = Path(out)
    targets = {"tensorboard": {"tensorboard": out_dir / "tb"}, "csv": {"csv": out_dir / "steps.csv"},
               "layers_csv": {"layers_csv": out_dir / "layers.csv"},
               "all": {"tensorboard": out_dir / "tb", "csv": out_dir / "steps.csv",
                       "layers_csv": out_dir / "layers.csv"}}
    wall, cpu = time.perf_counter(), time.process_time()
    if job == "plot":
        plot(session, out_dir / "run.png")
    elif job == "observer":
        return observe(session, out_dir / "live")
    else:
        export(session, **targets[job])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    written = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "written_mb": round(written / 1e6, 1), "torch": "torch" in sys.modules}


def observe(session: str, logdir: Path) -> dict:
    """The live writer's cost per step record, for the first OBSERVED_STEPS steps."""
    from amp_tui.recording.index import SessionIndex
    from amp_tui.recording.stream import records
    from amp_tui.recording.tensorboard import TensorBoardObserver

    observer = TensorBoardObserver(logdir)
    times = []
    with SessionIndex(session) as index:
        layers = len(index.layer_names)
        for record in records(index):
            t = time.perf_counter_ns()
            observer(record)
            if record.get("type") == "step":
                times.append(time.perf_counter_ns() - t)
                if len(times) >= OBSERVED_STEPS:
                    break
    observer.close()
    return {"layers": layers, "steps": len(times), "median_us": round(statistics.median(times) / 1e3, 1),
            "mean_us": round(statistics.fmean(times) / 1e3, 1),
            "p99_us": round(sorted(times)[int(0.99 * len(times))] / 1e3, 1), "torch": "torch" in sys.modules}


def run_child(job: str, session: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"amp-tui-export-bench-{job}-"))
    try:
        done = subprocess.run([sys.executable, __file__, "--child", job, str(session), str(out)],
                              capture_output=True, text=True, check=True, cwd=ROOT)
        return json.loads(done.stdout.splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="20,000 steps")
    parser.add_argument("--dir", type=Path, default=None, help="where the recording goes")
    parser.add_argument("--only", default=None, help=f"comma-separated: {', '.join(JOBS)}, observer")
    parser.add_argument("--child", nargs=3, metavar=("JOB", "SESSION", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0

    from bench.replay_scale import default_path, generate

    steps = args.steps or (20_000 if args.quick else 100_000)
    path = args.dir / "session.jsonl" if args.dir else default_path(steps, args.layers)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        print(f"writing {steps:,} steps x {args.layers} layers to {path} ...", flush=True)
        generate(path, steps, args.layers)
        print(f"  written in {time.perf_counter() - t:.1f} s", flush=True)
    with open(path, "rb") as fh:  # warm the page cache, as a second look at a run would find it
        while fh.read(8 << 20):
            pass
    wanted = args.only.split(",") if args.only else [*JOBS, "observer"]
    print(f"recording: {steps:,} steps x {args.layers} layers, {path.stat().st_size / 1e6:,.1f} MB")
    checks = []
    for job in (j for j in JOBS if j in wanted):
        f = run_child(job, path)
        target = PLOT_TARGET_S if job == "plot" else EXPORT_TARGET_S
        print(f"{JOBS[job]:<32} {f['wall_s']:6.2f} s (CPU {f['cpu_s']:.2f} s)  peak {f['peak_rss_mb']:6.1f} MB  "
              f"wrote {f['written_mb']:,.1f} MB  {'torch imported' if f['torch'] else 'no torch'}")
        if job != "all":     # the three outputs at once: reported, with no target of its own
            checks.append((f"{job} <= {target:g} s", f["wall_s"] <= target))
        checks += [(f"{job} <= {MEMORY_TARGET_MB:g} MB", f["peak_rss_mb"] <= MEMORY_TARGET_MB),
                   (f"{job} without torch", not f["torch"])]
    if "observer" in wanted:
        f = run_child("observer", path)
        print(f"{'live TensorBoardObserver':<32} median {f['median_us']:.0f} us, mean {f['mean_us']:.0f} us, "
              f"p99 {f['p99_us']:.0f} us per step record ({f['layers']} layers, {f['steps']:,} steps)")
    try:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"machine: {os.cpu_count()} CPUs, load average {load} (wall times stretch when the load "
              "is above the CPU count; CPU time does not)")
    except (AttributeError, OSError):
        pass
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
