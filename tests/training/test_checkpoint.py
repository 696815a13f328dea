"""Checkpoints: exact round trips, refusal of bad files without side effects, atomic saves."""

from __future__ import annotations

import copy
import ctypes
import errno
import json
import math
import os
import pickle
import struct
import subprocess
import sys

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from amp_tui.training.checkpoint import (
    WEIGHTS_NOTICE,
    CheckpointError,
    checkpoint_path,
    cleanup_temporary_files,
    codec,
    list_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from amp_tui.training.checkpoint import io as ckpt_io

SCALER = {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
          "growth_interval": 2000, "_growth_tracker": 3}


# --------------------------------------------------------------------------- helpers


def mlp(hidden: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))


class Tied(nn.Module):
    """An embedding and an LM head sharing one Parameter, like GPT-2's wte / lm_head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


def batch_for(model):
    if isinstance(model, Tied):
        return torch.randint(0, 11, (5, 3))
    return torch.randn(5, 4)


def train(model, optimizer, scheduler=None, steps: int = 3) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(batch_for(model)).pow(2).mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def snapshot(model, optimizer=None, scheduler=None):
    """A deep, detached copy of everything a restore may touch."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
        "sched": copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
    }


def assert_same(a, b, where="value"):
    """Exact equality that also checks types: tuple vs list, float vs int, tensor dtypes."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a} != {b}"
        assert torch.equal(a.cpu(), b.cpu()), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_refused(path, model, optimizer, *words, scheduler=None):
    """read_checkpoint refuses `path` with a one-line message naming it; nothing changes."""
    before = snapshot(model, optimizer, scheduler)
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    for word in words:
        assert word in message, message
    assert_same(snapshot(model, optimizer, scheduler), before, "live state")
    assert torch.equal(torch.get_rng_state(), rng)
    return message


def header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def rewrite_metadata(path, **changes) -> None:
    """Edit header metadata in place, keeping the metadata digest valid (a "well-formed" bad file)."""
    data = path.read_bytes()
    n = header_len(data)
    header = json.loads(data[8:8 + n])
    header["__metadata__"].update(changes)
    header["__metadata__"]["metadata_digest"] = codec.metadata_digest(header["__metadata__"])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def save_model_like_safetensors(model, path) -> None:
    """A weights-only file as a model hub has it: one name per tied pair, format "pt"."""
    safetensors.torch.save_model(model, str(path))


def fused_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def fused_supported() -> bool:
    try:
        p = nn.Parameter(torch.ones(2))
        opt = fused_adamw([p])
        p.grad = torch.ones(2)
        opt.step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


OPTIMIZERS = {
    "adam": lambda ps, lr=1e-2: torch.optim.Adam(ps, lr=lr, betas=(0.8, 0.95)),
    "adam-tensor-lr": lambda ps, lr=1e-2: torch.optim.Adam(ps, lr=torch.tensor(lr), foreach=False),
    "sgd-momentum": lambda ps, lr=1e-2: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True),
    "adamw-foreach": lambda ps, lr=1e-2: torch.optim.AdamW(ps, lr=lr, foreach=True),
    "adamw-fused": lambda ps, lr=1e-2: torch.optim.AdamW(ps, lr=lr, fused=True),
}


@pytest.fixture
def saved(tmp_path):
    """A trained MLP + Adam + StepLR and its checkpoint file."""
    model = mlp()
    opt = OPTIMIZERS["adam"](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(model, opt, sched)
    path = checkpoint_path(tmp_path, 3)
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, scaler_state=SCALER,
                    step=3, dtype="float16", extra={"loss": 0.25})
    return path, model, opt, sched


@pytest.fixture
def target():
    """A differently initialised and trained MLP that restores must leave alone when refusing."""
    model = mlp(seed=1)
    opt = OPTIMIZERS["adam"](model.parameters(), lr=0.5)
    train(model, opt, steps=2)
    return model, opt


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("fresh_target", [False, True], ids=["trained-target", "fresh-target"])
@pytest.mark.parametrize("make_model", [mlp, Tied], ids=["mlp", "tied"])
def test_round_trip_is_exact(tmp_path, name, fresh_target, make_model):
    if name == "adamw-fused" and not fused_supported():
        pytest.skip("fused AdamW is not supported on this CPU build")
    make_opt = OPTIMIZERS[name]
    model = make_model(seed=0)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(model, opt, sched, steps=3)

    path = checkpoint_path(tmp_path, 3)
    extra = {"loss": 0.1 + 0.2, "note": "ünïcode", "pair": (1, 2.5), "nested": {"a": [None, True]},
             "big": 1e38, "tiny": 2.0**-24}
    info = save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, scaler_state=SCALER,
                           step=3, dtype="bf16", extra=extra)
    assert (info.path, info.step, info.dtype, info.kind) == (path, 3, "bfloat16", "full")
    expected = snapshot(model, opt, sched)
    next_rand = torch.rand(4)

    other = make_model(seed=1)
    other_opt = make_opt(other.parameters(), lr=0.5)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=5, gamma=0.1)
    if not fresh_target:
        train(other, other_opt, other_sched, steps=1)

    loaded = read_checkpoint(path, model=other, optimizer=other_opt, scheduler=other_sched)
    assert (loaded.kind, loaded.step, loaded.dtype, loaded.notice) == ("full", 3, "bfloat16", None)
    assert_same(loaded.scaler_state, SCALER, "scaler")
    assert_same(loaded.extra, extra, "extra")
    loaded.apply(other, other_opt, other_sched)

    got = snapshot(other, other_opt, other_sched)
    assert_same(got["model"], expected["model"], "model")
    assert_same(got["optim"], expected["optim"], "optimizer")
    assert_same(got["sched"], expected["sched"], "scheduler")
    assert_same(other_opt.param_groups[0]["betas"] if "betas" in opt.param_groups[0] else None,
                opt.param_groups[0].get("betas"), "betas")
    assert torch.equal(torch.rand(4), next_rand)
    if make_model is Tied:
        assert other.head.weight is other.emb.weight

    # The restored optimizer keeps training exactly like the original.
    torch.manual_seed(7)
    train(model, opt, sched, steps=2)
    torch.manual_seed(7)
    train(other, other_opt, other_sched, steps=2)
    assert_same(snapshot(other)["model"], snapshot(model)["model"], "after more steps")


SCHEDULED = {
    # ReduceLROnPlateau holds best=inf; named parameters add param_names to the groups.
    "plateau-named": (lambda m: torch.optim.Adam(m.named_parameters(), lr=0.1),
                      lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1)),
    "sequential-bf16": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                        lambda o: torch.optim.lr_scheduler.SequentialLR(
                            o, [torch.optim.lr_scheduler.LinearLR(o),
                                torch.optim.lr_scheduler.CosineAnnealingLR(o, 5)], [2])),
    # Adafactor's factored state is not parameter-shaped; restoring into a fresh one must work.
    "adafactor": (lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01),
                  lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9)),
}


@pytest.mark.parametrize("name", list(SCHEDULED))
def test_round_trip_other_optimizers_and_schedulers(tmp_path, name):
    make_opt, make_sched = SCHEDULED[name]
    if name == "adafactor" and not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor needs torch >= 2.5")
    dtype = torch.bfloat16 if "bf16" in name else torch.float32

    def build(seed):
        model = mlp(seed=seed).to(dtype)
        opt = make_opt(model)
        return model, opt, make_sched(opt)

    model, opt, sched = build(0)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(5, 4, dtype=dtype)).float().pow(2).mean().backward()
        opt.step()
        sched.step(1.0) if "plateau" in name else sched.step()
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, scaler_state=None,
                    step=4, dtype="bf16")
    other, other_opt, other_sched = build(1)
    read_checkpoint(path, model=other, optimizer=other_opt, scheduler=other_sched).apply(
        other, other_opt, other_sched)
    assert_same(snapshot(other, other_opt, other_sched), snapshot(model, opt, sched), name)


def test_file_is_standard_safetensors(saved):
    path, model, opt, _ = saved
    tensors = safetensors.torch.load(path.read_bytes())
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "amp-tui-checkpoint" and meta["format_version"] == "1"
    assert meta["step"] == "3" and meta["dtype"] == "float16"
    for k, v in model.state_dict().items():
        assert torch.equal(tensors[f"model.{k}"], v)
    assert torch.equal(tensors["optim.0.exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert tensors["rng.cpu"].dtype == torch.uint8


@pytest.mark.parametrize("scale", [65536.0, 2.0**-24, 1e38])
def test_scaler_state_round_trips_exactly(tmp_path, scale):
    model = mlp()
    opt = OPTIMIZERS["adam"](model.parameters())
    state = dict(SCALER, scale=scale)
    path = tmp_path / "s.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scaler_state=state, step=1, dtype="fp16")
    loaded = read_checkpoint(path, model=model, optimizer=opt)
    assert_same(loaded.scaler_state, state, "scaler")
    assert loaded.scaler_state["scale"].hex() == scale.hex()


@pytest.mark.parametrize("state", [None, {}], ids=["none", "disabled-scaler"])
def test_scaler_state_absent_round_trips(tmp_path, state):
    model = mlp()
    opt = OPTIMIZERS["adam"](model.parameters())
    path = tmp_path / "s.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scaler_state=state, step=0, dtype="float32")
    loaded = read_checkpoint(path, model=model, optimizer=opt)
    assert loaded.scaler_state == state and type(loaded.scaler_state) is type(state)
    assert loaded.extra == {}


@pytest.mark.parametrize("bad_scale", [
    '{"__float__": "nan"}', '{"__float__": "inf"}', "1e999", "NaN", "0.0", "-1.0", '"big"',
])
def test_bad_scaler_state_in_file_is_refused(saved, target, bad_scale):
    path = saved[0]
    rewrite_metadata(path, scaler='{"scale": %s, "_growth_tracker": 0}' % bad_scale)
    assert_refused(path, *target)


def test_negative_growth_tracker_is_refused(saved, target):
    path = saved[0]
    rewrite_metadata(path, scaler=json.dumps(dict(SCALER, _growth_tracker=-1)))
    assert_refused(path, *target, "_growth_tracker")


@pytest.mark.parametrize("scale", [math.nan, math.inf, 0.0, -2.0])
def test_save_refuses_unrestorable_scaler_state(tmp_path, scale):
    model = mlp()
    opt = OPTIMIZERS["adam"](model.parameters())
    path = tmp_path / "s.safetensors"
    with pytest.raises(CheckpointError, match="scale"):
        save_checkpoint(path, model=model, optimizer=opt, scaler_state=dict(SCALER, scale=scale),
                        step=1, dtype="fp16")
    assert list(tmp_path.iterdir()) == []


def test_unserialisable_scheduler_is_skipped_with_a_notice(tmp_path):
    class Warmup:  # a callable object: LambdaLR saves its __dict__, which holds a function
        def __init__(self):
            self.fn = lambda epoch: 1.0

        def __call__(self, epoch):
            return self.fn(epoch)

    model = mlp()
    opt = OPTIMIZERS["adam"](model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Warmup())
    train(model, opt, sched)
    path = tmp_path / "s.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, scaler_state=None, step=3,
                    dtype="fp32")
    loaded = read_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    assert "LambdaLR state not saved" in loaded.notice
    before = sched.state_dict()["last_epoch"]
    loaded.apply(model, opt, sched)
    assert sched.state_dict()["last_epoch"] == before


# --------------------------------------------------------------------------- refusals


def test_truncated_copies_are_refused(saved, target):
    path = saved[0]
    data = path.read_bytes()
    n = header_len(data)
    cases = {0: "empty", 4: "only 4 bytes", 8 + n // 2: "header is cut off",
             8 + n + (len(data) - 8 - n) // 2: "tensor data is cut off",
             len(data) - 1: "tensor data is cut off"}
    for size, words in cases.items():
        cut = path.with_name(f"cut-{size}.safetensors")
        cut.write_bytes(data[:size])
        assert_refused(cut, *target, words)


@pytest.mark.parametrize("data", [b"\x00" * 8, b"{}" + b"\x00" * 7, struct.pack("<Q", 0) + b"{}"],
                         ids=["8-bytes", "9-bytes", "zero-header"])
def test_tiny_and_empty_header_files_are_refused(tmp_path, target, data):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(data)
    assert_refused(path, *target)


def test_header_length_that_looks_like_pickle_is_still_read(tmp_path):
    # A header of 0x280 bytes starts the file with 80 02, the pickle protocol-2 signature.
    model = mlp()
    path = tmp_path / "w.safetensors"
    for pad in range(700):
        data = safetensors.torch.save(dict(model.state_dict()), {"format": "pt", "pad": "x" * pad})
        if header_len(data) == 0x280:
            break
    path.write_bytes(data)
    assert path.read_bytes()[:2] == b"\x80\x02"
    opt = OPTIMIZERS["adam"](model.parameters())
    assert read_checkpoint(path, model=model, optimizer=opt).kind == "weights"


def test_flipped_byte_in_tensor_data_is_refused(saved, target):
    path = saved[0]
    data = bytearray(path.read_bytes())
    n = header_len(data)
    for offset in (8 + n, len(data) - 1, 8 + n + (len(data) - 8 - n) // 3):
        bad = bytearray(data)
        bad[offset] ^= 0x01
        path.write_bytes(bad)
        assert_refused(path, *target, "does not match its digest", "corrupted")


def test_flipped_bytes_anywhere_in_the_header_are_refused(saved, target):
    path = saved[0]
    data = path.read_bytes()
    n = header_len(data)
    model, opt = target
    before = snapshot(model, opt)
    masks = (0x01, 0x20, 0x80)
    for i, offset in enumerate(range(0, 8 + n, 3)):
        bad = bytearray(data)
        bad[offset] ^= masks[i % 3]
        path.write_bytes(bad)
        with pytest.raises(CheckpointError) as info:
            read_checkpoint(path, model=model, optimizer=opt)
        assert "\n" not in str(info.value) and str(path) in str(info.value)
    assert_same(snapshot(model, opt), before, "live state")
    # The targeted case: a changed value inside the header JSON that stays valid JSON.
    bad = data.replace(b'"step":"3"', b'"step":"4"')
    assert bad != data
    path.write_bytes(bad)
    assert_refused(path, *target, "header does not match its digest")


def test_metadata_that_is_not_json_is_refused(saved, target):
    path = saved[0]
    rewrite_metadata(path, optimizer="{not json")
    assert_refused(path, *target, "optimizer entry", "not valid JSON")


def test_checkpoint_for_another_layer_shape_is_refused(saved):
    path = saved[0]
    model = mlp(hidden=16)
    opt = OPTIMIZERS["adam"](model.parameters())
    assert_refused(path, model, opt, "model tensor '0.bias' has shape [8] in the file but [16]")


def test_checkpoint_for_another_architecture_names_missing_keys(saved):
    path = saved[0]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 3))
    opt = OPTIMIZERS["adam"](model.parameters())
    assert_refused(path, model, opt, "missing", "'3.weight'")


def test_checkpoint_with_another_dtype_is_refused(saved):
    path = saved[0]
    model = mlp().half()
    opt = OPTIMIZERS["adam"](model.parameters())
    assert_refused(path, model, opt, "float32 in the file but float16 in the model")


def test_checkpoint_for_another_optimizer_is_refused(saved):
    path = saved[0]
    model = mlp(seed=3)
    opt = OPTIMIZERS["sgd-momentum"](model.parameters())
    assert_refused(path, model, opt, "Adam", "SGD")


def test_checkpoint_with_other_param_groups_is_refused(saved):
    path = saved[0]
    model = mlp(seed=3)
    opt = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    assert_refused(path, model, opt, "parameter groups")


def test_pickle_renamed_to_safetensors_is_never_unpickled(tmp_path, target):
    marker = tmp_path / "unpickled-marker"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "model.safetensors"
    path.write_bytes(pickle.dumps(Payload(), protocol=4))
    assert_refused(path, *target, "pickle")
    assert not list_checkpoints(tmp_path)
    assert not marker.exists()


def test_torch_save_zip_is_refused(tmp_path, target):
    path = tmp_path / "model.safetensors"
    torch.save({"w": torch.ones(2)}, path)
    assert_refused(path, *target, "zip")


def test_missing_file_and_folder_are_refused(tmp_path, target):
    assert_refused(tmp_path / "nope.safetensors", *target, "does not exist")
    folder = tmp_path / "dir.safetensors"
    folder.mkdir()
    assert_refused(folder, *target, "folder")


def test_apply_checks_the_objects_it_is_given(saved):
    path, model, opt, _ = saved
    loaded = read_checkpoint(path, model=model, optimizer=opt)
    other = mlp(hidden=16)
    other_opt = OPTIMIZERS["adam"](other.parameters())
    before = snapshot(other, other_opt)
    with pytest.raises(CheckpointError, match="shape"):
        loaded.apply(other, other_opt)
    assert_same(snapshot(other, other_opt), before, "live state")


# --------------------------------------------------------------------------- weights-only files


def test_weights_only_file_restores_weights_with_notice(tmp_path):
    source = Tied(seed=0)
    path = tmp_path / "model.safetensors"
    save_model_like_safetensors(source, path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert len(list(f.keys())) == len(source.state_dict()) - 1  # one tied name dropped

    model = Tied(seed=1)
    opt = OPTIMIZERS["adam"](model.parameters())
    train(model, opt)
    optim_before = copy.deepcopy(opt.state_dict())
    next_rand = torch.get_rng_state()

    loaded = read_checkpoint(path, model=model, optimizer=opt)
    assert (loaded.kind, loaded.step, loaded.dtype) == ("weights", None, None)
    assert loaded.notice == WEIGHTS_NOTICE
    assert loaded.scaler_state is None and loaded.extra == {}
    loaded.apply(model, opt)
    assert_same(snapshot(model)["model"], snapshot(source)["model"], "weights")
    assert model.head.weight is model.emb.weight
    assert_same(opt.state_dict(), optim_before, "optimizer")
    assert torch.equal(torch.get_rng_state(), next_rand)


def test_weights_only_file_for_another_model_is_refused(tmp_path, target):
    path = tmp_path / "model.safetensors"
    save_model_like_safetensors(mlp(hidden=5), path)
    assert_refused(path, *target, "shape")


# --------------------------------------------------------------------------- files and folders


def test_checkpoint_path_never_reuses_a_name(tmp_path):
    first = checkpoint_path(tmp_path, 123)
    assert first == tmp_path / "step-0000123.safetensors"
    first.write_bytes(b"x")
    second = checkpoint_path(tmp_path, 123)
    assert second == tmp_path / "step-0000123-2.safetensors"
    second.write_bytes(b"x")
    assert checkpoint_path(tmp_path, 123) == tmp_path / "step-0000123-3.safetensors"


def test_list_checkpoints_newest_first_and_skips_partial_files(tmp_path):
    model = mlp()
    opt = OPTIMIZERS["adam"](model.parameters())
    paths = {}
    for i, step in enumerate([1, 5, 3, 5]):
        p = checkpoint_path(tmp_path, step)
        save_checkpoint(p, model=model, optimizer=opt, scaler_state=SCALER, step=step,
                        dtype="fp16")
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
        paths[(step, i)] = p
    weights = tmp_path / "pretrained.safetensors"
    save_model_like_safetensors(model, weights)
    data = paths[(5, 1)].read_bytes()
    (tmp_path / "step-0000009.safetensors").write_bytes(data[:-10])  # interrupted copy
    (tmp_path / ".step-0000010.safetensors.tmp-4242").write_bytes(data)  # temp file
    (tmp_path / "step-0000011.safetensors.tmp").write_bytes(data)
    (tmp_path / "notes.txt").write_text("hello")

    infos = list_checkpoints(tmp_path)
    assert [i.path for i in infos] == [paths[(5, 3)], paths[(5, 1)], paths[(3, 2)],
                                       paths[(1, 0)], weights]
    assert [i.kind for i in infos] == ["full"] * 4 + ["weights"]
    assert infos[0].step == 5 and infos[0].dtype == "float16"
    assert infos[-1].step is None and infos[-1].dtype is None
    assert list_checkpoints(tmp_path / "missing") == []


def test_cleanup_temporary_files(tmp_path):
    keep = [tmp_path / ".gitignore", tmp_path / "step-0000001.safetensors",
            tmp_path / f".step-0000004.safetensors.tmp-{os.getppid()}"]  # a live process's save
    gone = [tmp_path / ".step-0000002.safetensors.tmp-999999999",
            tmp_path / f".step-0000003.safetensors.tmp-{os.getpid()}-7"]
    for p in keep + gone:
        p.write_bytes(b"partial")
    assert cleanup_temporary_files(tmp_path) == 2
    assert all(p.exists() for p in keep)
    assert not any(p.exists() for p in gone)
    assert cleanup_temporary_files(tmp_path / "missing") == 0


def _fail_fsync(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fail_write(path, tensors, metadata):
    path.write_bytes(b"half a checkpoint")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("inject", ["fsync", "write"])
@pytest.mark.parametrize("onto_existing", [False, True], ids=["new-name", "same-name"])
def test_failed_save_leaves_no_temp_file_and_keeps_previous(tmp_path, monkeypatch, inject,
                                                             onto_existing):
    model = mlp()
    opt = OPTIMIZERS["adam"](model.parameters())
    train(model, opt)
    previous = checkpoint_path(tmp_path, 1)
    save_checkpoint(previous, model=model, optimizer=opt, scaler_state=SCALER, step=1,
                    dtype="fp16")
    before = previous.read_bytes()
    train(model, opt)

    if inject == "fsync":
        monkeypatch.setattr(os, "fsync", _fail_fsync)
    else:
        monkeypatch.setattr(ckpt_io, "write_safetensors", _fail_write)
    path = previous if onto_existing else checkpoint_path(tmp_path, 2)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(path, model=model, optimizer=opt, scaler_state=SCALER, step=2,
                        dtype="fp16")
    monkeypatch.undo()

    message = str(info.value)
    assert "No space left on device" in message and str(path) in message
    assert "could not write checkpoint" in message and "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [previous.name]
    assert previous.read_bytes() == before
    read_checkpoint(previous, model=model, optimizer=opt)


def test_raw_bytes_of_bfloat16_without_numpy():
    t = torch.tensor([1.0, -2.0, 3.5], dtype=torch.bfloat16)
    expected = ctypes.string_at(t.data_ptr(), 6)
    assert bytes(codec.raw_bytes(t)) == expected == bytes(t.view(torch.uint8).tolist())


WRITE_PAST_A_FILE_SIZE_LIMIT = '''
import resource, signal, sys
import torch
from torch import nn
from amp_tui.training.checkpoint import CheckpointError, save_checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead
model = nn.Linear(64, 64)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    save_checkpoint(sys.argv[1], model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    scaler_state=None, step=1, dtype="fp32")
except CheckpointError as exc:
    print(exc)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="needs RLIMIT_FSIZE and SIGXFSZ as Linux has them")
def test_a_write_error_inside_safetensors_reads_as_the_system_error(tmp_path):
    # The kernel refuses the write (no injection); the message says so like any OSError would.
    path = tmp_path / "step-0000001.safetensors"
    done = subprocess.run([sys.executable, "-c", WRITE_PAST_A_FILE_SIZE_LIMIT, str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert message == f"could not write checkpoint {path}: {os.strerror(errno.EFBIG)}"
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- torch.compile
# A compiled model's state_dict names its tensors "_orig_mod.…"; checkpoints hold the original
# module's names, so they move between compiled and eager runs.

DATA = os.path.join(os.path.dirname(__file__), "data")


def small_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.fixture(scope="module")
def compiler():
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4))
    except Exception as exc:  # noqa: BLE001 - any failure means no compiled tests here
        pytest.skip(f"torch.compile does not work here ({type(exc).__name__}: {str(exc)[:200]})")
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.parametrize("into", ["eager", "compiled"])
def test_a_compiled_runs_checkpoint_from_before_restores_into_either(into):
    # Written by amp-tui's own safetensors writer, before checkpoints held portable names, from
    # torch.compile(small_net(0)) + Adam(lr=0.1) after two steps: its names are "model._orig_mod.…".
    path = os.path.join(DATA, "compiled-before-portable-names.safetensors")
    saved = safetensors.torch.load_file(path)
    assert {k for k in saved if k.startswith("model.")} == {
        f"model._orig_mod.{n}" for n in small_net().state_dict()}
    net = small_net(seed=1)
    model = torch.compile(net) if into == "compiled" else net
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    loaded = read_checkpoint(path, model=model, optimizer=opt)
    assert (loaded.kind, loaded.step, loaded.dtype) == ("full", 2, "float16")
    loaded.apply(model, opt)
    for name, value in net.state_dict().items():
        assert torch.equal(value, saved[f"model._orig_mod.{name}"]), name
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved["optim.0.exp_avg"])


def test_a_compiled_submodules_checkpoint_restores_into_the_eager_model(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 2)))
    model[1] = torch.compile(model[1])           # names "1._orig_mod.1.weight"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scaler_state=None, step=1, dtype="fp32")
    eager = nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 2)))
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    read_checkpoint(path, model=eager, optimizer=eager_opt).apply(eager, eager_opt)
    assert torch.equal(eager[1][1].weight, model[1]._orig_mod[1].weight)


@pytest.mark.parametrize("direction", ["compiled-to-eager", "eager-to-compiled"])
def test_a_checkpoint_moves_between_compiled_and_eager_runs(tmp_path, compiler, direction):
    source_net, target_net = small_net(seed=0), small_net(seed=1)
    source = torch.compile(source_net) if direction == "compiled-to-eager" else source_net
    target = torch.compile(target_net) if direction == "eager-to-compiled" else target_net
    x = torch.randn(5, 4)
    target(x)                                   # a compiled target has its graph already
    opt = OPTIMIZERS["adam"](source.parameters())
    train(source, opt, steps=2)                 # a compiled source trains compiled
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, model=source, optimizer=opt, scaler_state=SCALER, step=2, dtype="fp32")
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert not [k for k in f.keys() if "_orig_mod" in k]

    target_opt = OPTIMIZERS["adam"](target.parameters(), lr=0.5)
    read_checkpoint(path, model=target, optimizer=target_opt).apply(target, target_opt)
    assert_same(snapshot(target_net, target_opt)["model"], snapshot(source_net)["model"], "model")
    assert_same(target_opt.state_dict()["state"], opt.state_dict()["state"], "optimizer state")
    with torch.no_grad():
        assert torch.allclose(target(x), source_net(x), atol=1e-6)


def test_a_model_whose_own_names_hold_orig_mod_keeps_them(tmp_path):
    class Odd(nn.Module):  # not compiled: "_orig_mod" is just a submodule's name here
        def __init__(self):
            super().__init__()
            self._orig_mod = nn.Linear(2, 2)
            self.weight = nn.Parameter(torch.randn(2, 2))   # "_orig_mod.weight" without "_orig_mod"

    model, other = Odd(), Odd()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    path = tmp_path / "odd.safetensors"
    save_checkpoint(path, model=model, optimizer=opt, scaler_state=None, step=1, dtype="fp32")
    read_checkpoint(path, model=other, optimizer=other_opt).apply(other, other_opt)
    assert_same(snapshot(other)["model"], snapshot(model)["model"], "model")


def test_a_dtype_safetensors_cannot_store_is_named_and_nothing_is_written(tmp_path):
    model = mlp()
    model.register_buffer("phase", torch.zeros(2, dtype=torch.complex128))
    opt = OPTIMIZERS["adam"](model.parameters())
    path = tmp_path / "c.safetensors"
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(path, model=model, optimizer=opt, scaler_state=None, step=1, dtype="fp32")
    assert str(info.value) == (f"could not write checkpoint {path}: tensor model.phase has dtype "
                               "complex128, which safetensors cannot store")
    assert list(tmp_path.iterdir()) == []
