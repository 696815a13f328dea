"""The forward the monitor puts under its own autocast: its outputs converted to fp32 as
Accelerate converts them, the objects the code after the forward holds kept where nothing changed,
and nothing converted while it runs fp32."""

from __future__ import annotations

from collections import namedtuple

import torch
from transformers.modeling_outputs import CausalLMOutput

from amp_tui.training.step.forward_autocast import ForwardAutocast, outputs_to_fp32

Pair = namedtuple("Pair", "a b")


def test_a_model_output_gets_its_half_tensors_as_fp32_in_place():
    out = CausalLMOutput(loss=torch.ones((), dtype=torch.bfloat16), logits=torch.ones(2, dtype=torch.float16))
    converted = outputs_to_fp32(out)
    assert converted is out   # a ModelOutput rebuilt costs more than the conversion
    assert converted.loss.dtype == converted.logits.dtype == torch.float32
    assert converted["logits"] is converted.logits


def test_containers_convert_their_half_tensors_and_keep_their_type():
    half, full = torch.ones(1, dtype=torch.float16), torch.ones(1)
    pair = outputs_to_fp32(Pair(half, full))
    assert isinstance(pair, Pair) and pair.a.dtype == torch.float32 and pair.b is full
    assert [t.dtype for t in outputs_to_fp32([half, (half, 3)])[:1]] == [torch.float32]
    assert outputs_to_fp32([half, (half, 3)])[1][0].dtype == torch.float32
    assert outputs_to_fp32({"x": half})["x"].dtype == torch.float32


def test_outputs_with_nothing_to_convert_are_the_same_objects():
    full = torch.ones(1)
    for value in ([full, 1], (full, "a"), Pair(full, None), {"x": full}):
        assert outputs_to_fp32(value) is value


def test_in_fp32_the_outputs_are_left_as_the_forward_made_them():
    module = torch.nn.Linear(2, 2)
    half = torch.ones(2, dtype=torch.bfloat16)
    module.forward = lambda x: half
    in_half = [False]
    wrapper = ForwardAutocast(module, lambda: torch.autocast("cpu", enabled=False), lambda: in_half[0])
    assert module(torch.ones(2)) is half
    in_half[0] = True
    assert module(torch.ones(2)).dtype == torch.float32
    wrapper.undo()
    assert module(torch.ones(2)) is half
