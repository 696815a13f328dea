"""What AmpTuiCallback costs a Hugging Face Trainer: the same Trainer, with and without the
callback, alternating in blocks of 10 optimizer steps in one process (the order shuffled each round).

Two Trainers train copies of the same GPT-2 (built from a config, no download) on the same
batches, each in a thread of its own that a pacing callback holds at the end of every optimizer
step: the main thread lets one Trainer run one block of steps, then the other. A step's time runs from the
moment its Trainer is let go to the end of its on_step_end, after every other callback's, so it
holds the whole of the Trainer's loop for that step (the batch, the hooks, the logging check) and
all of amp-tui's work, including the boundary at on_step_begin. Only one Trainer has the callback
(one monitor per process), with probes every step, then (a second pass) every 10 steps, then (a
third) with the default, the adaptive schedule (probe_every="auto", 1% budget).

Reported: the optimizer steps/s ratio with the callback / without it, from the paired step
times, with a 90% bootstrap interval (as bench/monitor_overhead.py). Targets: a cost of at most
5% with probes every step (ratio >= 0.95) and at most 1% every 10 and with the default (ratio >= 0.99).

    python bench/integration_overhead.py            # GPT-2 4 blocks d_model 128, fp32 and bf16
    python bench/integration_overhead.py --quick    # 2 blocks d_model 64, fewer rounds
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.models import GptSpec  # noqa: E402
from bench.monitor_overhead import schedule_figures  # noqa: E402

TARGETS = {1: 0.95, 10: 0.99, "auto": 0.99}
EVERY = (1, 10, "auto")   # "auto": the default, the adaptive schedule at its 1% budget


@dataclass(frozen=True)
class Gpt2Spec(GptSpec):
    """The sizes of the benchmark's GPT, built as Hugging Face's GPT2LMHeadModel."""

    @property
    def name(self) -> str:
        return f"hf-gpt2-{self.layers}L-d{self.d_model}"


FULL = [(Gpt2Spec(), "fp32"), (Gpt2Spec(), "bf16")]
QUICK = [(Gpt2Spec(layers=2, d_model=64, heads=2, vocab=1024, seq=32, batch=4), "fp32"),
         (Gpt2Spec(layers=2, d_model=64, heads=2, vocab=1024, seq=32, batch=4), "bf16")]


def build_model(spec: Gpt2Spec):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=spec.layers, n_embd=spec.d_model, n_head=spec.heads,
                                      vocab_size=spec.vocab, n_positions=spec.seq, bos_token_id=0, eos_token_id=0))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, spec: Gpt2Spec, n: int):
        self.ids = torch.randint(0, spec.vocab, (n, spec.seq), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def paced_callback(clock):
    from transformers import TrainerCallback

    class Paced(TrainerCallback):
        """Holds its Trainer at the end of every optimizer step until the main thread says go."""

        def __init__(self):
            self.go, self.done = threading.Event(), threading.Event()
            self.times: list[float] = []
            self.resumed: float | None = None
            self.free = False

        def _wait(self) -> None:
            if not self.free:
                self.go.wait()
                self.go.clear()
            self.resumed = clock()

        def on_step_begin(self, args, state, control, **kwargs):
            if self.resumed is None:   # the first step waits for its first turn
                self._wait()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(clock() - self.resumed)
            self.done.set()
            self._wait()

        def one_step(self) -> None:
            self.done.clear()
            self.go.set()
            self.done.wait()
    return Paced()


class Side:
    """One Trainer in its thread, with or without AmpTuiCallback."""

    def __init__(self, model, spec, dtype, steps, clock, *, probe_every: int | None, run_dir: Path):
        from transformers import Trainer, TrainingArguments

        from amp_tui.integrations.transformers import AmpTuiCallback
        args = TrainingArguments(output_dir=str(run_dir / "hf-out"), max_steps=steps,
                                 per_device_train_batch_size=spec.batch, bf16=dtype == "bf16", use_cpu=True,
                                 logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
                                 dataloader_num_workers=0, seed=0)
        self.trainer = Trainer(model=model, args=args, train_dataset=Tokens(spec, spec.batch * 64))
        self.callback = None
        if probe_every:
            self.callback = AmpTuiCallback(self.trainer, run_dir=run_dir / "run", probe_every=probe_every,
                                           announce=False)
            self.trainer.add_callback(self.callback)
        self.paced = paced_callback(clock)
        self.trainer.add_callback(self.paced)   # last: its on_step_end after amp-tui's
        self.thread = threading.Thread(target=self.trainer.train, daemon=True)
        self.probed: list[bool] = []
        self.schedule = None

    def probing(self) -> bool:
        monitor = self.callback.monitor if self.callback is not None else None
        if monitor is None:
            return False
        self.schedule = monitor.driver.probe_schedule   # kept: the callback lets its monitor go at the end
        return monitor.driver.probing()

    def step(self) -> None:
        self.probed.append(self.probing())
        self.paced.one_step()

    def finish(self) -> None:
        self.paced.free = True
        self.paced.go.set()
        self.thread.join(120)


def measure(spec: Gpt2Spec, dtype: str, every: int, *, rounds: int, warmup: int = 5, block: int = 10,
            seed: int = 0) -> dict:
    model = build_model(spec)
    tmp = Path(tempfile.mkdtemp(prefix="amp-tui-bench-integration-"))
    clock = common.Clock("cpu")
    steps = warmup + rounds * block + 1
    bare = Side(copy.deepcopy(model), spec, dtype, steps, clock, probe_every=None, run_dir=tmp / "bare")
    watched = Side(copy.deepcopy(model), spec, dtype, steps, clock, probe_every=every, run_dir=tmp / "watched")
    rng = random.Random(seed)
    order = [bare, watched]
    for side in order:
        side.thread.start()
    try:
        for _ in range(warmup):
            for side in order:
                side.step()
        gc.collect()
        for _ in range(rounds):
            rng.shuffle(order)
            for side in order:
                for _ in range(block):
                    side.step()
    finally:
        for side in order:
            side.finish()
    n = warmup + rounds * block
    bare_times, watched_times = bare.paced.times[warmup:n], watched.paced.times[warmup:n]
    probed = watched.probed[warmup:n]

    def own(times, idx) -> float:
        return common.stratified_median([times[i] for i in idx], [probed[i] for i in idx], every)

    def ratio(idx) -> float:
        diffs = [watched_times[i] - bare_times[i] for i in idx]
        over = common.stratified_median(diffs, [probed[i] for i in idx], every)
        base = own(bare_times, idx)
        return base / (base + over)

    everything = list(range(rounds * block))
    lo, hi = common.bootstrap_interval(ratio, rounds * block)
    params = sum(p.numel() for p in model.parameters())
    return {"model": spec.name, "description": f"GPT-2 {spec.layers} blocks, d_model {spec.d_model}, vocab "
            f"{spec.vocab}, seq {spec.seq}, batch {spec.batch}, {params / 1e6:.2f} M parameters",
            "dtype": dtype, "probe_every": every, "rounds": rounds, "block": block,
            "bare_step_ms": common.rnd(own(bare_times, everything) * 1e3),
            "watched_step_ms": common.rnd(own(watched_times, everything) * 1e3),
            "steps_per_s_ratio": common.rnd(ratio(everything), 4),
            "ratio_90ci": [common.rnd(lo, 4), common.rnd(hi, 4)], "target": TARGETS[every],
            **schedule_figures(watched.schedule, probed)}


def probes_label(every) -> str:
    return "auto (default)" if every == "auto" else f"probes every {every}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None, help="rounds of 10-step blocks per case")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = QUICK if args.quick else FULL
    rounds = args.rounds or (6 if args.quick else 12)
    results, rows = [], []
    load_at_start = common.load_average()
    for spec, dtype in cases:
        for every in EVERY:
            r = measure(spec, dtype, every, rounds=rounds)
            results.append(r)
            lo, hi = r["ratio_90ci"]
            verdict = "PASS" if lo >= r["target"] else ("MISS" if hi < r["target"] else "UNSURE")
            rows.append([verdict, f"{r['model']} {dtype}", probes_label(every), f"{r['bare_step_ms']} ms",
                         f"{r['watched_step_ms']} ms", f"{r['steps_per_s_ratio']:.3f} (90% CI {lo:.3f}..{hi:.3f})",
                         f">= {r['target']}", f"{100 * r['probed_share']:.0f}%"])
    print("AmpTuiCallback against the same Trainer without it (optimizer steps/s ratio, alternating in one process)")
    print(common.table(rows, ["", "model", "probes", "bare", "with callback", "ratio", "target", "probed"]))
    print(f"load average at start {load_at_start}, at end {common.load_average()}; probed: the share of the "
          "measured steps that were probed")
    if args.json:
        args.json.write_text(json.dumps({"machine": common.machine("cpu"), "versions": common.versions(),
                                         "date": common.now_iso(), "load_average_at_start": load_at_start,
                                         "load_average_at_end": common.load_average(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
