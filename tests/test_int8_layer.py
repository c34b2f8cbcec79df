"""The fused int8 layer (app.kernels.int8_layer, app/kernels/int8_layer.c): each C piece against its torch counterpart, and whole
passes against the torch layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from app.kernels import attend_rows, int8_layer, native
from app.kernels.int8_layer import fused_layers
from app.kernels.int8_rows import ACT_MAX, FINE, combine_rows_torch
from app.model import ragged
from app.model.int8 import PACKED_FEW_TOKENS, Int8Linear
from app.model.kvcache import new_kv
from app.backends.local import LocalBackend
from app.model.loading import LoadedModel, wrap
from app.model.ragged import Row, ragged_forward
from tests.conftest import logit_tolerance
from tests.native_support import AVX512, VNNI, c_library, needs, needs_amx
from tests.test_int8 import _int8_tiny, real_int8


@pytest.fixture(autouse=True)
def _built():
    c_library()  # a failed C build fails these tests, with the compiler's message


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=gen) * torch.logspace(-3, 2, n).unsqueeze(1)
    x[0] = 0
    return x


def _joined(parts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n = len(parts) // 2
    return (parts[:n].float() + parts[n:].float() / FINE) * scale


def _split_bound(values: torch.Tensor) -> torch.Tensor:
    """How far a split row may lie from its values: half a step of the low part, plus float32 rounding."""
    return values.abs().amax(1, keepdim=True) / ACT_MAX / (2 * FINE) * 1.01 + 1e-6 * values.abs()


@pytest.mark.parametrize("n,width", [(1, 576), (5, 576), (3, 40), (70, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_norm_split_is_the_model_norm_then_the_split(n, width, dtype):
    norm = LlamaRMSNorm(width, eps=1e-5)
    norm.weight.data = torch.rand(width) + 0.5
    x = _rows(n, width, n * width)
    parts, scale = torch.empty(2 * n, width, dtype=dtype), torch.empty(n, 1)
    floats = dtype == torch.float32
    native.library().norm_split(x.data_ptr(), n, width, norm.weight.data_ptr(), 1e-5, ACT_MAX, FINE,
                                parts.data_ptr() if floats else None, None if floats else parts.data_ptr(),
                                scale.data_ptr())
    with torch.no_grad():
        want = norm(x)
    assert ((_joined(parts, scale) - want).abs() <= _split_bound(want)).all()
    assert parts.abs().max() <= ACT_MAX


def test_rotate_gives_transformers_bits():
    n, heads, kv_heads, dim = 6, 4, 2, 64
    y = torch.randn(n, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(n, dim), torch.randn(n, dim)
    q = y[:, :heads * dim].view(1, n, heads, dim).transpose(1, 2)
    k = y[:, heads * dim:(heads + kv_heads) * dim].view(1, n, kv_heads, dim).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos.unsqueeze(0), sin.unsqueeze(0))
    values = y[:, (heads + kv_heads) * dim:].clone()
    native.library().rotate(y.data_ptr(), n, y.shape[1], heads + kv_heads, dim, cos.data_ptr(), sin.data_ptr())
    assert torch.equal(y[:, :heads * dim], want_q.transpose(1, 2).reshape(n, -1))
    assert torch.equal(y[:, heads * dim:(heads + kv_heads) * dim], want_k.transpose(1, 2).reshape(n, -1))
    assert torch.equal(y[:, (heads + kv_heads) * dim:], values)  # values are not rotated


def _sums(n: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sums = torch.randint(-2**20, 2**20, (2 * n, width), generator=gen, dtype=torch.int32)
    return sums, torch.rand(n, 1, generator=gen) / 6e3, torch.rand(width, generator=gen) / 100


@pytest.mark.parametrize("n", [1, 4, 33])
def test_combine_add_is_the_residual_add_with_torch_bits(n):
    sums, scale, weight_scale = _sums(n, 576, n)
    hidden = torch.randn(n, 576)
    want = hidden + combine_rows_torch(sums, scale, weight_scale, None)
    native.library().combine_add(None, sums.data_ptr(), n, 576, FINE, scale.data_ptr(), weight_scale.data_ptr(),
                                 None, hidden.data_ptr())
    assert torch.equal(hidden, want)


@pytest.mark.parametrize("n", [1, 9])
def test_combine_add_norm_split_adds_then_norms_the_new_hidden_state(n):
    sums, scale, weight_scale = _sums(n, 576, 10 + n)
    hidden, weight = torch.randn(n, 576), torch.rand(576) + 0.5
    added = hidden + combine_rows_torch(sums, scale, weight_scale, None)
    parts, parts_scale = torch.empty(2 * n, 576), torch.empty(n, 1)
    native.library().combine_add_norm_split(None, sums.data_ptr(), n, 576, FINE, scale.data_ptr(),
                                            weight_scale.data_ptr(), None, hidden.data_ptr(), weight.data_ptr(),
                                            1e-5, ACT_MAX, parts.data_ptr(), None, parts_scale.data_ptr())
    assert torch.equal(hidden, added)
    want = weight * (added * torch.rsqrt(added.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert ((_joined(parts, parts_scale) - want).abs() <= _split_bound(want)).all()


@pytest.mark.parametrize("n", [1, 6])
def test_combine_silu_split_is_silu_gate_times_up(n):
    sums, scale, weight_scale = _sums(n, 2 * 1536, 20 + n)
    parts, parts_scale = torch.empty(2 * n, 1536, dtype=torch.int8), torch.empty(n, 1)
    native.library().combine_silu_split(None, sums.data_ptr(), n, 2 * 1536, FINE, scale.data_ptr(),
                                        weight_scale.data_ptr(), None, ACT_MAX, None, parts.data_ptr(),
                                        parts_scale.data_ptr())
    gate, up = combine_rows_torch(sums, scale, weight_scale, None).chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert ((_joined(parts, parts_scale) - want).abs() <= _split_bound(want)).all()


def test_the_exponential_holds_silu_to_float32_precision():
    """SiLU at the extremes of its input (the polynomial e^x clamps where 2^k would leave float32's normals)."""
    n = 1
    values = torch.cat([torch.linspace(-100, 100, 765), torch.tensor([0.0, -1e-8, 1e-8])])
    m = len(values)
    sums = torch.cat([values, torch.ones(m), torch.zeros(2 * m)]).view(2 * n, 2 * m)  # gate; up = 1; low parts 0
    parts, parts_scale, ones = torch.empty(2, m), torch.empty(1, 1), torch.ones(2 * m)  # (held: C reads them)
    native.library().combine_silu_split(sums.data_ptr(), None, n, 2 * m, FINE, ones.data_ptr(), ones.data_ptr(),
                                        None, ACT_MAX, parts.data_ptr(), None, parts_scale.data_ptr())
    want = F.silu(values.double()).float()
    assert ((_joined(parts, parts_scale)[0] - want).abs() <= _split_bound(want.unsqueeze(0))[0]).all()


def _both_ways(model, make_rows) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each row's logits through the fused layers, then through the torch layers (fresh caches each time)."""
    with torch.inference_mode():
        fused = ragged_forward(model, make_rows())
        original = ragged.fused_layers
        ragged.fused_layers = lambda model: None
        try:
            plain = ragged_forward(model, make_rows())
        finally:
            ragged.fused_layers = original
    return fused, plain


@pytest.mark.parametrize("which", ["tiny_llama", "real"])
def test_fused_layers_compute_what_the_torch_layers_do(which, request):
    loaded = _int8_tiny(request.getfixturevalue(which)) if which == "tiny_llama" else real_int8(request)
    model = loaded.model
    assert fused_layers(model) is not None  # what every int8 pass here runs, the bitwise tests of test_int8 too
    ids = torch.randint(5, 1000, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    prefix = new_kv(model.config)
    with torch.inference_mode():
        ragged_forward(model, [Row(prefix, ids[:100], 0, 1)])

    def rows() -> list[Row]:
        return [Row(new_kv(model.config), ids[:150], 0, 150), Row(new_kv(model.config), ids[100:103], 100, 3, prefix)]

    fused, plain = _both_ways(model, rows)
    for a, b in zip(fused, plain):
        assert (a - b).abs().max() <= logit_tolerance(loaded)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.98


def test_without_the_library_the_torch_layers_run(tiny_llama, monkeypatch):
    model = _int8_tiny(tiny_llama).model
    monkeypatch.setenv("TEXTENV_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert fused_layers(model) is None
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert fused_layers(model) is not None


def test_float32_models_run_the_torch_layers(tiny_llama):
    assert fused_layers(tiny_llama.model) is None


def test_partial_rotary_models_run_the_torch_layers(tiny_llama):
    """C rotates whole heads; a model that rotates part of each head keeps transformers' rotary."""
    model = _int8_tiny(tiny_llama).model
    model.config.partial_rotary_factor = 0.5
    assert fused_layers(model) is None


@needs(VNNI)
@pytest.mark.parametrize("which,last", [
    ("tiny_llama", 4), ("real", 4),
    # 40 tokens take the packed kernel only on the tiles, for inner sizes on their 64 values (the real model's;
    # the tiny llama's 32 are not, so it never would)
    pytest.param("real", 40, marks=needs_amx())])
def test_the_packed_layer_calls_give_the_bits_of_the_per_piece_calls(which, last, request, monkeypatch):
    """qkv_packed and finish_packed (one C call each, matmuls on app.kernels.int8_mm) against the same pieces called one
    by one with _int_mm's sums: the same functions in the same order, so the same bits. A pass of 1 + 3 + 4
    tokens (packed: up to PACKED_FEW_TOKENS), rows with and without a shared prefix, after a long past; and of
    1 + 3 + 40 tokens where the model takes the packed kernel for any length (AMX: tiles, rows in parallel)."""
    loaded = _int8_tiny(request.getfixturevalue(which)) if which == "tiny_llama" else real_int8(request)
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    if last > PACKED_FEW_TOKENS:  # (AMX: any length)
        assert all(m.packed_for(1 + 3 + last) for m in linears)
    packed_at_load = [m.packed for m in linears]  # (True where the model was loaded with C on: set here anyway)
    ids = torch.randint(5, 1000, (300,), generator=torch.Generator().manual_seed(8)).tolist()
    prefix = new_kv(model.config)
    with torch.inference_mode():
        ragged_forward(model, [Row(prefix, ids[:100], 0, 1)])

    def rows() -> list[Row]:
        past = new_kv(model.config)
        ragged_forward(model, [Row(past, ids[:150], 0, 1)])
        return [Row(new_kv(model.config), ids[:1], 0, 1), Row(new_kv(model.config), ids[100:103], 100, 3, prefix),
                Row(past, ids[150:150 + last], 150, 4)]

    real, chosen = Int8Linear.packed_for, []

    def counted(linear: Int8Linear, tokens: int) -> bool:  # (what each layer answers the C calls' bindings)
        answer = real(linear, tokens)
        if linear is not model.lm_head:  # (the LM head asks too, in torch, after the layers)
            chosen.append(answer)
        return answer

    monkeypatch.setattr(Int8Linear, "packed_for", counted)
    try:
        with torch.inference_mode():
            for m in linears:
                m.packed = True
            few = rows()
            chosen.clear()
            packed = ragged_forward(model, few)
            # (the packed calls ran: before attention for qkv_proj, after it for o_proj, gate_up and down_proj, in
            # each layer; or none asked where one call ran every layer, which has the packed kernel only)
            assert chosen in ([], [True] * 4 * len(model.model.layers))
            for m in linears:
                m.packed = False
            pieces = ragged_forward(model, rows())
    finally:
        for m, was in zip(linears, packed_at_load):
            m.packed = was
    assert all(torch.equal(a, b) for a, b in zip(packed, pieces))


def _int8_heads64(tokenizer) -> LoadedModel:
    """A tiny random int8 Llama with 64-value heads, whose rows attend in app/kernels/attend_rows.c as the real model's do."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    return LocalBackend(wrap(LlamaForCausalLM(config), tokenizer, "tiny-llama-64-int8", weights="int8"))


@needs(AVX512)  # the rows attend in app/kernels/attend_rows.c, whose fast path is AVX-512 code
@pytest.mark.parametrize("which", ["tiny64", "real"])
def test_every_layer_in_one_call_gives_the_bits_of_the_calls_layer_by_layer(which, request, monkeypatch):
    """forward_layers (FusedInt8Layers.whole_pass): a pass whose rows all attend in app/kernels/attend_rows.c runs every
    layer in one C call; against the same calls made layer by layer from Python, each row's logits and its cache's
    keys and values bit for bit. A pass of rows decoding and drafting over a shared prefix and one after its own
    past, then one of a decoding row beside 40 new tokens (one call wherever the layers have the packed kernel,
    whatever the tokens; layer by layer those 41 take `_int_mm` where the packed kernel is for few: no AMX)."""
    loaded = _int8_heads64(request.getfixturevalue("tokenizer")) if which == "tiny64" else real_int8(request)
    model = loaded.model
    assert attend_rows.available(model.config)
    ids = torch.randint(5, 1000, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    real, taken = int8_layer.FusedInt8Layers.whole_pass, []

    def run(one_call: bool) -> tuple[list[torch.Tensor], list]:
        def whole_pass(self, *args) -> bool:
            taken.append(one_call and real(self, *args))
            return taken[-1]

        monkeypatch.setattr(int8_layer.FusedInt8Layers, "whole_pass", whole_pass)
        with torch.inference_mode():
            prefix, past, kvs = new_kv(model.config), new_kv(model.config), [new_kv(model.config) for _ in range(3)]
            ragged_forward(model, [Row(prefix, ids[:100], 0, 1)])
            ragged_forward(model, [Row(past, ids[:150], 0, 1)])
            taken.clear()
            logits = ragged_forward(model, [Row(kvs[0], ids[100:101], 100, 1, prefix),
                                            Row(kvs[1], ids[100:105], 100, 5, prefix), Row(past, ids[150:153], 150, 3)])
            logits += ragged_forward(model, [Row(kvs[0], ids[101:102], 101, 1, prefix),
                                             Row(kvs[2], ids[100:140], 100, 2, prefix)])
        return logits, [(layer.keys, layer.values) for kv in (past, *kvs) for layer in kv.layers]

    one_call, by_layer = run(True), run(False)
    assert taken == [False, False]  # (the second run's passes)
    assert all(torch.equal(a, b) for a, b in zip(one_call[0], by_layer[0]))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one_call[1], by_layer[1]))
    run(True)
    assert taken == [all(m.packed for m in linears)] * 2
