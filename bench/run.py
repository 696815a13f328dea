"""amp-tui benchmarks: one entry point, one table, the same figures as JSON.

    python bench/run.py --quick        # about 70 s on an idle 2-core CPU before the process section had
                                       # three processes a pair; 105 s at load average 4-5 with them:
                                       # smaller models, fewer rounds and pairs, the 20k-step replay
    python bench/run.py                # the full run (several minutes): the figures in
                                       # docs/performance.md, the 100k-step recording
    python bench/run.py --gpu          # on a CUDA/ROCm machine: the overhead benchmark on a
                                       # GPT-2-small-sized model in fp16 and bf16 (bench/gpu_check.sh)
    python bench/run.py --only overhead,checkpoint --threads 2
    python bench/run.py --only process --baseline ../other-checkout   # before/after in one series

Sections: `overhead` (probes against the bare guarded loop, DebugUnderflowOverflow and
detect_anomaly), `process` (`amp-tui train --headless`, with --probe-every 1 and with its
defaults, against a bare-loop script as whole processes: wall, CPU, time to the first step),
`readside` (start-up of report, replay --headless and ls; report and ls at scale), `dashboard`
(attached against headless, key-to-effect latency), `replay` (first frame, seek, memory, bytes
per step), `checkpoint` (save/restore MB/s against torch.save/load).
The method is in docs/performance.md. Results go to bench/results/<date>-<quick|full|gpu>.json
(or --out DIR), with the machine, the versions and the date.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

STARTED = time.perf_counter()   # the total printed at the end counts torch's import too

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# This file's own folder comes first on sys.path when run as a script; the modules here are
# imported as `bench.*` from the repository root instead.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.models import GPT2_SMALL, BlocksSpec, GptSpec, MlpSpec  # noqa: E402

SECTIONS = ("overhead", "process", "readside", "dashboard", "replay", "checkpoint")
RESULTS = ROOT / "bench" / "results"

# Targets.
PROBE_EVERY_STEP_MAX_PCT = 3.0          # the full Run step and the probes alone, every step
SMALL_MODULES_EVERY_STEP_MAX_PCT = 5.0  # ... on the model of many small modules
PROBE_EVERY_10_MAX_PCT = 1.0
PROBE_AUTO_MAX_PCT = 1.0                # the adaptive schedule (the default), at its 1% budget
SMALL_MODULES_AUTO_MAX_PCT = 2.0        # ... on the model of many small modules (12 ms steps)
CHEAPER_THAN_DUO_MIN = 3.0
DASHBOARD_MIN_RATIO = 0.97
WHOLE_PROCESS_MAX_RATIO = 1.05          # amp-tui train (probes every step, recording) / bare loop
WHOLE_PROCESS_DEFAULTS_MAX_RATIO = 1.03  # amp-tui train with its defaults (--probe-every auto) / bare loop
FIRST_STEP_LATER_MAX_S = 0.15           # amp-tui's first step after the bare loop's


@dataclass
class Preset:
    name: str
    device: str
    overhead: list                      # (spec, dtype)
    rounds: int
    budget_s: float                     # per overhead configuration
    min_rounds: int
    dashboard: tuple | None             # (spec, dtype)
    # `run/auto` beside `bare` alone, for its target: the other six contenders' blocks put seconds
    # between the two's (the machine drifts meanwhile) and leave the caches to code of their own.
    pair_rounds: int = 0
    pair_budget_s: float = 0.0
    windows: int = 0
    window_s: float = 0.0
    presses: int = 0
    checkpoint: MlpSpec | None = None
    checkpoint_rounds: int = 0
    process: list = field(default_factory=list)   # (case model, dtype) for the whole-process section
    process_steps: int = 400
    process_pairs: int = 5
    process_warmup_steps: int | None = None   # the warm-up pair's steps (None: process_steps)
    process_auto: bool = True           # also amp-tui train with its defaults (the adaptive schedule)
    readside_repeats: int = 5
    readside_runs: int = 8
    replay_steps: int = 0
    sections: tuple = SECTIONS
    notes: list = field(default_factory=list)
    baseline: Path | None = None        # another checkout's amp-tui in the process section
    threads: int = 1


def presets(kind: str, device: str) -> Preset:
    if kind == "quick":
        return Preset(
            "quick", device,
            # fp16 on the transformer is left to the full run: emulated fp16 attention on a CPU
            # without native fp16 takes ~10x the fp32 step, too long for a minute.
            overhead=[(MlpSpec(depth=20, width=128, batch=64), "float32"),
                      (GptSpec(layers=4, d_model=64, heads=4, vocab=1024, seq=32, batch=4), "float32"),
                      (MlpSpec(depth=20, width=64, batch=32), "float16"),
                      (BlocksSpec(), "bfloat16")],
            rounds=2, budget_s=3.0, min_rounds=1, pair_rounds=3, pair_budget_s=2.0,
            # The process section is most of a quick run (each process starts torch): 4 pairs, and
            # a warm-up pair of 2 steps, which loads all that the measured processes load.
            process=[("blocks", "bfloat16")], process_steps=100, process_pairs=4, process_warmup_steps=2,
            readside_repeats=3, readside_runs=4,
            dashboard=(MlpSpec(depth=20, width=64, batch=32), "float16"), windows=1, window_s=1.5,
            presses=8, checkpoint=MlpSpec(depth=10, width=384, batch=8), checkpoint_rounds=3,
            replay_steps=20_000)
    if kind == "full":
        return Preset(
            "full", device,
            overhead=[(MlpSpec(depth=24, width=256, batch=128), "float32"),
                      (GptSpec(layers=4, d_model=128, heads=4, vocab=2048, seq=64, batch=8), "float32"),
                      (MlpSpec(depth=24, width=128, batch=64), "float16"),
                      (GptSpec(layers=4, d_model=64, heads=4, vocab=1024, seq=32, batch=4), "float16"),
                      (BlocksSpec(), "bfloat16")],
            rounds=20, budget_s=75.0, min_rounds=4, pair_rounds=40, pair_budget_s=40.0,
            process=[("blocks", "bfloat16")], process_steps=400, process_pairs=7,
            dashboard=(MlpSpec(depth=24, width=128, batch=64), "float16"), windows=20, window_s=2.0,
            presses=20, checkpoint=MlpSpec(depth=12, width=512, batch=8), checkpoint_rounds=5,
            replay_steps=100_000)
    if kind == "gpu":
        return Preset(
            "gpu", device,
            overhead=[(GPT2_SMALL, "float16"), (GPT2_SMALL, "bfloat16")],
            rounds=6, budget_s=40.0, min_rounds=2, pair_rounds=10, pair_budget_s=30.0, dashboard=None,
            process=[("gpt2-small", "float16"), ("gpt2-small", "bfloat16")], process_steps=50,
            process_pairs=5, sections=("overhead", "process"))
    raise ValueError(kind)


# ---- running the sections ---------------------------------------------------------------------
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_overhead(p: Preset) -> list[dict]:
    from bench import overhead

    out = []
    for spec, dtype in p.overhead:
        log(f"overhead: {spec.name} {dtype} ...")
        r = overhead.measure(spec, dtype, device=p.device, rounds=p.rounds, min_rounds=p.min_rounds,
                             budget_s=p.budget_s, log=log)
        log(f"  {r['rounds']} rounds of {r.get('block', 1)}-step blocks in {r['seconds']:.1f} s; "
            f"bare {r['contenders']['bare']['step_ms']:.1f} ms/step")
        if r["missing"]:
            log(f"  left out (not installed): {', '.join(r['missing'])}")
        if p.pair_rounds and "run/auto" in r["contenders"]:
            pair = overhead.measure(spec, dtype, device=p.device, rounds=p.pair_rounds, min_rounds=2,
                                    budget_s=p.pair_budget_s, names=("bare", "run/auto"), log=log)
            r["pair"] = {key: pair[key] for key in ("rounds", "block", "seconds")}
            r["pair"]["bare_step_ms"] = pair["contenders"]["bare"]["step_ms"]
            r["pair"]["run/auto"] = pair["contenders"]["run/auto"]
            log(f"  run/auto beside bare alone: {pair['rounds']} rounds in {pair['seconds']:.1f} s")
        out.append(r)
    return out


def run_process(p: Preset) -> list[dict]:
    from bench import whole_process

    out = []
    for model, dtype in p.process:
        log(f"process: amp-tui train (--probe-every 1{' and the defaults' if p.process_auto else ''}) against "
            f"the bare loop, {model} {dtype}, {p.process_steps} steps, "
            f"{p.process_pairs} pairs{' + the baseline checkout' if p.baseline else ''} ...")
        out.append(whole_process.measure(model, dtype, steps=p.process_steps, pairs=p.process_pairs,
                                         device=p.device, threads=p.threads if p.device == "cpu" else None,
                                         baseline=p.baseline, warmup_steps=p.process_warmup_steps,
                                         auto=p.process_auto, log=log))
    return out


def run_readside(p: Preset) -> dict:
    from bench import read_side

    log(f"readside: report, replay --headless and ls: start-up, and at {p.replay_steps:,} steps ...")
    return read_side.measure(p.replay_steps, runs=p.readside_runs, repeats=p.readside_repeats, log=log)


def run_dashboard(p: Preset) -> dict:
    from bench import dashboard

    spec, dtype = p.dashboard
    log(f"dashboard: {spec.name} {dtype}, {p.windows} window(s) of {p.window_s:g} s each way, "
        f"{p.presses} key presses ...")
    return dashboard.measure(spec, dtype, windows=p.windows, window_s=p.window_s, presses=p.presses,
                             device=p.device, log=log)


def run_replay(p: Preset) -> dict:
    from bench import replay_figures

    log(f"replay: {p.replay_steps:,}-step recording ...")
    return replay_figures.measure(p.replay_steps, log=log)


def run_checkpoint(p: Preset) -> dict:
    from bench import checkpoint_io

    log(f"checkpoint: {p.checkpoint.name} + AdamW, {p.checkpoint_rounds} rounds ...")
    return checkpoint_io.measure(p.checkpoint, rounds=p.checkpoint_rounds)


# ---- targets ----------------------------------------------------------------------------------
def verdict(point, lo, hi, *, at_most=None, at_least=None) -> str:
    """PASS/MISS when the 90% interval is on one side of the limit, UNSURE when it straddles it."""
    lo = -math.inf if lo is None and at_most is not None else lo
    hi = math.inf if hi is None else hi
    if at_most is not None:
        if hi <= at_most:
            return "PASS"
        return "MISS" if lo > at_most else "UNSURE"
    if lo is None:  # +inf (every resample found our overhead <= 0) or no interval at all
        lo = math.inf if point is None else -math.inf
    if lo >= at_least:
        return "PASS"
    return "MISS" if hi < at_least else "UNSURE"


def targets(results: dict) -> list[dict]:
    out = []

    def add(name, limit, value, state, note=""):
        out.append({"target": name, "limit": limit, "value": value, "verdict": state, "note": note})

    for r in results.get("overhead", []):
        c = r["contenders"]
        where = f"{r['model']} {r['dtype']}"
        small = r["model"].startswith("blocks-")
        every = SMALL_MODULES_EVERY_STEP_MAX_PCT if small else PROBE_EVERY_STEP_MAX_PCT
        for ours, limit in (("probes/1", every), ("run/1", every),
                            ("probes/10", PROBE_EVERY_10_MAX_PCT), ("run/10", PROBE_EVERY_10_MAX_PCT),
                            ("run/auto", SMALL_MODULES_AUTO_MAX_PCT if small else PROBE_AUTO_MAX_PCT)):
            if ours not in c:
                continue
            row, note, alone = c[ours], "", ""
            if ours == "run/auto" and "pair" in r:   # measured beside bare alone (Preset.pair_rounds)
                row, alone = r["pair"]["run/auto"], " (the two alone)"
                note = f"among all eight contenders: {c[ours]['overhead_pct']:+.1f}%"
            v = row["overhead_pct"]
            lo, hi = row["overhead_pct_90ci"]
            add(f"{ours} over bare{alone}, {where}", f"<= {limit:g}%",
                f"{v:+.1f}% (90% CI {fmt(lo, '+.1f')}..{fmt(hi, '+.1f')})", verdict(v, lo, hi, at_most=limit), note)
        for key, ch in r["cheaper"].items():
            if not key.startswith("DebugUnderflowOverflow"):
                continue
            lo, hi = ch["overhead_ratio_90ci"]
            value = (f"{fmt(ch['overhead_ratio'], '.1f', 'inf')}x "
                     f"(90% CI {fmt(lo, '.1f', 'inf')}..{fmt(hi, '.1f', 'inf')})")
            add(f"DUO overhead / ours ({key.split(' vs ')[1]}), {where}", f">= {CHEAPER_THAN_DUO_MIN:g}x", value,
                verdict(ch["overhead_ratio"], lo, hi, at_least=CHEAPER_THAN_DUO_MIN),
                f"step time DUO/ours {ch['time_ratio']:.2f}")
    for r in results.get("process", []):
        where = f"{r['model']} {r['dtype']}, {r['steps']} steps, {r['pairs']} pairs"
        for name, what_ran, limit in (("amp-tui", "amp-tui train --probe-every 1", WHOLE_PROCESS_MAX_RATIO),
                                      ("amp-tui auto", "amp-tui train (defaults)", WHOLE_PROCESS_DEFAULTS_MAX_RATIO)):
            c = r["contenders"].get(name)
            if c is None:
                continue
            for key, what in (("wall_ratio", "wall"), ("cpu_ratio", "CPU")):
                lo, hi = c[key + "_90ci"]
                add(f"{what_ran} / bare loop, {what} time, {where}", f"<= {limit:g}x",
                    f"{fmt(c[key], '.3f')}x (90% CI {fmt(lo, '.3f')}..{fmt(hi, '.3f')})",
                    verdict(c[key], lo, hi, at_most=limit))
            lo, hi = c["first_step_later_s_90ci"]
            add(f"{what_ran}: first step after the bare loop's, {where}", f"<= {FIRST_STEP_LATER_MAX_S:g} s",
                f"{fmt(c['first_step_later_s'], '+.3f')} s (90% CI {fmt(lo, '+.3f')}..{fmt(hi, '+.3f')})",
                verdict(c["first_step_later_s"], lo, hi, at_most=FIRST_STEP_LATER_MAX_S))
    rs = results.get("readside")
    if rs:
        for name, f in rs["startup"].items():
            add(f"{name} start-up ({rs['short_steps']} steps)", f"<= {rs['startup_max_s']:g} s",
                f"{f['wall_s']:.2f} s (max {f['wall_max_s']:.2f} of {f['runs']})",
                "PASS" if f["wall_max_s"] <= rs["startup_max_s"] else "MISS")
        for name, f in rs["at_scale"].items():
            ok = f["wall_max_s"] <= rs["at_scale_max_s"] and f["max_rss_mb"] <= rs["at_scale_max_mb"]
            add(f"{name} at {rs['steps'] // 1000}k steps", f"<= {rs['at_scale_max_s']:g} s, "
                f"<= {rs['at_scale_max_mb']:g} MB", f"{f['wall_s']:.2f} s (max {f['wall_max_s']:.2f}), "
                f"{f['max_rss_mb']:.0f} MB peak RSS", "PASS" if ok else "MISS")
    d = results.get("dashboard")
    if d and d.get("window_ratios"):
        w = [x for x in d["window_ratios"] if x is not None]
        lo, hi = d.get("median_window_ratio_90ci") or (min(w), max(w))
        add("dashboard attached / headless", f">= {DASHBOARD_MIN_RATIO}",
            f"{fmt(d['median_window_ratio'], '.3f')} (90% CI {fmt(lo, '.3f')}..{fmt(hi, '.3f')})",
            verdict(d["median_window_ratio"], lo, hi, at_least=DASHBOARD_MIN_RATIO),
            f"window pairs {min(w):.3f}..{max(w):.3f}")
    rp = results.get("replay")
    if rp:
        steps = f"{rp['steps'] // 1000}k steps"
        ok = rp["first_frame_worst_any_s"] <= rp["first_frame_target_s"]
        add(f"replay first frame ({steps}, worst of 3 at start and at end)", "<= 2 s",
            f"{rp['first_frame_worst_any_s']:.2f} s", "PASS" if ok else "MISS")
        ok = rp["seek_max_ms"] <= rp["seek_target_s"] * 1e3
        add(f"replay seek ({steps}, max of {rp['seeks']})", "<= 200 ms", f"{rp['seek_max_ms']:.1f} ms",
            "PASS" if ok else "MISS")
    return out


# ---- printing ---------------------------------------------------------------------------------
def fmt(x, spec=".2f", none="-"):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def render(results: dict) -> str:
    lines = []
    m, v = results["machine"], results["versions"]
    lines.append(f"amp-tui benchmarks ({results['kind']}), {results['date']}")
    lines.append(f"  {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, "
                 f"load average at start {m['load_average_at_start']}, device {m['device']}"
                 + (f" ({m['gpu']})" if m.get("gpu") else ""))
    lines.append("  " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    if results.get("checkout"):
        c = results["checkout"]
        lines.append(f"  checkout {c['commit']}, {c['modified_tracked_files']} modified tracked file(s)")
    for r in results.get("overhead", []):
        lines.append("")
        lines.append(f"Per-step cost: {r['description']}, {r['dtype']} on {r['device']}, "
                     f"{r['rounds']} rounds alternating blocks of {r.get('block', 1)} steps ({r['seconds']:.0f} s)")
        rows = []
        for name, c in r["contenders"].items():
            ci = c.get("overhead_pct_90ci")
            rows.append([name, fmt(c["step_ms"]), fmt(c["iqr_ms"]), fmt(c["time_ratio"], ".3f"),
                         fmt(c["overhead_ms"], "+.2f") if name != "bare" else "",
                         fmt(c["overhead_pct"], "+.1f") if name != "bare" else "",
                         f"{fmt(ci[0], '+.1f')}..{fmt(ci[1], '+.1f')}" if ci else "",
                         str(c["skipped_updates"])])
        lines.append(common.table(rows, ["contender", "ms/step", "IQR ms", "x bare", "+ms paired", "+%", "90% CI %",
                                         "skipped"]))
        for key, ch in r["cheaper"].items():
            lo, hi = ch["overhead_ratio_90ci"]
            noise = " (ours within noise of 0)" if ch["ours_within_noise"] else ""
            lines.append(f"  {key}: {fmt(ch['overhead_ratio'], '.1f', 'inf')}x the overhead (90% CI "
                         f"{fmt(lo, '.1f', 'inf')}..{fmt(hi, '.1f', 'inf')}){noise}, "
                         f"{ch['time_ratio']:.2f}x the step time")
        if r["missing"]:
            lines.append(f"  not measured (not installed): {', '.join(r['missing'])}")
        for name, why in r.get("failed", {}).items():
            lines.append(f"  left out, it raised: {name}: {why}")
        auto = r["contenders"].get("run/auto")
        if auto and "schedule_share_pct" in auto:
            ratios = ", ".join(f"{n} {r['contenders'][n]['time_ratio']:.3f}x" for n in ("run/1", "run/10", "run/auto")
                               if n in r["contenders"])
            lines.append(f"  run/auto: one step in {auto['schedule_interval']} probed "
                         f"({100 * auto['probed_share']:.1f}% of the steps); amp-tui's share of the time "
                         f"(probes and records): {fmt(auto['schedule_share_pct'], '.2f')}% as the schedule "
                         f"measured it, {fmt(auto.get('bench_share_pct'), '.2f')}% as measured here (probing's "
                         f"part {fmt(auto.get('bench_probe_share_pct'), '.2f')}%); step time / bare: {ratios}")
        if "pair" in r:
            a, (lo, hi) = r["pair"]["run/auto"], r["pair"]["run/auto"]["overhead_pct_90ci"]
            lines.append(f"  run/auto beside bare alone ({r['pair']['rounds']} rounds of {r['pair']['block']}-step "
                         f"blocks, bare {r['pair']['bare_step_ms']:.2f} ms/step): {a['overhead_pct']:+.2f}% "
                         f"(90% CI {fmt(lo, '+.2f')}..{fmt(hi, '+.2f')}); one step in {a['schedule_interval']} "
                         f"probed ({100 * a['probed_share']:.1f}%); amp-tui's share "
                         f"{fmt(a['schedule_share_pct'], '.2f')}% as the schedule measured it, "
                         f"{fmt(a.get('bench_share_pct'), '.2f')}% as measured here")
    for r in results.get("process", []):
        lines.append("")
        auto = " and with its defaults (amp-tui auto: --probe-every auto)" if "amp-tui auto" in r["contenders"] else ""
        load = r.get("load_average_at_start")
        lines.append(f"Whole process: amp-tui train {r['model']} --headless --dtype {r['dtype']} --steps {r['steps']} "
                     f"--probe-every 1 (amp-tui){auto} against the bare loop, {r['pairs']} pairs "
                     f"({r['seconds']:.0f} s), torch threads {r['threads'] or 'default'}, {r['device']}"
                     + (f", load average at start {load}" if load else ""))
        rows = []
        for name, c in r["contenders"].items():
            def ci(key, spec, c=c):
                lo, hi = c.get(key + "_90ci") or (None, None)
                return f"{fmt(c.get(key), spec)} ({fmt(lo, spec)}..{fmt(hi, spec)})" if key in c else ""
            rows.append([name, fmt(c["wall_s"]), fmt(c["cpu_s"]), fmt(c["first_step_s"], ".3f"),
                         fmt(c["max_rss_mb"], ".0f"), ci("wall_ratio", ".3f"), ci("cpu_ratio", ".3f"),
                         ci("after_first_step_ratio", ".3f"), ci("first_step_later_s", "+.3f")])
        lines.append(common.table(rows, ["", "wall s", "CPU s", "1st step s", "RSS MB", "wall / bare (90% CI)",
                                         "CPU / bare", "after 1st step / bare", "1st step later s"]))
    rs = results.get("readside")
    if rs:
        lines.append("")
        lines.append(f"Read side: new processes, median of {rs['repeats']}; start-up on {rs['short_steps']} steps, "
                     f"at scale on {rs['steps']:,} steps x {rs['layers']} layers ({rs['file_mb']} MB)")
        rows = [[f"{name} (start-up)", fmt(f["wall_s"]), fmt(f["wall_max_s"]), fmt(f["cpu_s"]),
                 fmt(f["max_rss_mb"], ".0f")] for name, f in rs["startup"].items()]
        rows += [[f"{name} ({rs['steps'] // 1000}k steps)", fmt(f["wall_s"]), fmt(f["wall_max_s"]), fmt(f["cpu_s"]),
                  fmt(f["max_rss_mb"], ".0f")] for name, f in rs["at_scale"].items()]
        lines.append(common.table(rows, ["", "wall s", "max s", "CPU s", "peak RSS MB"]))
    d = results.get("dashboard")
    if d:
        lines.append("")
        lines.append(f"Dashboard: {d['description']}, {d['dtype']}, {d['windows_each']} window(s) of "
                     f"{d['window_s']:g} s each way, terminal {d['terminal_size'][0]}x{d['terminal_size'][1]}")
        lines.append(common.table([
            ["headless steps/s", fmt(d["headless_median_steps_per_s"]), " ".join(map(str, d["headless_steps_per_s"]))],
            ["attached steps/s", fmt(d["attached_median_steps_per_s"]), " ".join(map(str, d["attached_steps_per_s"]))],
            ["attached / headless", fmt(d["median_window_ratio"], ".3f"),
             f"90% CI {'..'.join(fmt(x, '.3f') for x in d.get('median_window_ratio_90ci') or ())}; "
             f"per window pair: {' '.join(map(str, d['window_ratios']))}"],
            ["UI thread CPU (attached)", f"{fmt(100 * d['ui_cpu_share'], '.0f')}%",
             f"of one core: event loop, layout and rendering; {fmt(d['ui_refreshes_per_s'], '.1f')} "
             f"refresh_view calls/s ({fmt(100 * d['ui_busy_share'], '.1f')}% of wall time inside them)"],
            ["key s -> engine applies", f"{fmt(d['key_to_effect_median_ms'], '.0f')} ms",
             f"median of {d['key_effects_seen']}/{d['key_presses']}, max {fmt(d['key_to_effect_max_ms'], '.0f')} ms; "
             f"key handled in {fmt(d['key_handled_median_ms'], '.1f')} ms; step {fmt(d['step_ms'], '.0f')} ms"],
        ], ["", "median", "detail"]))
    rp = results.get("replay")
    if rp:
        lines.append("")
        lines.append(f"Replay: {rp['steps']:,} steps x {rp['layers']} layers, {rp.get('file_mb')} MB, "
                     f"{rp.get('events')} events")
        ends = rp.get("first_frame_at_end_s") or []
        rows = [["first frame (index + snapshot)", f"{fmt(rp['first_frame_best_s'])} s best",
                 f"{fmt(rp['first_frame_worst_s'])} s worst of 3"
                 + (f"; opened at the end (--follow): worst {fmt(max(ends))} s" if ends else "")],
                ["seek + snapshot", f"{fmt(rp['seek_median_ms'], '.1f')} ms median",
                 f"{fmt(rp['seek_max_ms'], '.1f')} ms max of {rp['seeks']}"],
                ["memory", f"{fmt(rp.get('tracemalloc_peak_mb'), '.1f')} MB peak",
                 f"kept {fmt(rp.get('tracemalloc_kept_mb'), '.1f')} MB (tracemalloc), index "
                 f"{fmt(rp.get('index_mb'), '.2f')} MB = {fmt(rp.get('index_bytes_per_step'), '.0f')} B/step"],
                ["file bytes per step", fmt(rp.get("bytes_per_step"), ".0f"),
                 f"step line {fmt(rp.get('step_line_bytes'), '.0f')} B (previous encoding "
                 f"{fmt(rp.get('step_line_bytes_previous_encoding'), '.0f')} B)"]]
        if rp.get("recording_written_s"):
            rows.append(["recording written (once, cached)", f"{rp['recording_written_s']:.0f} s", ""])
        lines.append(common.table(rows))
    ck = results.get("checkpoint")
    if ck:
        lines.append("")
        lines.append(f"Checkpoints: {ck['description']} ({ck['state_mb']} MB of tensors), "
                     f"{ck['rounds']} rounds alternating")
        rows = [[name, fmt(c["median_ms"], ".0f"), fmt(c["iqr_ms"], ".0f"), fmt(c["mb_per_s"], ".0f"),
                 f"{c['bytes'] / 1e6:.1f}"] for name, c in ck["contenders"].items()]
        lines.append(common.table(rows, ["", "ms", "IQR ms", "MB/s", "file MB"]))
        lines.append(f"  ours / torch.save: {ck['save_time_ratio_vs_torch_save']:.2f}x the time; / torch.save + "
                     f"fsync: {ck['save_time_ratio_vs_torch_save_fsync']:.2f}x; restore / torch.load: "
                     f"{ck['restore_time_ratio_vs_torch_load']:.2f}x; restored state equal: {ck['restored_equal']}")
    if results.get("targets"):
        lines.append("")
        lines.append("Targets")
        rows = [[t["verdict"], t["target"], t["limit"], t["value"], t["note"]] for t in results["targets"]]
        lines.append(common.table(rows))
    lines.append("")
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("section_seconds", {}).items())
    lines.append(f"total {results.get('total_s', results['elapsed_s']):.0f} s ({sections}); "
                 f"written to {results.get('json_path', '-')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="about 2 minutes: small models, few rounds, 20k replay")
    ap.add_argument("--gpu", action="store_true", help="the overhead benchmark on GPT-2-small size on --device")
    ap.add_argument("--device", default=None, help="cpu (default) or cuda / cuda:N (default with --gpu)")
    ap.add_argument("--only", default=None, help=f"comma-separated sections: {', '.join(SECTIONS)}")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 on the CPU, for stable figures; untouched on a GPU)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="overhead rounds (upper bound; each contender runs a block of 10 steps a round)")
    ap.add_argument("--budget", type=float, default=None, help="seconds per overhead configuration")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON (default bench/results)")
    ap.add_argument("--baseline", type=Path, default=None, metavar="CHECKOUT",
                    help="the process section also runs this checkout's amp-tui train, in the same pairs")
    args = ap.parse_args(argv)

    kind = "gpu" if args.gpu else ("quick" if args.quick else "full")
    device = args.device or ("cuda" if args.gpu else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {device}: no CUDA/ROCm device is available here", file=sys.stderr)
        return 2
    p = presets(kind, device)
    if args.rounds:
        p.rounds = args.rounds
    if args.budget:
        p.budget_s = args.budget
    sections = p.sections if not args.only else tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    elif device == "cpu":
        torch.set_num_threads(1)
    p.threads = torch.get_num_threads()
    p.baseline = args.baseline.resolve() if args.baseline else None

    started = time.perf_counter()
    results: dict = {"kind": kind, "date": common.now_iso(), "machine": common.machine(device),
                     "versions": common.versions(), "checkout": common.checkout(ROOT),
                     "settings": {"sections": list(sections), "torch_threads": torch.get_num_threads(),
                                  "overhead_rounds_max": p.rounds, "overhead_budget_s": p.budget_s,
                                  "command": ["python", *sys.argv]}}
    runners = {"overhead": run_overhead, "process": run_process, "readside": run_readside,
               "dashboard": run_dashboard, "replay": run_replay, "checkpoint": run_checkpoint}
    for section in SECTIONS:
        if section in sections:
            if section == "dashboard" and p.dashboard is None:
                continue
            t = time.perf_counter()
            results[section] = runners[section](p)
            results.setdefault("section_seconds", {})[section] = round(time.perf_counter() - t, 1)
    if "overhead" in results:
        from bench.overhead import REPORTS

        results["what_each_contender_reports"] = REPORTS
    results["targets"] = targets(results)
    results["machine"]["load_average_at_end"] = common.load_average()
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    results["total_s"] = round(time.perf_counter() - STARTED, 1)   # with the imports and set-up
    out_dir = args.out or Path(os.environ.get("AMP_TUI_BENCH_OUT", RESULTS))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{common.stamp()}-{kind}.json"
    try:  # relative to the repository: results are shared, the machine's folders are not
        results["json_path"] = str(path.resolve().relative_to(Path(__file__).resolve().parent.parent))
    except ValueError:
        results["json_path"] = path.name
    path.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
