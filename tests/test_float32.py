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
def test_packed_linear_is_close_to_torch(rows, inputs, outputs, bias, monkeypatch):
    torch.manual_seed(0)
    linear = nn.Linear(inputs, outputs, bias=bias).requires_grad_(False)
    x = torch.randn(2, rows, inputs)
    calls = _count_packed_calls(monkeypatch)
    got, want = PackedLinear(linear)(x), linear(x)
    assert calls and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * inputs ** 0.5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("inputs,outputs", [(576, 960), (1536, 576), (896, 4864), (4864, 896), (1024, 4096)])
def test_a_row_of_packed_linear_does_not_depend_on_its_batch(inputs, outputs, threads, monkeypatch):
    """Regression: oneDNN sums one row's products (K 1,536) in another order than two rows' or more."""
    torch.manual_seed(1)
    layer = PackedLinear(nn.Linear(inputs, outputs))
    row = torch.randn(1, inputs)
    calls, before = _count_packed_calls(monkeypatch), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():  # (as the engine runs: wanting a gradient, the layer runs torch's linear)
            alone = layer(row)
            for rows in (1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 33, 64, 100, 300, 1000):
                together = layer(torch.cat([torch.randn(rows - 1, inputs) * 30, row, torch.randn(2, inputs)]))
                assert torch.equal(alone, together[rows - 1:rows]), rows
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 16


def _double_in_place(layer: PackedLinear) -> None:
    layer.weight.mul_(2.0)


def _double_by_data(layer: PackedLinear) -> None:
    layer.weight.data = layer.weight.data * 2.0


def _double_by_new_parameter(layer: PackedLinear) -> None:
    layer.weight = nn.Parameter(layer.weight * 2.0, requires_grad=False)


@pytest.mark.parametrize("change", [_double_in_place, _double_by_data, _double_by_new_parameter])
def test_packed_copy_follows_a_changed_weight(change, monkeypatch):
    """Regression: a trainer's weights copied in (load_state_dict, in place), new storage or a new Parameter must
    reach the packed copy."""
    torch.manual_seed(2)
    linear = nn.Linear(64, 32).requires_grad_(False)
    layer = PackedLinear(linear)
    x = torch.randn(3, 64)
    calls = _count_packed_calls(monkeypatch)
    before = layer(x)
    with torch.no_grad():
        change(layer)
    after = layer(x)
    assert len(calls) == 2 and not torch.allclose(before, after)
    torch.testing.assert_close(after, nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


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
        assert isinstance(model.lm_head, PackedLinear) and model.lm_head.prepared
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


@pytest.mark.parametrize("trained", ["weight", "input"])
def test_where_a_gradient_is_wanted_the_layer_runs_torchs_linear(trained, monkeypatch):
    """oneDNN's packed op has no gradient: a frozen layer under a trained input (LoRA-like) must not drop it."""
    torch.manual_seed(3)
    layer = PackedLinear(nn.Linear(16, 8).requires_grad_(trained == "weight"))
    x = torch.randn(4, 16, requires_grad=trained == "input")
    calls = _count_packed_calls(monkeypatch)
    layer(x).sum().backward()
    grad = layer.weight.grad if trained == "weight" else x.grad
    assert not calls and grad is not None and grad.abs().sum() > 0


def test_a_scheduler_steps_on_packed_weights_and_takes_new_ones(tiny_llama, monkeypatch):
    """Whatever this CPU's timing chose for the fixtures: a backend on a packed model steps on oneDNN, and weights
    loaded between steps (a trainer's) reach the packed copies."""
    from app.backends.local import LocalBackend
    from app.model.loading import wrap

    plain = plain_copy(tiny_llama.loaded.model)
    model = copy.deepcopy(plain)
    to_packed(model)
    backend = LocalBackend(wrap(model, tiny_llama.tokenizer, "tiny-llama-packed"))
    calls = _count_packed_calls(monkeypatch)
    ids = [1, 5, 9, 14, 3, 7]
    try:
        first = _greedy(backend, ids)
        assert calls and first == _greedy_plain(plain, ids)
        assert backend.stats().runs.endswith("; float32 matmuls on oneDNN")
        halved = _halved(plain)
        backend.load_weights(halved.state_dict())
        assert _greedy(backend, ids) == _greedy_plain(halved, ids)
    finally:
        backend.scheduler.release()


def _greedy(backend, ids: list[int], steps: int = 5) -> list[int]:
    from app.model.kvcache import TokenCache

    cache, out = TokenCache(ids), []
    for _ in range(steps):
        logits = backend.scheduler.forward(cache)[0]
        out.append(int(logits[-1].argmax()))
        cache.extend([out[-1]])
    return out


def _greedy_plain(model: nn.Module, ids: list[int], steps: int = 5) -> list[int]:
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def _count_packed_calls(monkeypatch) -> list[int]:
    """A list that grows by one at each call of oneDNN's packed linear."""
    calls: list[int] = []
    real = float32.packed_linear

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(float32, "packed_linear", counted)
    return calls


@pytest.mark.parametrize("faster,shown", [(True, "oneDNN"), (False, "torch")])
def test_the_stats_panel_says_which_library_multiplies_float32(tiny_llama, monkeypatch, faster, shown):
    from app.backends.local import LocalBackend
    from app.model.loading import wrap

    monkeypatch.setattr(float32, "packed_is_faster", lambda: faster)
    loaded = wrap(plain_copy(tiny_llama.loaded.model), tiny_llama.tokenizer, "tiny-llama-matmuls")
    assert loaded.matmuls == shown
    backend = LocalBackend(loaded)
    try:
        assert backend.stats().runs.endswith(f"; float32 matmuls on {shown}")
    finally:
        backend.scheduler.release()


@pytest.mark.parametrize("packed_s,taken", [(0.7, True), (0.9, False)])
def test_onednn_is_taken_only_where_it_is_clearly_faster(monkeypatch, packed_s, taken):
    """On a clock of the test's own a torch run takes 1 s and a packed run `packed_s`: below MARGIN (0.8) of
    torch's time oneDNN is taken, a close call keeps torch's (a start's float32 bits must not follow noise)."""
    import types

    from app.model import timing

    clock = [0.0]
    real = float32.packed_linear

    def perf_counter() -> float:  # a run is timed by two calls: 1 s apart
        clock[0] += 1.0
        return clock[0]

    def packed(*args):
        clock[0] += packed_s - 1.0
        return real(*args)

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(float32, "packed_linear", packed)
    float32.packed_is_faster.cache_clear()
    try:
        assert float32.packed_is_faster() is taken
    finally:
        float32.packed_is_faster.cache_clear()  # (the next caller times the real matmuls)
