"""fp8 training (`--dtype fp8`, training/fp8/layers.py and training/step/fp8_training.py): the chosen
nn.Linear layers become torchao's Float8Linear in place and back, keeping their Parameters, hooks
and the optimizer's state; the what-if of the first fp8 step chooses them when no filter file does;
an fp32 module leaves fp8; each fp8 layer's amax on probed steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from amp_tui.training.fp8.layers import Fp8FilterError, Fp8Layers, load_filter, verdict_filter  # noqa: E402
from amp_tui.training.step.engine import GuardedTrainer, PrecisionRefused  # noqa: E402

from support import outlier_model  # noqa: E402


def batches(n=6):
    torch.manual_seed(1)
    return [(torch.randn(64, 32), torch.randint(0, 16, (64,))) for _ in range(n)]


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


ALL = verdict_filter({"0": "fp8", "2": "fp8", "5": "fp8", "8": "fp8"})


def test_conversion_in_place_is_torchaos_and_keeps_parameters_hooks_and_the_optimizer():
    model = outlier_model()
    reference = convert_to_float8_training(copy.deepcopy(model), config=Float8LinearConfig(emulate=True))
    params = [id(p) for p in model.parameters()]
    seen = []
    model[2].register_forward_hook(lambda *_: seen.append("hook"))
    layers = Fp8Layers(model, torch.device("cpu"), ALL)
    assert layers.enter() == ["0", "2", "5", "8"]
    assert all(type(model[i]) is Float8Linear for i in (0, 2, 5, 8))
    assert [id(p) for p in model.parameters()] == params
    x, _ = batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = model(x), reference(x)
    assert torch.equal(ours, theirs)   # the same casts and GEMMs as torchao's own conversion
    assert seen == ["hook"]
    assert layers.leave() == ["0", "2", "5", "8"]
    assert all(type(model[i]) is nn.Linear for i in (0, 2, 5, 8))
    assert not hasattr(model[0], "linear_mm_config") and not hasattr(model[0], "config")
    assert [id(p) for p in model.parameters()] == params


def test_a_layer_in_fp32_leaves_fp8_and_comes_back():
    model = outlier_model()
    layers = Fp8Layers(model, torch.device("cpu"), ALL)
    fp32: list[str] = []
    layers.kept_out = lambda: fp32
    layers.enter()
    fp32.append("5")
    layers.sync()
    assert layers.names == ["0", "2", "8"] and type(model[5]) is nn.Linear
    fp32.clear()
    layers.sync()
    assert layers.names == ["0", "2", "5", "8"]


def test_shape_rule_and_subclasses_stay_out():
    class OwnLinear(nn.Linear):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10), OwnLinear(10, 32))
    layers = Fp8Layers(model, torch.device("cpu"), verdict_filter({"0": "fp8", "1": "fp8", "2": "fp8"}))
    assert layers.enter() == ["0"]   # 10 is no multiple of 16; a subclass keeps its own forward


def test_filter_files_and_what_is_wrong_with_them(tmp_path):
    good = tmp_path / "filter.py"
    good.write_text("def module_filter_fn(module, fqn):\n    return fqn == '2'\n")
    assert load_filter(good)(nn.Linear(16, 16), "2") is True
    with pytest.raises(Fp8FilterError, match="no such file"):
        load_filter(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("def module_filter_fn(:\n")
    with pytest.raises(Fp8FilterError, match="SyntaxError"):
        load_filter(broken)
    empty = tmp_path / "empty.py"
    empty.write_text("FP8_READY = set()\n")
    with pytest.raises(Fp8FilterError, match="defines no module_filter_fn"):
        load_filter(empty)


def trainer(model, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return GuardedTrainer(model, opt, loss_fn, dtype="fp8", **kw), opt


def test_the_first_fp8_step_is_chosen_by_its_what_if_and_d_takes_it_back_to_bf16():
    model = outlier_model()
    params = [id(p) for p in model.parameters()]
    t, opt = trainer(model)
    data = batches()
    first = t.step([data[0]])
    # The what-if of that step chose: the layer behind the massive channels stays in bf16.
    assert first.fp8 is not None and first.fp8["verdict"]["5"].startswith("bf16")
    assert first.fp8_layers == {"layers": ["0", "2", "8"], "source": None, "whatif_step": 0, "asked": False,
                                "linear": 4}
    assert type(model[5]) is nn.Linear and type(model[8]) is Float8Linear
    assert first.dtype == "float8" and first.scale is None and not first.skipped
    # Probed: each fp8 layer's amax with the figures, layer by layer; None for the others.
    amax = dict(zip(t.layer_names, first.figures.fp8))
    assert amax["5"] is None and all(v is not None and v > 0 for v in amax["2"])
    assert amax["0"][0] == pytest.approx(data[0][0].abs().max().item(), rel=1e-6)
    assert amax["8"][1] == pytest.approx(model[8].weight.abs().max().item(), rel=0.01)
    second = t.step([data[1]])
    assert second.fp8 is None and second.fp8_layers is None   # entered once
    t.set_dtype("bf16")
    assert all(type(model[i]) is nn.Linear for i in (0, 2, 5, 8))
    assert [id(p) for p in model.parameters()] == params
    assert len(opt.state) == len(params)   # AdamW's moments, held by the same Parameters
    back = t.step([data[2]])
    assert back.dtype == "bfloat16" and back.figures.fp8 is None and not back.skipped
    # fp8 again: the layers the what-if chose, without another what-if.
    t.set_dtype("fp8")
    again = t.step([data[3]])
    assert again.fp8 is None and again.fp8_layers["layers"] == ["0", "2", "8"]
    assert again.fp8_layers["whatif_step"] == 0   # chosen by step 0's, and said so


def test_a_filter_file_chooses_without_a_what_if(tmp_path):
    chosen = tmp_path / "only_two.py"
    chosen.write_text("def module_filter_fn(module, fqn):\n    return fqn == '2'\n")
    model = outlier_model()
    t, _ = trainer(model, fp8_filter=str(chosen))
    result = t.step([batches(1)[0]])
    assert result.fp8 is None and result.fp8_layers["layers"] == ["2"]
    assert result.fp8_layers["source"] == str(chosen)


def test_fp8_trains_as_torchaos_conversion_does():
    """Step for step, the same losses as the model converted by torchao and stepped by hand."""
    ours_model, data = outlier_model(), batches()
    theirs = convert_to_float8_training(copy.deepcopy(ours_model), config=Float8LinearConfig(emulate=True),
                                        module_filter_fn=lambda m, fqn: fqn in ("0", "2", "8"))
    t, _ = trainer(ours_model, probe=False)
    t.set_dtype("fp8")
    t.fp8.choose({"0": "fp8", "2": "fp8", "8": "fp8"}, 0)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    for batch in data:
        ours = t.step([batch]).loss
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(theirs, batch)
        loss.backward()
        opt.step()
        assert ours == loss.item()


def test_fp8_is_refused_with_a_reason_where_it_cannot_run(monkeypatch):
    from amp_tui.training.step import autocast

    monkeypatch.setattr(autocast.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PrecisionRefused, match=r"amp-tui\[fp8\]"):
        trainer(outlier_model())


def test_several_ranks_need_a_filter_file_to_enter_fp8(tmp_path):
    model = outlier_model()
    t = GuardedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, dtype="bf16")
    t.agree_finite = lambda loss: (lambda: True)   # as several ranks have it
    with pytest.raises(PrecisionRefused, match="--fp8-filter"):
        t.set_dtype("fp8")
    chosen = tmp_path / "filter.py"
    chosen.write_text("def module_filter_fn(module, fqn):\n    return True\n")
    t.fp8.filter_fn = load_filter(chosen)
    assert t.set_dtype("fp8")["after"]["dtype"] == "float8"


def test_a_what_if_asked_of_the_step_that_enters_fp8_is_the_one_that_chooses():
    model = outlier_model()
    t, _ = trainer(model)
    t.request_fp8()
    first = t.step([batches(1)[0]])
    # One what-if, before the step, in the precision it came from: the one that chose the layers.
    assert first.fp8["dtype"] == "bfloat16" and first.fp8["verdict"]["5"].startswith("bf16")
    assert first.fp8_layers["asked"] is True and first.fp8_layers["whatif_step"] == 0
    assert t.step([batches(2)[1]]).fp8 is None   # and none left owed
