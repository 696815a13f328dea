"""What amp-tui's coordination of several ranks costs per step, over plain DDP running the same
guarded step: each step's words (the agreed finite-loss check, the next boundary's commands and
every rank's stop request) and a probed step's figures, carried two ways:

- **carried**: in DDP's own gradient all-reduce (job/ranks/gradient_channel.py), what a `Run` does where
  the model's DDP allows it. The figures of a probed step go with the next step's gradients.
- **separate**: in collectives of their own (job/ranks/distributed.py), as where it doesn't: the
  check's all-reduce, started before the backward and waited for after it, and the figures'
  gather, started at the end of the step and waited for one step later.

Four copies of the model, each in its own DistributedDataParallel, train side by side in the
same ranks; one step of each in turn (the order shuffled each round, the same on every rank): plain
DDP, the two coordinated copies, and plain DDP again (its difference from the first is the noise
of the run itself: a cost below it is not told apart from none). All run amp-tui's
GuardedTrainer with the same probes; the two coordinated copies do what a `Run`
does around it: the boundary's own all-reduce runs only where no loss check came before it (the
first round); after each step the last probed step's figures are waited for (and rank 0 merges
the ranks' figures), and a probed step's own are sent on (a non-finite step's, with its details,
are waited for at once, as there). Before each timed step every rank meets in a barrier (not
timed), so a step's time on rank 0 is the step itself. Reported: the median step time of each,
the difference in ms and as a share of the plain step, with probes every step and every 10 steps
(a step of each kind weighted by how often it occurs). Targets: <= 3% and <= 1%, for the carried
copy (the exit status says whether they are met).

    python bench/ddp_overhead.py               # 2 ranks on the CPU (gloo), 200 rounds each
    python bench/ddp_overhead.py --quick       # 60 rounds
    python bench/ddp_overhead.py --backend nccl   # 2 GPUs or more: one rank per GPU

It starts its ranks through torch.distributed.run itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

from bench import rank_launch  # noqa: E402

TARGETS = {1: 0.03, 10: 0.01}   # the coordination's share of a plain DDP step
# Plain DDP, amp-tui's words and figures in DDP's gradient all-reduce (what a Run does where the
# model's DDP allows it), in collectives of their own (where it doesn't), and plain DDP again:
# the same step measured twice, whose difference is the run's own noise.
COPIES = ("plain", "carried", "separate", "plain again")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from amp_tui.job.ranks.distributed import Ranks
    from amp_tui.training.probes.probe_options import ProbeOptions
    from amp_tui.training.step.engine import GuardedTrainer
    from bench import common
    from bench.models import MlpSpec, build

    backend = args.backend
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    spec = MlpSpec(depth=args.depth, width=args.width, batch=args.batch)
    clock = common.Clock(str(device))
    results = {}
    for every in (1, 10):
        copies, coordinated = {}, {}
        for name in COPIES:
            model, batches, loss_fn, described = build(spec, str(device), seed=rank)
            ids = [local_rank] if device.type == "cuda" else None
            model = DistributedDataParallel(model.to(device), device_ids=ids)
            trainer = GuardedTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn,
                                     device=device, dtype=args.dtype, init_scale=1024.0,
                                     probes=ProbeOptions(every=every))
            if not name.startswith("plain"):
                ranks = Ranks(device=device, timeout_s=None, owns_group=False)
                trainer.agree_finite = ranks.agree_finite
                ranks.upcoming = list   # as a Run: each loss check carries the next boundary's (no) commands
                if name == "carried":   # as a Run does where the model's DDP allows it
                    problem = ranks.carry_in_gradients(model, len(trainer.layer_names))
                    if problem is not None:
                        raise SystemExit(f"the words can't ride on this model's all-reduce: {problem}")
                coordinated[name] = ranks
            copies[name] = (trainer, batches)
        median = rank_launch.time_copies(copies, coordinated, every=every, rounds=args.rounds,
                                         warmup=args.warmup, clock=clock, barrier=dist.barrier)
        results[every] = rank_launch.costs(median, COPIES, target=TARGETS[every], rounds=args.rounds)
    if rank == 0:
        out = {"benchmark": "ddp_overhead", "when": common.now_iso(), "backend": backend,
               "world_size": dist.get_world_size(), "model": described, "dtype": args.dtype,
               "machine": common.machine(str(device)), "versions": common.versions(),
               "checkout": common.checkout(ROOT), "results": results}
        Path(args.result).write_text(json.dumps(out, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    args = rank_launch.arguments(__doc__.split("\n\n")[0])
    if args.worker:
        worker(args)
        return 0
    from bench import common

    result = args.out / f"{common.stamp()}-ddp-{args.backend}.json"
    started = time.perf_counter()
    out = rank_launch.launch(__file__, args, result)
    if out is None:
        return 1
    print(f"amp-tui coordination over plain DDP: {out['world_size']} ranks, {out['backend']}, {out['model']}, "
          f"{out['dtype']} ({time.perf_counter() - started:.0f} s)")
    met = rank_launch.print_costs(out["results"], COPIES, judged="carried", noise="plain again",
                                  header=["probes", "words", "plain ms", "amp-tui ms", "cost ms", "share", "target",
                                          ""])
    print(f"results: {result}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
