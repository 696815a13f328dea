"""The agreed finite-loss check of several ranks goes round while the backward runs: 2 ranks on
the CPU with gloo, the check either carried in DDP's own gradient all-reduce (as a `Run` does
where it can) or in an all-reduce of its own, started before each micro-batch's backward and
waited for after it.

A worker drives GuardedTrainer and Ranks as a `Run` does, under amp-tui's DistributedDataParallel,
the script's own, `no_sync` micro-batches and torch.compile. Rank 1's inputs alone hold a NaN in
one step: both ranks run that micro-batch's backward (the other rank's DDP all-reduce waits for
it), then both throw the gradients away, skip the update and leave the weights and the scaler as
they were, identical across the ranks. An all-reduce of its own answers after each micro-batch,
so the step's remaining micro-batches don't run; the gradients' all-reduce answers with the
last micro-batch (the others are `no_sync`), so every micro-batch runs.

Every job is bounded by a timeout (a hang fails the test), and the collectives' own timeout is
below it.
"""

from __future__ import annotations

import pytest

from support import run_rank_worker

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

# (the wrapper, micro-batches per step, the micro-batch whose input holds the NaN on rank 1,
# torch.compile, the check carried in the gradients' all-reduce): amp-tui's
# DistributedDataParallel or the script's own.
SCENARIOS = [(wrap, accumulate, nan_micro, compiled, carried) for carried in (True, False)
             for wrap, accumulate, nan_micro, compiled in [("amp-tui", 1, 0, False), ("own", 2, 0, False),
                                                          ("own", 2, 1, False), ("amp-tui", 1, 0, True),
                                                          ("amp-tui", 2, 0, True)]]

WORKER = '''
import datetime, hashlib, json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from amp_tui.job.ranks.distributed import Ranks
from amp_tui.training.step.engine import GuardedTrainer

out, scenarios = Path(sys.argv[1]), json.loads(sys.argv[2])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()

def digest(module):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()

def scenario(wrap, accumulate, nan_micro, compiled, carried):
    ranks = Ranks(device=torch.device("cpu"), timeout_s=60, owns_group=False)
    ranks.upcoming = list   # as a Run: each loss check carries the next boundary's (no) commands
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model = DistributedDataParallel(net) if wrap == "own" else ranks.replicate(net)
    if compiled:
        model = torch.compile(model, backend="aot_eager")
    events = []
    def loss_fn(m, batch):
        events.append("loss")
        x, y = batch
        loss = nn.functional.mse_loss(m(x), y)
        loss.register_hook(lambda grad: events.append("backward"))
        return loss
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn, dtype="fp16",
                             init_scale=256.0, diagnose=False, trace_ops=False)
    trainer.agree_finite = ranks.agree_finite
    problem = ranks.carry_in_gradients(model, len(trainer.layer_names)) if carried else None
    g = torch.Generator().manual_seed(1 + rank)
    def micro_batches():
        xs = [torch.randn(16, 8, generator=g) for _ in range(accumulate)]
        return [(x, x.sum(1, keepdim=True)) for x in xs]
    def step(micro):
        ranks.agree_commands(list)
        return ranks.gather_step(trainer.step(micro), trainer.layer_names, details=True)
    step(micro_batches())
    bad = micro_batches()
    if rank == 1:
        bad[nan_micro][0][0, 0] = float("nan")
    before, scaler_before = digest(net), dict(trainer.scaler.state_dict())
    events.clear()
    result = step(bad)
    seen = {"events": list(events), "skipped": result.skipped, "nonfinite": result.nonfinite,
            "scaler_unchanged": trainer.scaler.state_dict() == scaler_before, "scale": trainer.scale,
            "weights_unchanged": digest(net) == before, "weights": digest(net),
            "grads": [p.grad is not None for p in net.parameters()],
            "nonfinite_rank": ranks.nonfinite_rank,
            "per_rank": result.per_rank.nonfinite_rank if result.per_rank is not None else None,
            "problem": problem}
    after = step(micro_batches())
    seen.update(after_skipped=after.skipped, weights_after=digest(net), updates=trainer.updates_applied)
    trainer.close()
    ranks.close()   # as a Run ends: gloo's threads let go of our collectives' tensors first
    return seen

results = [scenario(*s) for s in scenarios]
(out / f"rank{rank}.json").write_text(json.dumps(results))
dist.destroy_process_group()
'''


def test_a_nan_loss_on_one_rank_runs_every_ranks_backward_and_changes_nothing(tmp_path):
    ranks = run_rank_worker(tmp_path, WORKER, SCENARIOS)
    for index, (wrap, accumulate, nan_micro, compiled, carried) in enumerate(SCENARIOS):
        case = f"{wrap} DDP, {accumulate} micro-batches, NaN in micro-batch {nan_micro}" + \
            (", torch.compile" if compiled else "") + (", in the gradients" if carried else ", on its own")
        r0, r1 = ranks[0][index], ranks[1][index]
        for seen in (r0, r1):
            assert seen["problem"] is None, (case, seen)
            # Each micro-batch up to the answer ran its forward and its backward; none after it.
            answered = accumulate - 1 if carried else nan_micro
            assert seen["events"] == ["loss", "backward"] * (answered + 1), (case, seen)
            assert seen["skipped"] and seen["nonfinite"] == "loss", (case, seen)
            assert seen["nonfinite_rank"] == 1, (case, seen)
            assert seen["scaler_unchanged"] and seen["scale"] == 256.0, (case, seen)
            assert seen["weights_unchanged"] and not any(seen["grads"]), (case, seen)
            assert not seen["after_skipped"] and seen["updates"] == 2, (case, seen)
        assert r0["per_rank"] == 1, case   # rank 0's record names rank 1
        assert r0["weights"] == r1["weights"] and r0["weights_after"] == r1["weights_after"], case
