"""Whole-process cost: `amp-tui train CASE --headless --dtype bf16 --steps N --probe-every 1`
(the session recorded, the summary printed) against the bare guarded loop a user would write
(`bench/bare_loop.py`) over the same case (`bench/cases/train_case.py`), as two processes; and,
in the same pairs (`auto=True`, the default), `amp-tui train` with its defaults (no
`--probe-every`: the adaptive schedule at its 1% budget), as a third process ("amp-tui auto").

Each pair runs one process of each, in a random order; a warm-up pair comes first (the page
cache then holds torch for both, and the bytecode cache their compiled modules, as an installed
package has them, whatever PYTHONDONTWRITEBYTECODE says here; `warmup_steps` may make it shorter:
what it warms is loaded by the first steps). Per process, as `/usr/bin/time` gives them: the wall time from
spawn to exit, the CPU time (user + system, the child's own rusage) and its peak RSS; and the time
to the first step: from spawn to the first call of loss_fn, which the case stamps with the wall
clock (in amp-tui that call is the pre-flight forward, which is the first step's forward).

Figures: the median over pairs of amp-tui/bare for wall and CPU time and for the time after the
first step began (the per-step part), and the median of the paired differences of the time to the
first step, each with a 90% bootstrap interval over pairs. With `baseline` (another checkout of
amp-tui), a third process per pair runs that checkout's `amp-tui train`: before and after in the
same series.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parent.parent
CASE = ROOT / "bench" / "cases" / "train_case.py"
BARE = ROOT / "bench" / "bare_loop.py"
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def run_process(cmd: list[str], env: dict, stamp: Path | None = None, timeout: float = 600.0,
                cwd: Path | None = None) -> dict:
    """Run `cmd` to its end; wall, CPU, peak RSS and (with `stamp`) the time to its first step.
    Not in a checkout's folder (`python -m` would import the amp_tui there): in `cwd` or the
    temporary folder."""
    if stamp is not None:
        stamp.unlink(missing_ok=True)
    with tempfile.TemporaryFile() as out:
        spawned_at = time.time()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=cwd or tempfile.gettempdir())
        deadline = time.monotonic() + timeout
        peak_kb = 0
        while True:   # os.wait4: this child's own rusage, not every child's so far
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            peak_kb = max(peak_kb, high_water_kb(proc.pid))
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise RuntimeError(f"over {timeout:.0f} s: {' '.join(cmd)}")
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            out.seek(0)
            tail = out.read()[-2000:].decode("utf-8", "replace")
            raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")
    first = float(stamp.read_text()) - spawned_at if stamp is not None and stamp.exists() else None
    # ru_maxrss counts the pages the child held as a fork of this (large) process before its exec:
    # the high-water mark of its own image is read from /proc while it runs, where there is one.
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "max_rss_mb": (peak_kb or usage.ru_maxrss) / 1024, "first_step_s": first}


def high_water_kb(pid: int) -> int:
    """VmHWM of a running process (kB; 0 where /proc can't say)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def commands(model: str, dtype: str, steps: int, device: str, run_dir: Path,
             baseline: Path | None, auto: bool = True) -> dict[str, tuple[list[str], dict]]:
    dt = SHORT.get(dtype, dtype)
    case_args = ["--", "--model", model]
    defaults = ["train", str(CASE), "--headless", "--dtype", dt, "--steps", str(steps), "--device", device]
    train = [*defaults[:-2], "--probe-every", "1", *defaults[-2:]]
    out = {
        "amp-tui": ([sys.executable, "-m", "amp_tui", *train, "--run-dir", str(run_dir / "run"), *case_args],
                    checkout_env(ROOT)),
        "bare": ([sys.executable, str(BARE), str(CASE), "--dtype", dt, "--steps", str(steps), "--device", device,
                  *case_args], dict(os.environ)),
    }
    if auto:   # the defaults: no --probe-every, the adaptive schedule
        out["amp-tui auto"] = (
            [sys.executable, "-m", "amp_tui", *defaults, "--run-dir", str(run_dir / "run"), *case_args],
            checkout_env(ROOT))
    if baseline is not None:
        out["amp-tui@baseline"] = (
            [sys.executable, "-m", "amp_tui", *train, "--run-dir", str(run_dir / "run"), *case_args],
            checkout_env(baseline))
    return out


