"""The policies given as words are checked where they come in, with the values each takes named."""

import pytest

from amp_tui.core.policies import MONITOR_POLICIES, NONFINITE_POLICIES, checked
from amp_tui.job.config import RunConfig


def test_a_run_config_refuses_an_unknown_policy_when_it_is_made(tmp_path):
    with pytest.raises(ValueError, match=r"on_nonfinite='halt': use 'skip', 'pause', 'stop', 'fallback' or 'isolate'"):
        RunConfig(script=tmp_path / "train.py", on_nonfinite="halt")
    with pytest.raises(ValueError, match=r"fsdp_checkpoint='partial': use 'full', 'sharded' or 'auto'"):
        RunConfig(script=tmp_path / "train.py", fsdp_checkpoint="partial")
    assert RunConfig(script=tmp_path / "train.py", on_nonfinite="isolate").on_nonfinite == "isolate"


def test_the_monitor_policies_are_the_run_policies_a_loop_of_its_own_can_follow():
    assert set(MONITOR_POLICIES) < set(NONFINITE_POLICIES)
    assert checked("on_nonfinite", "skip", MONITOR_POLICIES) == "skip"


def test_a_framework_callback_refuses_a_bad_policy_when_it_is_made():
    from amp_tui.integrations.common import options
    with pytest.raises(ValueError, match="'skip' or 'isolate'"):
        options(None, "Lightning", 'precision="16-mixed"', {"on_nonfinite": "pause"})


def test_the_probe_options_are_checked_as_one_value_where_they_are_made(tmp_path):
    from amp_tui.training.probes.probe_options import ProbeOptions
    assert ProbeOptions() == ProbeOptions("auto", 1.0, 3.0, 10)
    for bad, words in [({"probe_every": 0}, "probe_every=0"), ({"probe_every": "often"}, "probe_every='often'"),
                       ({"probe_budget": 150}, "probe_budget=150"), ({"probe_alert_bits": -1}, "probe_alert_bits=-1"),
                       ({"underflow_every": 0}, "underflow_every=0")]:
        with pytest.raises(ValueError, match=words):
            ProbeOptions.of(**bad)
        with pytest.raises(ValueError, match=words):
            RunConfig(script=tmp_path / "train.py", **bad)
    assert RunConfig(script=tmp_path / "train.py", probe_every=5).probes == ProbeOptions(every=5)


def test_the_monitor_options_are_checked_before_anything_is_hooked():
    import torch

    import amp_tui
    from amp_tui.job.monitor_options import MonitorOptions
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad, words in [({"min_scale": 0.0}, "min_scale=0.0"), ({"checkpoint_every": -1}, "checkpoint_every=-1"),
                       ({"on_nonfinite": "stop"}, "on_nonfinite='stop'"), ({"probe_every": 0}, "probe_every=0")]:
        with pytest.raises(ValueError, match=words):
            MonitorOptions.of(**bad)
        with pytest.raises(ValueError, match=words):
            amp_tui.monitor(model, opt, announce=False, control=False, **bad)
    assert not model._forward_hooks and not opt._optimizer_step_pre_hooks   # nothing was hooked
