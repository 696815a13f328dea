"""Resume equivalence: save at step m, restore into fresh objects, continue == uninterrupted."""

import torch
from torch import nn

from amp_tui.training.checkpoint import read_checkpoint, save_checkpoint
from amp_tui.training.step.engine import GuardedTrainer

STEPS, SAVE_AT = 12, 5


def build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    trainer = GuardedTrainer(model, opt, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                             dtype="fp16", init_scale=2.0**20, scheduler=sched)
    return trainer


def data():
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(STEPS, 16, 8, generator=g)
    return [(x, x.sum(1, keepdim=True) * 50) for x in xs]  # large enough to skip a few at 2^20


def state(trainer):
    opt = trainer.optimizer.state_dict()
    return ([p.detach().clone() for p in trainer.model.parameters()],
            {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in opt["state"].items()},
            trainer.scaler.state_dict(), trainer.scheduler.state_dict(), trainer.skipped_total)


def test_restore_into_fresh_objects_continues_exactly(tmp_path):
    batches = data()
    torch.manual_seed(123)
    straight = build(0)
    for b in batches:
        straight.step([b])
    assert straight.skipped_total > 0, "the test must cover skipped updates too"

    torch.manual_seed(123)
    first = build(0)
    for b in batches[:SAVE_AT]:
        first.step([b])
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, model=first.model, optimizer=first.optimizer, scheduler=first.scheduler,
                    scaler_state=first.scaler_state(), step=SAVE_AT, dtype=first.dtype,
                    extra=first.checkpoint_extra())
    for b in batches[SAVE_AT:SAVE_AT + 3]:  # the first run goes on and changes RNG and weights
        first.step([b])

    resumed = build(99)  # different initial weights
    loaded = read_checkpoint(path, model=resumed.model, optimizer=resumed.optimizer, scheduler=resumed.scheduler)
    loaded.apply(resumed.model, resumed.optimizer, resumed.scheduler)
    resumed.restore_scaler(loaded.scaler_state)
    resumed.skipped_total = loaded.extra["skipped_total"]
    for b in batches[SAVE_AT:]:
        resumed.step([b])

    p1, o1, sc1, sh1, sk1 = state(straight)
    p2, o2, sc2, sh2, sk2 = state(resumed)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
    assert o1.keys() == o2.keys()
    for k in o1:
        for name in o1[k]:
            assert torch.equal(torch.as_tensor(o1[k][name]), torch.as_tensor(o2[k][name])), (k, name)
    assert sc1 == sc2 and sc1["_growth_tracker"] == sc2["_growth_tracker"]
    assert sh1 == sh2 and sk1 == sk2
