"""Replay at scale: a 100,000-step, 50-layer recording, written by the real writer, then indexed,
opened and seeked by the replay source.

    python bench/replay_scale.py            # 100,000 steps x 50 layers (written once, ~1-2 min)
    python bench/replay_scale.py --quick    # 20,000 steps: a few seconds once written
    python bench/replay_scale.py --steps 300000 --layers 80 --dir /tmp/big

The recording goes to a temporary folder named after its size and is reused when present
(`--regen` writes it again). It looks like a real fp16 run: a skip storm at the start (init_scale
65536 overflowing), an occasional overflow when the scaler grows, a 300-step non-finite-loss storm,
a switch to bf16, checkpoints every 10,000 steps, a restore, a pause. Measured in one run:

- first frame: `ReplaySource(path)` (one pass over the file) + the first `snapshot()`, best and
  worst of 3; target <= 2 s. Process start-up (imports) is reported apart;
- memory: tracemalloc peak while indexing + first snapshot, and what stays allocated;
- seeks: `seek(step)` + `snapshot()` to random steps: median and max; target <= 200 ms;
- bytes per step of the file, and of the same records with the previous figure encoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

FIRST_FRAME_TARGET_S = 2.0
SEEK_TARGET_S = 0.2


def layer_names(n: int) -> list[str]:
    names = ["wte", "wpe"]
    block = 0
    while len(names) < n - 1:
        for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            if len(names) < n - 1:
                names.append(f"h.{block}.{part}")
        block += 1
    return (names + ["ln_f"])[:n]


def generate(path: Path, steps: int, layers: int, seed: int = 0) -> None:
    """A realistic recording written with SessionWriter + step_record (see the module docstring)."""
    from amp_tui.recording.format import event_record, step_record
    from amp_tui.recording.writer import SessionWriter
    from amp_tui.training.probes.layer_probes import LayerFigures
    from amp_tui.training.step.engine import StepResult

    rng = random.Random(seed)
    names = layer_names(layers)
    has_underflow = "underflow" in {f.name for f in dataclasses.fields(LayerFigures)}
    # Per-layer base magnitudes and a table of multiplicative noise (cheap per step).
    act0 = [math.exp(rng.uniform(math.log(0.5), math.log(300))) for _ in names]
    grad0 = [math.exp(rng.uniform(math.log(1e-6), math.log(1e-2))) for _ in names]
    weight0 = [math.exp(rng.uniform(math.log(0.02), math.log(3))) for _ in names]
    rows = 509
    noise = [[math.exp(rng.gauss(0, 0.15)) for _ in names] for _ in range(rows)]
    hot = len(names) // 2
    header = {
        "amp_tui_version": "bench", "torch_version": "bench", "python_version": sys.version.split()[0],
        "device": {"type": "cpu", "index": None, "backend": "CPU", "backend_version": None,
                   "name": "synthetic"},
        "script": "bench/gpt_synthetic.py", "argv": [], "command": ["amp-tui", "train", "bench"],
        "dtype": "float16", "init_scale": 65536.0, "steps": steps, "accumulate": 1,
        "max_grad_norm": 1.0, "probe_every": 1, "on_nonfinite": "skip", "checkpoint_every": 10000,
        "optimizer": "AdamW", "scheduler": None, "parameters": 12_345_678, "layers": names,
        "started": "2026-01-01T00:00:00+00:00", "pid": 1, "host": "bench"}
    tmp = path.with_suffix(".partial")
    if tmp.exists():
        tmp.unlink()
    writer = SessionWriter(tmp, header)
    scale, dtype = 65536.0, "float16"
    skipped_total = updates = 0
    t0 = 1_767_225_600.0
    growth = 0
    bounce = False                                       # the scaler grew: the next step overflows
    storm = (int(steps * 0.45), int(steps * 0.45) + 300)   # a non-finite loss storm
    to_bf16 = int(steps * 0.6)
    restore_at = int(steps * 0.3) + 17
    pause_at = int(steps * 0.8)
    for step in range(steps):
        wall = t0 + step * 0.05
        if step == to_bf16:
            writer.write(event_record(step, "intervention", "dtype fp16 → bf16", action="dtype",
                                      value="bfloat16", source="key",
                                      before={"dtype": dtype, "scale": scale, "init_scale": 65536.0},
                                      after={"dtype": "bfloat16", "scale": None, "init_scale": 65536.0}))
            dtype, scale = "bfloat16", None
        if step == restore_at:
            ck = (step // 10000) * 10000
            writer.write(event_record(step, "checkpoint_restored", f"restored checkpoints/step-{ck:07d}"
                                      f".safetensors (saved at step {ck}, float16) before step {step}",
                                      path=f"checkpoints/step-{ck:07d}.safetensors", checkpoint_step=ck,
                                      checkpoint_dtype="float16", checkpoint_kind="full", source="key",
                                      before={"dtype": dtype, "scale": scale, "init_scale": 65536.0},
                                      after={"dtype": dtype, "scale": scale, "init_scale": 65536.0}))
        if step == pause_at:
            for action, state in (("pause", "paused"), ("resume", "running")):
                writer.write(event_record(step, "intervention", action + "d", action=action, value=None,
                                          source="key", before={}, after={"state": state}))
        overflow = step < 10 or bounce
        bad_loss = storm[0] <= step < storm[1]
        skipped = overflow or bad_loss
        grow = 1.0 + step / steps
        n = noise[step % rows]
        act = [a * grow * k for a, k in zip(act0, n)]
        grad = [g * k for g, k in zip(grad0, noise[(step * 7) % rows])]
        weight = [w * (1.0 + 0.2 * step / steps) for w in weight0]
        nonfinite = None
        if bad_loss:
            act[hot] = math.inf
            nonfinite = "loss"
        elif overflow:
            grad[hot] = math.nan
            nonfinite = "gradients"
        figures = LayerFigures(act=act, grad=grad, weight=weight, order=list(range(len(names))))
        if has_underflow:
            figures.underflow = [0.0 if i % 5 else round(rng.random() * 0.01, 6) for i in range(len(names))]
            if scale is not None:
                figures.underflow_scaled = [0.0] * len(names)
        skipped_total += skipped
        updates += not skipped
        loss = math.nan if bad_loss else 6.0 * math.exp(-3 * step / steps) + 0.5 + 0.05 * n[0]
        result = StepResult(step=step, loss=loss, scale=scale, skipped=skipped,
                            skipped_total=skipped_total, updates_applied=updates, dtype=dtype,
                            micro_batches=1, nonfinite=nonfinite, grad_norm=None if skipped else 0.8 * n[1],
                            lr=3e-4, figures=figures, duration=0.05 * n[2], wall_time=wall)
        writer.write(step_record(result))
        if skipped:
            what = ("non-finite loss (NaN) in " + ("fp16" if dtype == "float16" else "bf16")
                    + f"; first non-finite output: {names[hot]}: update skipped") if bad_loss else \
                   (f"gradients overflowed at scale {scale:g}; first non-finite gradient: {names[hot]}: "
                    f"update skipped, scale now {scale / 2:g}")
            writer.write(event_record(step, "nonfinite", what, where=nonfinite, layer=names[hot],
                                      loss="NaN" if bad_loss else loss, scale=scale, dtype=dtype))
        if scale is not None:
            if overflow:
                scale /= 2
                growth, bounce = 0, False
            elif not bad_loss:
                growth += 1
                if growth == 2000:                       # GradScaler's growth_interval
                    scale *= 2
                    growth, bounce = 0, True
        if (step + 1) % 10000 == 0:
            path_text = f"checkpoints/step-{step + 1:07d}.safetensors"
            writer.write(event_record(step + 1, "checkpoint_saved", f"checkpoint {path_text} saved at step "
                                      f"{step + 1} (49.4 MB, 0.21s)", path=path_text,
                                      checkpoint_step=step + 1, dtype=dtype, bytes=49_400_000,
                                      source="checkpoint_every"))
    writer.close({"step": steps, "status": "finished", "updates": updates, "skipped_total": skipped_total,
                  "dtype": dtype, "scale": scale, "time": t0 + steps * 0.05, "exit_status": 0})
    os.replace(tmp, path)


def old_encoding_bytes(path: Path, sample: int = 2000) -> tuple[float, float]:
    """Mean step-line bytes of `sample` step records as written, and with the previous figure
    encoding (5 significant digits written by float repr, shares with 3)."""
    from amp_tui.core import jsonsafe

    def old(v, digits):
        return jsonsafe.encode_float(jsonsafe.read_float(v), digits) if v is not None else None

    new_total = old_total = count = 0
    with open(path, "rb") as fh:
        fh.readline()
        for raw in fh:
            if not raw.startswith(b'{"type":"step"'):
                continue
            record = jsonsafe.loads(raw)
            layers = record.get("layers")
            new_total += len(raw)
            if isinstance(layers, dict):
                record["layers"] = {k: [old(v, 3 if k.startswith("underflow") else 5) for v in vals]
                                    for k, vals in layers.items()}
            old_total += len(jsonsafe.dumps(record)) + 1
            count += 1
            if count >= sample:
                break
    return new_total / count, old_total / count


def rss_bytes() -> int:
    """The resident set size of this process now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def import_seconds() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import amp_tui.sources.replay, amp_tui.recording.timeline"], check=True)
    return time.perf_counter() - t


