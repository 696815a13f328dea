"""The whole-process benchmark line (`bench/run.py --only process`, run on a GPU by
bench/gpu_check.sh) checked here without a GPU: what the GPU preset runs, the commands it gives each
process, and one tiny pair of real processes on the CPU through the same measuring and summarizing
code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import run as bench_run  # noqa: E402
from bench import whole_process  # noqa: E402
from bench.models import GPT2_SMALL  # noqa: E402


def case_models() -> dict:
    spec = importlib.util.spec_from_file_location("bench_train_case", whole_process.CASE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MODELS


def after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_gpu_preset_runs_the_whole_process_line_on_gpt2_small_in_fp16_and_bf16():
    p = bench_run.presets("gpu", "cuda")
    assert "process" in p.sections
    assert sorted(p.process) == [("gpt2-small", "bfloat16"), ("gpt2-small", "float16")]
    assert p.process_pairs >= 5
    assert case_models()["gpt2-small"] == GPT2_SMALL


@pytest.mark.parametrize("dtype, short", [("float16", "fp16"), ("bfloat16", "bf16")])
def test_both_processes_train_the_same_case_on_the_device(tmp_path, dtype, short):
    cmds = whole_process.commands("gpt2-small", dtype, 50, "cuda", tmp_path, baseline=tmp_path / "other")
    assert set(cmds) == {"amp-tui", "amp-tui auto", "bare", "amp-tui@baseline"}
    for name, (cmd, _env) in cmds.items():
        assert after(cmd, "--device") == "cuda", name
        assert after(cmd, "--dtype") == short, name
        assert after(cmd, "--steps") == "50", name
        assert cmd[cmd.index("--") + 1:] == ["--model", "gpt2-small"], name
        assert str(whole_process.CASE) in cmd, name
    for name in ("amp-tui", "amp-tui@baseline"):
        cmd, _ = cmds[name]
        assert cmd[1:4] == ["-m", "amp_tui", "train"] and "--headless" in cmd
        assert after(cmd, "--probe-every") == "1"
    cmd, env = cmds["amp-tui auto"]   # the defaults: the same command without --probe-every
    assert cmd[1:4] == ["-m", "amp_tui", "train"] and "--headless" in cmd
    assert "--probe-every" not in cmd and "--probe-budget" not in cmd
    assert [a for a in cmds["amp-tui"][0] if a not in ("--probe-every", "1")] == cmd
    assert env["PYTHONPATH"].split(":")[0] == str(ROOT)
    assert set(whole_process.commands("gpt2-small", dtype, 50, "cuda", tmp_path, None, auto=False)) == {
        "amp-tui", "bare"}
    assert cmds["amp-tui"][1]["PYTHONPATH"].split(":")[0] == str(ROOT)
    assert cmds["amp-tui@baseline"][1]["PYTHONPATH"].split(":")[0] == str(tmp_path / "other")


def test_one_pair_of_real_processes_on_the_cpu_gives_every_figure():
    r = whole_process.measure("blocks", "bfloat16", steps=2, pairs=1, device="cpu", threads=1,
                              log=lambda _msg: None)
    assert r["pairs"] == 1 and set(r["contenders"]) == {"amp-tui", "amp-tui auto", "bare"}
    ours, auto, bare = r["contenders"]["amp-tui"], r["contenders"]["amp-tui auto"], r["contenders"]["bare"]
    for c in (ours, auto, bare):
        assert c["wall_s"] > 0 and c["cpu_s"] > 0 and c["max_rss_mb"] > 0
        assert 0 < c["first_step_s"] < c["wall_s"]   # the case stamped its first loss_fn call
    for c in (ours, auto):
        assert c["wall_ratio"] == pytest.approx(c["wall_s"] / bare["wall_s"], rel=1e-3)
        assert c["cpu_ratio"] == pytest.approx(c["cpu_s"] / bare["cpu_s"], rel=1e-3)
    assert r["load_average_at_start"] is None or len(r["load_average_at_start"]) == 3
    rows = bench_run.targets({"process": [r]})
    assert [(t["target"].split(",")[0], t["limit"]) for t in rows] == [
        ("amp-tui train --probe-every 1 / bare loop", "<= 1.05x"),
        ("amp-tui train --probe-every 1 / bare loop", "<= 1.05x"),
        ("amp-tui train --probe-every 1: first step after the bare loop's", "<= 0.15 s"),
        ("amp-tui train (defaults) / bare loop", "<= 1.03x"),
        ("amp-tui train (defaults) / bare loop", "<= 1.03x"),
        ("amp-tui train (defaults): first step after the bare loop's", "<= 0.15 s")]
    assert "and with its defaults (amp-tui auto" in bench_run.render(
        {"kind": "quick", "date": "-", "elapsed_s": 0, "machine": {"cpu": "-", "cores": 2, "torch_threads": 1,
         "load_average_at_start": 0, "device": "cpu"}, "versions": {}, "process": [r], "targets": rows})
