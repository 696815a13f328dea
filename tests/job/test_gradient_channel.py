"""The ranks' words and figures carried in DDP's own gradient all-reduce (job/ranks/gradient_channel.py),
and the collectives of their own where the model's DDP can't carry them: 2 ranks on the CPU
with gloo, GuardedTrainer and Ranks driven as a `Run` drives them.

- A probed step's figures, sent with the next step's gradients (or on their own when asked for
  before it), reach rank 0 as every rank's loss and step time and the maximum over the ranks of
  each layer's output; the gradients' and weights' figures are rank 0's own, the same on both.
- A model whose gradients are bf16, or whose DDP has a communication hook of the script's own
  (on every rank, or on one only), keeps collectives of their own, on both ranks alike, and
  trains the same replicas.
- A loss_fn that calls the inner module (no gradient all-reduce at all) is answered by an
  all-reduce of its own, and the run goes on that way.

Every job is bounded by a timeout (a hang fails the test), and the collectives' own is below it.
"""

from __future__ import annotations

import pytest

from support import run_rank_worker

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

WORKER = '''
import datetime, gc, hashlib, json, sys, weakref
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from amp_tui.job.ranks.distributed import Ranks
from amp_tui.training.step.engine import GuardedTrainer
from amp_tui.training.probes.probe_options import ProbeOptions

out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()

def digest(module):
    return hashlib.sha256(b"".join(p.detach().float().numpy().tobytes() for p in module.parameters())).hexdigest()

def build(kind):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if kind == "bf16":
        net = net.to(torch.bfloat16)
    model = DistributedDataParallel(net)
    if kind == "own hook" or (kind == "rank 0 hook" and rank == 0):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    ranks = Ranks(device=torch.device("cpu"), timeout_s=60, owns_group=False)
    ranks.upcoming = list
    bypass = kind == "bypass"
    def loss_fn(m, batch):
        x, y = batch
        inner = m.module if bypass else m
        return nn.functional.mse_loss(inner(x.to(next(net.parameters()).dtype)).float(), y)
    trainer = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn,
                             dtype="bf16", diagnose=False, probes=ProbeOptions(every=1))
    trainer.agree_finite = ranks.agree_finite
    problem = ranks.carry_in_gradients(model, len(trainer.layer_names))
    return net, ranks, trainer, problem

def batches(n):
    g = torch.Generator().manual_seed(1 + rank)
    xs = [torch.randn(16, 8, generator=g) * (1 + 3 * rank) for _ in range(n)]
    return [(x, x.sum(1, keepdim=True)) for x in xs]

def fig(result):
    f = result.figures
    return {"act": f.act, "grad": f.grad, "weight": f.weight, "loss": result.loss,
            "rank_loss": result.per_rank.loss if result.per_rank else None,
            "rank_time": len(result.per_rank.step_time) if result.per_rank else None}

def scenario(kind):
    net, ranks, trainer, problem = build(kind)
    seen = {"problem": problem, "own": [], "merged": []}
    due = None
    for i, batch in enumerate(batches(4)):
        ranks.agree_commands(list)
        result = trainer.step([batch])
        if due is not None:
            seen["merged"].append(fig(due()))   # as a Run: once the next step's answer is in
        seen["own"].append(fig(result))
        due = ranks.gather_later(result, trainer.layer_names)
        if i == 2:   # asked for before the next step (a pause): sent on their own
            seen["merged"].append(fig(due()))
            due = None
    seen["merged"].append(fig(due()))
    seen["carried"] = ranks._channel is not None
    seen["weights"] = digest(net)
    seen["steps"] = trainer.updates_applied
    trainer.close()
    ranks.close()   # as a Run ends: gloo's threads let go of our collectives' tensors first
    # Nothing of ours keeps the DDP alive: one left to the interpreter's exit outlives its
    # process group, and gloo's threads may abort the process as it goes.
    ddp = weakref.ref(trainer.model)
    del net, ranks, trainer, due, result
    gc.collect()
    seen["ddp_freed"] = ddp() is None
    return seen

kinds = json.loads(sys.argv[2])
(out / f"rank{rank}.json").write_text(json.dumps({k: scenario(k) for k in kinds}))
dist.destroy_process_group()
'''

KINDS = ["fp32", "bf16", "own hook", "rank 0 hook", "bypass"]


def test_the_words_ride_on_the_gradients_where_ddp_lets_them_and_go_on_their_own_where_not(tmp_path):
    r0, r1 = run_rank_worker(tmp_path, WORKER, KINDS)
    assert r0["fp32"]["problem"] is None and r0["fp32"]["carried"] and r1["fp32"]["carried"]
    assert "torch.bfloat16" in r0["bf16"]["problem"]
    assert "communication hook of its own" in r0["own hook"]["problem"]
    # Rank 0's hook alone: both ranks are told, in the same words, and neither carries them.
    assert r0["rank 0 hook"]["problem"] == r1["rank 0 hook"]["problem"] and "hook" in r0["rank 0 hook"]["problem"]
    assert r0["bypass"]["problem"] is None and not r0["bypass"]["carried"] and not r1["bypass"]["carried"]
    for kind in KINDS:
        a, b = r0[kind], r1[kind]
        assert a["steps"] == b["steps"] == 4, kind
        assert a["ddp_freed"] and b["ddp_freed"], kind
        if kind != "bypass":   # (the inner module's gradients are never all-reduced: they differ)
            assert a["weights"] == b["weights"], kind
        assert len(a["merged"]) == 4, kind
        for step, merged in enumerate(a["merged"]):
            mine, theirs = a["own"][step], b["own"][step]
            assert merged["rank_loss"] == pytest.approx([mine["loss"], theirs["loss"]], rel=1e-6), (kind, step)
            assert merged["rank_time"] == 2
            assert merged["act"] == [max(x, y) for x, y in zip(mine["act"], theirs["act"])], (kind, step)
            assert mine["act"] != theirs["act"]   # (rank 1's inputs are larger: the maximum is its)
            for what in ("grad", "weight"):
                if kind != "bypass":   # DDP's all-reduce: the same on both (carried: rank 0's own)
                    assert mine[what] == theirs[what], (kind, step)
                # (Bypassed, they differ, and the gather of its own takes their maximum.)
                assert merged[what] == [max(x, y) for x, y in zip(mine[what], theirs[what])], (kind, step)
        for step, merged in enumerate(b["merged"]):   # the other ranks keep their own
            assert merged["rank_loss"] is None and merged["act"] == b["own"][step]["act"], (kind, step)
