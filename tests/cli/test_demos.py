"""The demos reproduce the failures they describe, and their fixes fix them (acceptance, CPU)."""


from amp_tui.cli import main

from support import DEMOS, strict_lines


def run_demo(name, tmp_path, *flags, steps=8):
    run_dir = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
    assert main(["train", str(DEMOS / f"{name}.py"), "--headless", "--steps", str(steps),
                 "--run-dir", str(run_dir), *flags]) == 0
    lines = strict_lines(run_dir / "session.jsonl")
    return [r for r in lines if r["type"] == "step"], [r for r in lines if r["type"] == "event"]


def nonfinite(events):
    return [e for e in events if e["kind"] == "nonfinite"]


def test_activation_overflow_in_fp16_fixed_by_bf16(tmp_path):
    steps, events = run_demo("activation_overflow", tmp_path)
    bad = nonfinite(events)
    assert bad and all(e["where"] == "loss" for e in bad)
    assert bad[0]["origin"] == "amplifier" and bad[0]["origin_input_nonfinite"] is False
    steps, events = run_demo("activation_overflow", tmp_path, "--dtype", "bf16")
    assert not nonfinite(events) and not any(s["skipped"] for s in steps)


def test_loss_scale_overflow_skips_and_halves_fixed_by_a_small_init_scale(tmp_path):
    steps, events = run_demo("loss_scale_overflow", tmp_path, steps=12)
    skipped = [s for s in steps if s["skipped"]]
    assert len(skipped) >= 5
    assert all(b["scale"] == a["scale"] / 2 for a, b in zip(skipped, skipped[1:]))
    assert all(e["where"] == "gradients" for e in nonfinite(events))
    assert_guards_give_the_verified_fix(events)   # not --init-scale while the events say another
    steps, events = run_demo("loss_scale_overflow", tmp_path, "--init-scale", "8", steps=12)
    assert not any(s["skipped"] for s in steps) and not nonfinite(events)


def verified_fix_before(events, step):
    """The newest fix an op replay verified at or before `step`, and its step."""
    found = [e for e in nonfinite(events) if e.get("fix_verified") and e["step"] <= step]
    return (found[-1]["fix"], found[-1]["step"]) if found else None


def assert_guards_give_the_verified_fix(events):
    """Each guard alert raised once a fix was verified gives that fix, the one the events name."""
    alerts = [e for e in events if e["kind"] == "alert" and e["reason"] in GUARD_REASONS]
    assert alerts
    for alert in alerts:
        fix, step = verified_fix_before(events, alert["step"])
        assert alert["fix"] == f"{fix} (verified on step {step})", alert


GUARD_REASONS = ("scale_drops", "skip_share", "scale_below_one")


def test_attention_overflow_names_the_attention(tmp_path):
    steps, events = run_demo("attention_overflow", tmp_path, steps=11)
    bad = nonfinite(events)
    assert bad and "attn" in bad[0]["origin"]
    # One origin: the module the op replay found the op in, which made the NaN from a finite input
    # (blocks.0.attn.out after it was handed the NaN), named by the event, its message and the alert.
    for e in bad:
        assert e["op_module"] == "blocks.0.attn" and e["origin"] == e["layer"] == "blocks.0.attn"
        assert e["origin_input_nonfinite"] is False and "blocks.0.attn.out" not in e["message"]
    [alert] = [e for e in events if e["kind"] == "alert" and e["reason"] == "skip_share"]
    assert "blocks.0.attn.out" not in alert["message"] and "blocks.0.attn" in alert["cause"]
    assert_guards_give_the_verified_fix(events)
    steps, events = run_demo("attention_overflow", tmp_path, "--dtype", "bf16", steps=3)
    assert not nonfinite(events)


def test_bf16_pretrained_scale_falls_below_one_and_alerts(tmp_path):
    steps, events = run_demo("bf16_pretrained", tmp_path, steps=24)
    assert min(s["scale"] for s in steps) < 1
    alerts = [e for e in events if e["kind"] == "alert" and e["reason"] == "scale_below_one"]
    assert alerts and "bf16" in alerts[0]["fix"]
    assert_guards_give_the_verified_fix(events)   # scale_drops came first: the same fix, not --init-scale
    steps, events = run_demo("bf16_pretrained", tmp_path, "--dtype", "bf16", steps=6)
    assert not nonfinite(events)


def test_healthy_demo_trains(tmp_path):
    steps, events = run_demo("healthy", tmp_path, "--dtype", "bf16", steps=12)
    assert not nonfinite(events)
    assert steps[-1]["loss"] < steps[0]["loss"]