def checkout_env(checkout: Path) -> dict:
    """The environment that imports amp_tui from `checkout` (installed or not)."""
    env = dict(os.environ)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(checkout) + (os.pathsep + rest if rest else "")
    return env


def measure(model: str = "blocks", dtype: str = "bfloat16", *, steps: int = 400, pairs: int = 5,
            device: str = "cpu", threads: int | None = 1, baseline: Path | None = None, seed: int = 0,
            timeout: float = 600.0, warmup_steps: int | None = None, auto: bool = True, log=print) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="amp-tui-bench-process-"))
    stamp = tmp / "first-step"
    cmds = commands(model, dtype, steps, device, tmp, baseline, auto)
    warmup = commands(model, dtype, warmup_steps or steps, device, tmp, baseline, auto)
    for _, env in [*cmds.values(), *warmup.values()]:
        env["AMP_TUI_BENCH_STAMP"] = str(stamp)
        # Compiled modules cached, as an installed package has them (the warm-up pair writes the
        # cache, in a folder of the run's own): an environment that writes no bytecode would
        # have every process compile all of amp-tui's modules again, where the bare loop is one.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "bytecode")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
    rng = random.Random(seed)
    load_at_start = common.load_average()
    runs: dict[str, list[dict]] = {name: [] for name in cmds}
    started = time.perf_counter()
    try:
        for k in range(pairs + 1):   # the first is the warm-up
            order = list(cmds)
            rng.shuffle(order)
            for name in order:
                shutil.rmtree(tmp / "run", ignore_errors=True)
                cmd, env = (cmds if k else warmup)[name]
                r = run_process(cmd, env, stamp, timeout, cwd=tmp)
                if k:
                    runs[name].append(r)
            if k:
                b = runs["bare"][-1]
                line = []
                for name in runs:
                    if name == "bare":
                        continue
                    a = runs[name][-1]
                    line.append(f"{name} {a['wall_s']:.2f} s (x{a['wall_s'] / b['wall_s']:.3f} wall, "
                                f"x{a['cpu_s'] / b['cpu_s']:.3f} CPU, first step "
                                f"{a['first_step_s'] - b['first_step_s']:+.3f} s)")
                log(f"  pair {k}/{pairs}: bare {b['wall_s']:.2f} s; " + "; ".join(line))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(runs, model=model, dtype=dtype, steps=steps, device=device, threads=threads,
                     seconds=time.perf_counter() - started, baseline=baseline is not None,
                     load_average_at_start=load_at_start, load_average_at_end=common.load_average())


def summarize(runs: dict[str, list[dict]], **facts) -> dict:
    bare = runs["bare"]
    n = len(bare)

    def ratio(name: str, key: str):
        def est(idx):
            return common.median([runs[name][i][key] / bare[i][key] for i in idx])
        return est

    def steady(r: dict) -> float:
        return r["wall_s"] - r["first_step_s"]

    def steady_ratio(name: str):
        def est(idx):
            return common.median([steady(runs[name][i]) / steady(bare[i]) for i in idx])
        return est

    def first_diff(name: str):
        def est(idx):
            return common.median([runs[name][i]["first_step_s"] - bare[i]["first_step_s"] for i in idx])
        return est

    everything = list(range(n))
    rows = {}
    for name, rs in runs.items():
        row = {
            "wall_s": common.rnd(common.median([r["wall_s"] for r in rs])),
            "cpu_s": common.rnd(common.median([r["cpu_s"] for r in rs])),
            "first_step_s": common.rnd(common.median([r["first_step_s"] for r in rs])),
            "max_rss_mb": common.rnd(common.median([r["max_rss_mb"] for r in rs]), 1),
            "each": [{k: common.rnd(v) for k, v in r.items()} for r in rs],
        }
        if name != "bare":
            for key, est in (("wall_ratio", ratio(name, "wall_s")), ("cpu_ratio", ratio(name, "cpu_s")),
                             ("after_first_step_ratio", steady_ratio(name)),
                             ("first_step_later_s", first_diff(name))):
                lo, hi = common.bootstrap_interval(est, n)
                row[key] = common.rnd(est(everything), 4)
                row[key + "_90ci"] = [common.rnd(lo, 4), common.rnd(hi, 4)]
        rows[name] = row
    return {**facts, "seconds": common.rnd(facts["seconds"], 1), "pairs": n, "contenders": rows}
