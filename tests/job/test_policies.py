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
