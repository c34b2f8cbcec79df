"""Float32 linears on oneDNN's packed weights (app.model.float32): close to torch's, a row's bits its own, the
packed copy never stale, the model's state dict as before."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from app.model import float32
from app.model.float32 import PackedLinear, plain_copy, to_packed, use_packed

pytestmark = pytest.mark.skipif(not float32.available(), reason="this torch has no oneDNN packed linear")


@pytest.mark.parametrize("rows,inputs,outputs,bias", [(1, 576, 1536, False), (5, 32, 64, True), (3, 7, 3, True),
                                                      (64, 1536, 576, False), (300, 96, 160, True)])
def test_packed_linear_is_close_to_torch(rows, inputs, outputs, bias):
    torch.manual_seed(0)
    linear = nn.Linear(inputs, outputs, bias=bias)
    x = torch.randn(2, rows, inputs)
    got, want = PackedLinear(linear)(x), linear(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * inputs ** 0.5)


@pytest.mark.parametrize("inputs,outputs", [(576, 960), (1536, 576), (896, 4864), (4864, 896), (1024, 4096)])
def test_a_row_of_packed_linear_does_not_depend_on_its_batch(inputs, outputs):
    """Regression: oneDNN sums one row's products (K 1,536) in another order than two rows' or more."""
    torch.manual_seed(1)
    layer = PackedLinear(nn.Linear(inputs, outputs))
    row = torch.randn(1, inputs)
    with torch.inference_mode():  # (as the engine runs: with autograd on, torch takes another route)
        alone = layer(row)
        for rows in (1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 33, 64, 100, 300, 1000):
            together = layer(torch.cat([torch.randn(rows - 1, inputs) * 30, row, torch.randn(2, inputs)]))
            assert torch.equal(alone, together[rows - 1:rows]), rows


def test_packed_copy_follows_a_weight_changed_in_place():
    """Regression: a trainer's weights copied in (load_state_dict, in place) must reach the packed copy."""
    torch.manual_seed(2)
    linear = nn.Linear(64, 32)
    layer = PackedLinear(linear)
    x = torch.randn(3, 64)
    before = layer(x)
    with torch.no_grad():
        linear.weight.mul_(2.0)
    after = layer(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, linear(x), rtol=1e-5, atol=1e-5)


def test_to_packed_keeps_the_state_dict_and_the_greedy_tokens(tiny_llama):
    plain = plain_copy(tiny_llama.loaded.model)  # (the fixture's model may be packed already)
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    model = copy.deepcopy(plain)
    keys = list(plain.state_dict())
    to_packed(model)
    assert list(model.state_dict()) == keys
    assert not any(type(m) is nn.Linear for m in model.modules())
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.inference_mode():
        got, want = model(ids).logits, plain(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        model.load_state_dict({k: v * 0.5 for k, v in plain.state_dict().items()})
        torch.testing.assert_close(model(ids).logits, _halved(plain)(ids).logits, rtol=1e-4, atol=1e-4)


def _halved(model: nn.Module) -> nn.Module:
    halved = copy.deepcopy(model)
    halved.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
    return halved


@pytest.mark.parametrize("setting,faster,packs", [("", True, True), ("", False, False), ("0", True, False)])
def test_use_packed_follows_the_timing_and_the_switch(monkeypatch, setting, faster, packs):
    monkeypatch.setenv("TEXTENV_ONEDNN", setting)
    monkeypatch.setattr(float32, "packed_is_faster", lambda: faster)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert use_packed(model) is packs
    assert isinstance(model[0], PackedLinear) is packs and isinstance(model[2], PackedLinear) is packs


def test_a_packed_layer_trains_on_torch_linear():
    """With gradients wanted, the layer runs torch's linear (oneDNN's packed op has none): a packed model can be a
    policy too."""
    torch.manual_seed(3)
    layer = PackedLinear(nn.Linear(16, 8))
    x = torch.randn(4, 16)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
