"""GuardedTrainer replays a non-finite step op by op (training/trace/step_trace.py): from the RNG state
its micro-batches started from, leaving the run exactly as it would be without the replay, and
never raising what the replay raises."""

import torch
from torch import nn

import amp_tui.training.trace.step_trace as step_trace
from amp_tui.training.step.engine import GuardedTrainer
from amp_tui.training.trace.op_trace import restore_rng_snapshot


def dropout_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def run(trace_ops: bool, steps: int = 4):
    """Steps of two micro-batches at a scale that overflows the gradients until it halved enough."""
    model = dropout_mlp()
    trainer = GuardedTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), mse, dtype="fp16",
                             init_scale=2.0**60, trace_ops=trace_ops)
    torch.manual_seed(5)
    data = batches(2 * steps)
    results = [trainer.step(data[2 * i:2 * i + 2]) for i in range(steps)]
    trainer.rng_after = torch.get_rng_state()
    return model, trainer, results


def test_the_replay_changes_nothing_of_the_run():
    traced_model, traced, traced_results = run(trace_ops=True)
    plain_model, plain, plain_results = run(trace_ops=False)
    assert traced_results[0].skipped and traced_results[0].op_trace is not None
    assert traced_results[0].op_trace["op_phase"] == "backward"
    assert all(r.op_trace is None for r in plain_results)
    assert [r.loss for r in traced_results] == [r.loss for r in plain_results]
    assert [r.skipped for r in traced_results] == [r.skipped for r in plain_results]
    assert traced.scale == plain.scale
    for a, b in zip(traced_model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(traced.rng_after, plain.rng_after)


def test_the_rng_kept_for_each_micro_batch_draws_the_dropout_masks_the_step_drew():
    model, trainer, results = run(trace_ops=True, steps=1)
    data = batches(2)
    losses = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        for batch, rng in zip(data, trainer._batch_rng):
            restore_rng_snapshot(rng)
            losses.append(mse(model, batch).item())
        other = mse(model, data[1]).item()   # the generator moved on: other masks
    assert sum(losses) / 2 == results[0].loss
    assert other != losses[1]


def test_a_replay_that_raises_is_said_and_the_step_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the tracer broke")

    monkeypatch.setattr(step_trace, "trace_step", broken)
    _, trainer, results = run(trace_ops=True, steps=2)
    assert results[0].skipped
    assert results[0].op_trace == {"op_trace_error": "RuntimeError: the tracer broke"}
    assert trainer.step_index == 2


def test_a_replay_that_reaches_a_collective_refuses_it_instead_of_running_it(tmp_path):
    """With several ranks each one replays its own step alone: a collective in it (a
    SyncBatchNorm's, a loss_fn reaching DDP's wrapper) would wait for ranks that never join it.
    The replay refuses it and says so; in a group of one it would have run, and found the op."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 4)

        def synced(batch):
            out = model(batch)
            dist.all_reduce(out.detach().clone())
            return out.float().pow(2).sum()

        fields = step_trace.trace_failing_step(model, synced, [torch.full((2, 4), 3e4)], [None], scale=None,
                                               dtype="fp16", device=torch.device("cpu"), backward=False)
    finally:
        dist.destroy_process_group()
    assert "c10d.allreduce_" in fields["op_trace_error"] and "op" not in fields
