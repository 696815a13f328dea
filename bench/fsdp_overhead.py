"""What amp-tui's coordination of several ranks costs per step over a bare FSDP2 (`fully_shard`)
loop running the same guarded step.

FSDP2 has no communication hook for the words to ride on, so they go in collectives of their
own (job/ranks/distributed.py): the finite-loss check's all-reduce, started before the backward and
waited for after it, and a probed step's figures (each rank's shard maxima of the gradients and
weights, and its activations) gathered to rank 0, started at the end of the step and waited for
one step later, as a `Run` does.

Three copies of the model, each sharded with amp-tui's `shard_model` (per Linear layer, then the
root), train side by side in the same ranks, one step of each in turn (the order shuffled each
round, the same on every rank): the bare loop, amp-tui's, and the bare loop again (its difference
from the first is the run's own noise). All run amp-tui's GuardedTrainer with the same probes
(the sharded step: GradScaler's found_inf agreed through the DTensor gradients, clipping on the
sharded total norm). Before each timed step every rank meets in a barrier (not timed). Reported:
the median step time of each and the difference, with probes every step and every 10 steps.
Targets as DDP's: <= 3% and <= 1% (the exit status says whether they are met).

    python bench/fsdp_overhead.py               # 2 ranks on the CPU (gloo), 200 rounds each
    python bench/fsdp_overhead.py --quick       # 60 rounds
    python bench/fsdp_overhead.py --backend nccl   # 2 GPUs or more: one rank per GPU
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

TARGETS = {1: 0.03, 10: 0.01}   # the coordination's share of a bare FSDP2 step
COPIES = ("bare", "amp-tui", "bare again")


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from amp_tui.job.ranks.distributed import Ranks
    from amp_tui.training.probes.probe_options import ProbeOptions
    from amp_tui.training.sharding import shard_model
    from amp_tui.training.step.engine import GuardedTrainer
    from bench import common
    from bench.models import MlpSpec, build

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    spec = MlpSpec(depth=args.depth, width=args.width, batch=args.batch)
    clock = common.Clock(str(device))
    results = {}
    for every in (1, 10):
        copies, coordinated = {}, {}
        for name in COPIES:
            model, batches, loss_fn, described = build(spec, str(device), seed=rank)   # each rank its data
            model.to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            shard_model(model, optimizer, broadcast_from=0)   # rank 0's weights, then sharded
            trainer = GuardedTrainer(model, optimizer, loss_fn, device=device, dtype=args.dtype,
                                     init_scale=1024.0, max_grad_norm=1.0, probes=ProbeOptions(every=every))
            if name == "amp-tui":
                ranks = Ranks(device=device, timeout_s=None, owns_group=False)
                trainer.agree_finite = ranks.agree_finite
                ranks.upcoming = list   # as a Run: each loss check carries the next boundary's (no) commands
                ranks.carry_in_gradients(model, len(trainer.layer_names))   # refused: collectives of its own
                coordinated[name] = ranks
            copies[name] = (trainer, batches)
        median = rank_launch.time_copies(copies, coordinated, every=every, rounds=args.rounds,
                                         warmup=args.warmup, clock=clock, barrier=dist.barrier)
        results[every] = rank_launch.costs(median, COPIES, target=TARGETS[every], rounds=args.rounds)
    if rank == 0:
        out = {"benchmark": "fsdp_overhead", "when": common.now_iso(), "backend": args.backend,
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

    result = args.out / f"{common.stamp()}-fsdp-{args.backend}.json"
    started = time.perf_counter()
    out = rank_launch.launch(__file__, args, result)
    if out is None:
        return 1
    print(f"amp-tui coordination over a bare FSDP2 loop: {out['world_size']} ranks, {out['backend']}, "
          f"{out['model']}, {out['dtype']} ({time.perf_counter() - started:.0f} s)")
    met = rank_launch.print_costs(out["results"], COPIES, judged="amp-tui", noise="bare again",
                                  header=["probes", "loop", "bare ms", "ms", "cost ms", "share", "target", ""])
    print(f"results: {result}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
