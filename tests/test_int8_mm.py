"""The VNNI / AMX int8 matmul (app/kernels/int8_mm.c): the integer sums of torch._int_mm, bit for bit, for any shape."""

import copy
from types import SimpleNamespace

import pytest
import torch

from app.kernels import int8_mm
from app.kernels.int8_mm import PackedWeight
from app.kernels.int8_rows import QMAX
from app.model.int8 import Int8Linear, to_int8
from tests.native_support import AMX, VNNI, amx_off, c_library, missing, needs, needs_amx

needs_vnni = needs(VNNI)
LIKE_SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536)


@pytest.fixture(autouse=True)
def _built():
    c_library()  # a failed C build fails these tests, with the compiler's message


def test_the_library_has_the_vnni_kernel_where_the_cpu_has_vnni():
    """Runs on every CPU: the library (built with -march=native) has the packed kernel exactly where the CPU
    has AVX-512 VNNI, and the tile unit where it has AMX too (unless TEXTENV_AMX=0 keeps the tiles off)."""
    assert int8_mm.available() is (missing(VNNI) is None)
    assert int8_mm.any_tokens(LIKE_SMOLLM2) is (missing(VNNI, AMX) is None and amx_off() is None)


def _sums(parts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return parts.long().matmul(weight.long().t()).int()


@needs_vnni
@pytest.mark.parametrize("shape", [(960, 576), (7, 5), (33, 64), (100, 130), (576, 1536), (1, 4)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 8, 9, 16, 17, 40, 208])
def test_packed_sums_are_the_integer_sums(shape, rows):
    """Channels and inner sizes off the kernel's blocks (padded), rows off its tiles of 8; parts over the whole
    signed byte range (the kernel adds 128 to make them unsigned and takes 128 * a channel's sum off again).
    With AMX, inner sizes of 64, 576 and 1536 from 6 rows on take the tile unit: rows off its 16 and 32 too."""
    out, inner = shape
    gen = torch.Generator().manual_seed(out * inner + rows)
    weight = torch.randint(-QMAX, QMAX + 1, shape, generator=gen, dtype=torch.int8)
    parts = torch.randint(-128, 128, (rows, inner), generator=gen, dtype=torch.int8)
    assert torch.equal(PackedWeight(weight).mm(parts), _sums(parts, weight))


@needs_vnni
def test_packed_sums_at_their_largest():
    """Every product at its largest magnitude, both signs: int32 sums far beyond int16, no saturation."""
    weight = torch.full((64, 1536), -QMAX, dtype=torch.int8)
    weight[3] = QMAX
    parts = torch.full((4, 1536), -128, dtype=torch.int8)
    parts[1] = 127
    assert torch.equal(PackedWeight(weight).mm(parts), _sums(parts, weight))


@needs_vnni
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [4, 6, 50])
def test_packed_sums_do_not_depend_on_threads(threads, rows):
    weight = torch.randint(-QMAX, QMAX + 1, (3072, 576), dtype=torch.int8)
    parts = torch.randint(-63, 64, (rows, 576), dtype=torch.int8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)  # (the library runs on the calling thread's OpenMP team: torch's)
        assert torch.equal(PackedWeight(weight).mm(parts), _sums(parts, weight))
    finally:
        torch.set_num_threads(before)


@needs_vnni
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 9])
def test_a_layer_on_the_packed_kernel_gives_int_mm_bits_on_either_side_of_few(tokens):
    torch.manual_seed(tokens)
    weight, bias = torch.randn(96, 576), torch.randn(96)
    on_int8 = Int8Linear.from_float(weight, bias)
    packed = Int8Linear.from_float(weight, bias, few=4, packed=True)
    x = torch.randn(tokens, 576) * 20
    assert packed.parts_dtype(tokens) == torch.int8
    assert torch.equal(on_int8(x), packed(x)) and torch.equal(on_int8.rows(3, 40)(x), packed.rows(3, 40)(x))