def default_path(steps: int, layers: int) -> Path:
    return Path(tempfile.gettempdir()) / f"amp-tui-replay-bench-{steps}x{layers}" / "session.jsonl"


def measure(steps: int, layers: int = 50, seeks: int = 50, path: Path | None = None,
            imports: bool = False) -> dict:
    """Every figure of this benchmark as a dict (seconds, bytes); writes the recording first
    when `path` doesn't exist. `bench/replay_figures.py` calls this."""
    from amp_tui.sources.replay import ReplaySource

    path = Path(path) if path is not None else default_path(steps, layers)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        generate(path, steps, layers)
    size = path.stat().st_size
    with open(path, "rb") as fh:  # warm the page cache, as a second look at a run would find it
        while fh.read(8 << 20):
            pass

    # First frame: index + first snapshot (3 tries, no tracing), at the start (replay) and at
    # the end (replay --follow). CPU time is given too: this machine may be shared.
    firsts, cpus, ends = [], [], []
    for _ in range(3):
        t, c = time.perf_counter(), time.process_time()
        src = ReplaySource(path)
        snap = src.snapshot()
        firsts.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
        assert snap.last is not None and snap.total_steps == steps, snap.total_steps
        src.stop()
        t = time.perf_counter()
        src = ReplaySource(path, follow=True)
        snap = src.snapshot()
        ends.append(time.perf_counter() - t)
        assert snap.position == steps - 1 and len(snap.history.steps) <= 2048
        src.stop()

    # Memory: tracemalloc peak while indexing + first snapshot, and what stays allocated.
    tracemalloc.start()
    src = ReplaySource(path)
    src.snapshot()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    index = src.index

    # Seeks to random steps, each producing a snapshot.
    rng = random.Random(1)
    times = []
    for target in [rng.randrange(steps) for _ in range(seeks)] + [steps - 1, 0]:
        t = time.perf_counter()
        src.seek(target)
        snap = src.snapshot()
        times.append(time.perf_counter() - t)
        assert snap.position == target, (snap.position, target)
    src.stop()

    new_line, old_line = old_encoding_bytes(path)
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    figures = {
        "path": f"{path.parent.name}/{path.name}",  # no machine folders in shared results
        "file_mb": round(size / 1e6, 1),
        "events": index.event_count,
        "bytes_per_step": round(size / steps),
        "step_line_bytes": round(new_line),
        "step_line_bytes_previous_encoding": round(old_line),
        "first_frame_s": [round(x, 3) for x in firsts],
        "first_frame_best_s": round(min(firsts), 3),
        "first_frame_worst_s": round(max(firsts), 3),
        "first_frame_cpu_s": [round(x, 3) for x in cpus],
        "first_frame_at_end_s": [round(x, 3) for x in ends],
        "tracemalloc_peak_mb": round(peak / 1e6, 1),
        "tracemalloc_kept_mb": round(kept / 1e6, 1),
        "index_mb": round(index.memory_bytes() / 1e6, 2),
        "index_bytes_per_step": round(index.memory_bytes() / steps, 1),
        "seeks": len(times),
        "seek_median_ms": round(statistics.median(times) * 1e3, 2),
        "seek_max_ms": round(max(times) * 1e3, 2),
        "cpus": os.cpu_count(),
        "load_average": load,
    }
    if imports:
        figures["imports_s"] = round(import_seconds(), 2)
    figures["first_frame_pass"] = max(max(firsts), max(ends)) <= FIRST_FRAME_TARGET_S
    figures["seek_pass"] = max(times) <= SEEK_TARGET_S
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="20,000 steps")
    parser.add_argument("--seeks", type=int, default=50)
    parser.add_argument("--dir", type=Path, default=None, help="where the recording goes")
    parser.add_argument("--regen", action="store_true", help="write the recording again")
    args = parser.parse_args(argv)
    steps = args.steps or (20_000 if args.quick else 100_000)
    path = args.dir / "session.jsonl" if args.dir else default_path(steps, args.layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.regen and path.exists():
        path.unlink()
    if not path.exists():
        t = time.perf_counter()
        print(f"writing {steps:,} steps x {args.layers} layers to {path} ...", flush=True)
        generate(path, steps, args.layers)
        print(f"  written in {time.perf_counter() - t:.1f} s", flush=True)

    f = measure(steps, args.layers, args.seeks, path, imports=True)
    new_line, old_line = f["step_line_bytes"], f["step_line_bytes_previous_encoding"]
    cpus = f["first_frame_cpu_s"]
    rows = [
        ("recording", f"{steps:,} steps x {args.layers} layers, {f['events']:,} events, "
                      f"{f['file_mb']:,.1f} MB"),
        ("file bytes per step", f"{f['bytes_per_step']:,}"),
        ("step line bytes, now", f"{new_line:,} (mean of 2,000 step records)"),
        ("step line bytes, before", f"{old_line:,} (the same records with the previous figure "
                                    f"encoding: {100 * (1 - new_line / old_line):.0f}% saved)"),
        ("first frame (index + snapshot)", f"best {f['first_frame_best_s']:.2f} s, worst "
                                           f"{f['first_frame_worst_s']:.2f} s of 3 (CPU time "
                                           f"{min(cpus):.2f}-{max(cpus):.2f} s)"),
        ("first frame at the end (--follow)", f"best {min(f['first_frame_at_end_s']):.2f} s, worst "
                                              f"{max(f['first_frame_at_end_s']):.2f} s of 3"),
        ("imports (new process)", f"{f['imports_s']:.2f} s (not in the figures above)"),
        ("memory: tracemalloc peak", f"{f['tracemalloc_peak_mb']:.1f} MB while indexing + first snapshot"),
        ("memory: kept", f"{f['tracemalloc_kept_mb']:.1f} MB traced after the first snapshot "
                         f"({f['index_bytes_per_step']:.0f} B/step of index arrays)"),
        (f"seek + snapshot ({f['seeks']})",
         f"median {f['seek_median_ms']:.1f} ms, max {f['seek_max_ms']:.1f} ms"),
    ]
    if f["load_average"] is not None:
        load = ", ".join(f"{x:.1f}" for x in f["load_average"])
        rows.append(("machine", f"{f['cpus']} CPUs, load average {load} (wall times stretch when "
                                "the load is above the CPU count; CPU time does not)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    checks = [("first frame <= 2 s", f["first_frame_pass"]), ("seek <= 200 ms", f["seek_pass"])]
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