@needs_vnni
def test_a_model_on_the_packed_kernel_lays_out_its_weights_at_load_and_keeps_its_bits(tiny_llama):
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM(copy.deepcopy(tiny_llama.model.config))
    plain.load_state_dict(tiny_llama.model.state_dict())
    packed = copy.deepcopy(plain)
    to_int8(plain, exact=False)
    to_int8(packed, exact=False, few=8, packed=True)
    attn = packed.model.layers[0].self_attn
    assert attn.qkv_proj.prepared and packed.lm_head.prepared
    assert not attn.q_proj.prepared  # (a view only transformers' own forward reads: laid out on first use)
    ids = torch.randint(5, 1000, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        for n in (12, 1, 3):  # 12 tokens through _int_mm, 1 and 3 through the packed kernel
            assert torch.equal(packed(ids[:, :n]).logits, plain(ids[:, :n]).logits)


@needs_vnni
def test_a_vnni_build_picks_the_packed_kernel_whatever_the_timing_probe_says(tiny_llama, monkeypatch):
    """Regression: on a Xeon with a large cache the int8 timing probe's margin was ~1.4x, and in one full test run
    it said "slow", so that model ran every input on fbgemm's exact kernel (the same bits, slower). A library
    built with VNNI now decides without it."""
    from transformers import LlamaForCausalLM

    from app.model import int8

    monkeypatch.setattr(int8, "int8_matmul_is_fast", lambda: False)
    model = LlamaForCausalLM(copy.deepcopy(tiny_llama.model.config))
    to_int8(model)
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    few = None if int8_mm.any_tokens(model.config) else int8.PACKED_FEW_TOKENS
    assert all(m.packed and m.exact is None and m.few == few for m in layers)


@needs_amx()
def test_with_amx_inputs_of_any_length_take_the_packed_kernel():
    """The tile unit makes long inputs (a prefill of 8 questions: 104 tokens) fast too, where the VNNI loop alone
    lost to _int_mm beyond 16 tokens; an inner size off its 64-value tiles keeps the limit."""
    from app.model.int8 import PACKED_FEW_TOKENS, kernels_for

    assert kernels_for(LIKE_SMOLLM2) == (False, None, True)
    assert kernels_for(SimpleNamespace(hidden_size=576, intermediate_size=1000)) == (False, PACKED_FEW_TOKENS, True)


@needs_amx()
def test_amx_can_be_turned_off():
    """TEXTENV_AMX=0 (a host whose tiles misbehave): long inputs back on the VNNI loop, the same sums. In a process
    of its own: the library asks for the tiles once per process."""
    import os
    import subprocess
    import sys

    check = ("import app, torch; from types import SimpleNamespace; from app.kernels import int8_mm; "
             "from app.kernels.int8_mm import PackedWeight; "
             "w = torch.randint(-127, 128, (96, 576), dtype=torch.int8); "
             "x = torch.randint(-128, 128, (40, 576), dtype=torch.int8); "
             "assert not int8_mm.any_tokens(SimpleNamespace(hidden_size=576, intermediate_size=1536)); "
             "assert torch.equal(PackedWeight(w).mm(x), x.long().matmul(w.long().t()).int())")
    env = {**os.environ, "TEXTENV_AMX": "0"}
    subprocess.run([sys.executable, "-c", check], check=True, env=env, timeout=120)


@needs_amx()
@pytest.mark.parametrize("out,inner", [(100, 576), (49152, 576), (64, 1536)])
@pytest.mark.parametrize("tokens", [1, 3, 8, 9, 24, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sums_scaled_back_on_the_tiles_give_combine_rows_bits(out, inner, tokens, with_bias):
    """PackedWeight.combined (the LM head's matmul and its scaling back in one call, the int32 sums never in
    memory) against mm then combine_rows, bit for bit: channels off the pairs of 16 (100), the LM head's 49,152,
    token counts off the tiles' 8 tokens (16 rows of parts). One token (2 rows) stays off the tiles: None."""
    from app.kernels.int8_rows import FINE, combine_rows

    gen = torch.Generator().manual_seed(out + inner + tokens)
    weight = torch.randint(-QMAX, QMAX + 1, (out, inner), generator=gen, dtype=torch.int8)
    parts = torch.randint(-128, 128, (2 * tokens, inner), generator=gen, dtype=torch.int8)
    scale = torch.rand(tokens, generator=gen) * 1e-2
    weight_scale = torch.rand(out, generator=gen) * 1e-2
    bias = torch.randn(out, generator=gen) if with_bias else None
    packed = PackedWeight(weight)
    got = packed.combined(parts, scale, weight_scale, bias, FINE)
    if 2 * tokens < 6:  # (int8_mm.c's AMX_ROWS)
        assert got is None
        return
    assert torch.equal(got, combine_rows(packed.mm(parts), scale, weight_scale, bias))
