"""Int8 weights (app.model.int8): close to float32, and every token's result independent of the rows beside it."""

from __future__ import annotations

import copy

import pytest
import torch

from app.kernels import native
from app.kernels.int8_rows import (ACT_MAX, FINE, QMAX, combine_rows, combine_rows_torch, split_rows, split_rows_float,
                                   split_rows_torch)
from app.model.int8 import EXACT_SPAN, ExactWeight, Int8Linear, fbgemm_int8, int8_matmul_is_fast, int8_state, to_int8
from app.model.kvcache import new_kv
from app.backends.local import LocalBackend
from app.model.loading import LoadedModel, load_model, weight_format, wrap
from app.model.ragged import Row, ragged_forward
from tests.native_support import c_library


@pytest.mark.parametrize("rows,inputs,outputs,bias", [(1, 576, 1536, False), (5, 32, 64, True), (3, 7, 3, True),
                                                      (64, 1536, 576, False)])
def test_int8_linear_is_close_to_float(rows, inputs, outputs, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(inputs, outputs, bias=bias)
    x = torch.randn(rows, inputs) * torch.rand(rows, 1) * 10  # rows of very different sizes
    got, want = Int8Linear.from_float(linear.weight, linear.bias)(x), linear(x)
    assert got.shape == want.shape
    # One int8 step per output channel of the weights (1/254 of its largest weight) bounds the error.
    bound = (x.abs().sum(1, keepdim=True) * linear.weight.abs().amax(1) / 254).amax()
    assert (got - want).abs().max() <= bound
    assert torch.allclose(got, want, rtol=0.05, atol=0.02 * want.abs().max().item())


def test_split_rows_keeps_about_thirteen_bits_in_7_bit_parts():
    torch.manual_seed(1)
    x = torch.randn(4, 300) * torch.tensor([[1e-3], [1.0], [50.0], [0.0]])
    parts, scale = split_rows(x)
    assert parts.dtype == torch.int8 and parts.shape == (8, 300) and scale.shape == (4, 1)
    assert parts.abs().max() == ACT_MAX  # 7 bits: what a CPU without VNNI multiplies exactly (app.model.int8)
    back = (parts[:4].float() + parts[4:].float() / FINE) * scale
    assert ((back - x).abs() <= scale / (2 * FINE) * 1.001 + 1e-12).all()
    assert torch.equal(back[3], torch.zeros(300))  # a zero row stays zero (no division by zero)


def test_a_row_of_int8_linear_does_not_depend_on_its_batch():
    torch.manual_seed(2)
    layer = Int8Linear.from_float(torch.randn(96, 64))
    rows = torch.randn(6, 64) * torch.tensor([[1.0], [100.0], [0.01], [5.0], [1.0], [30.0]])
    together = layer(rows)
    for i in range(6):
        assert torch.equal(layer(rows[i:i + 1]), together[i:i + 1])  # bitwise: integer products are exact


NO_FBGEMM = "needs torch's fbgemm engine (x86 builds): not in torch.backends.quantized.supported_engines"
FBGEMM = pytest.mark.skipif(not fbgemm_int8(), reason=NO_FBGEMM)
# (kernel, inner size): float32 sums are exact up to EXACT_SPAN products only, so it is not asked beyond
KERNEL_SIZES = [pytest.param(True, inner, id=f"fbgemm-{inner}", marks=FBGEMM)
                for inner in (1, 64, 576, 1536, EXACT_SPAN, 4096)] + [
               pytest.param(False, inner, id=f"float32-{inner}") for inner in (1, 64, 576, 1536, EXACT_SPAN)]


@pytest.mark.parametrize("fbgemm,inner", KERNEL_SIZES)
@pytest.mark.parametrize("values", ["random", "extreme"])
@pytest.mark.parametrize("rows", [1, 37, 80])
def test_the_exact_kernel_gives_int_mm_bits(inner, values, fbgemm, rows):
    """The kernel for CPUs without fast int8 matmuls is the same function, bit for bit, in fbgemm and in float32
    (up to EXACT_SPAN), for few and many rows (each kernel takes other paths for them). "extreme" puts every sum
    at its largest (63 * 127 * inner), and every pair of products at the 16-bit edge where an 8-bit activation
    would saturate fbgemm's kernel (the parts reach it as unsigned bytes v + 64), and rows of equal parts."""
    gen = torch.Generator().manual_seed(inner)
    if values == "random":
        parts = torch.randint(-ACT_MAX, ACT_MAX + 1, (rows, inner), generator=gen, dtype=torch.int8)
        weight = torch.randint(-QMAX, QMAX + 1, (48, inner), generator=gen, dtype=torch.int8)
    else:
        parts = torch.full((rows, inner), ACT_MAX, dtype=torch.int8)
        weight = torch.full((48, inner), -QMAX, dtype=torch.int8)
        parts[rows // 2], weight[2] = -ACT_MAX, QMAX
    held = ExactWeight(weight, fbgemm=fbgemm)
    assert held.fbgemm is fbgemm
    sums = (parts.long() @ weight.long().t()).float()  # the integer sums, which _int_mm gives where it is right
    assert torch.equal(held.mm(parts.float()), sums)
    if inner > 1:  # (torch 2.13's _int_mm returns garbage for inner 1 on a Xeon with AVX-512 VNNI; not used here)
        assert torch.equal(torch._int_mm(parts, weight.t()).float(), sums)


def test_a_layer_on_the_exact_kernel_gives_the_same_bits():
    torch.manual_seed(5)
    weight, bias = torch.randn(96, 1536), torch.randn(96)
    on_int8, on_float = Int8Linear.from_float(weight, bias), Int8Linear.from_float(weight, bias, exact=True)
    x = torch.randn(9, 1536) * 40
    assert on_int8.exact is None and on_float.exact is not None and torch.equal(on_int8(x), on_float(x))
    assert torch.equal(on_int8.rows(10, 50)(x), on_float.rows(10, 50)(x))


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 9])
def test_a_layer_on_both_kernels_gives_the_same_bits_on_either_side_of_few(tokens):
    """Where _int_mm is fast, up to `few` tokens take the exact kernel and more take _int_mm: which one ran must
    not show in a single bit."""
    torch.manual_seed(tokens)
    weight, bias = torch.randn(96, 576), torch.randn(96)
    on_int8, both = Int8Linear.from_float(weight, bias), Int8Linear.from_float(weight, bias, exact=True, few=4)
    x = torch.randn(tokens, 576) * 20
    assert both.few == 4 and both.rows(0, 10).few == 4
    assert torch.equal(on_int8(x), both(x)) and torch.equal(on_int8.rows(3, 40)(x), both.rows(3, 40)(x))


def test_split_rows_float_holds_split_rows_values():
    x = torch.randn(5, 200) * torch.tensor([[1e-3], [1.0], [50.0], [0.0], [7.0]])
    (parts, scale), (floats, same) = split_rows(x), split_rows_float(x)
    assert floats.dtype == torch.float32 and torch.equal(floats, parts.float()) and torch.equal(scale, same)


@pytest.mark.parametrize("rows", [1, 8, 80])
def test_split_rows_rounds_as_torch_round(rows):
    """The add-based rounding (app.kernels.int8_rows.round_: torch.round woke the second core for each of an 8-row
    step's ~240 roundings) gives torch.round's values, ties to even included."""
    from app.kernels.int8_rows import round_

    halves = torch.arange(-4 * FINE, 4 * FINE + 1, dtype=torch.float32) / 4  # every quarter in range
    assert torch.equal(round_(halves.clone()), torch.round(halves))
    x = torch.randn(rows, 1536) * torch.logspace(-4, 3, rows).unsqueeze(1)
    scale = x.abs().amax(dim=-1, keepdim=True).div_(ACT_MAX)
    high = torch.round(x / scale)
    low = torch.round((x / scale - high) * FINE)
    assert torch.equal(split_rows_float(x)[0], torch.cat([high, low]))


@pytest.fixture
def built():
    c_library()  # a failed C build fails the tests of the C functions, with the compiler's message


needs_native = pytest.mark.usefixtures("built")


def _activations(rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows of very different sizes, a zero row, exact ties (.5 steps) and values at a row's largest."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * torch.logspace(-6, 4, rows).unsqueeze(1)
    x[0] = 0
    if rows > 1 and width > 4:
        x[1, :4] = torch.tensor([ACT_MAX, -ACT_MAX, 0.5, -2.5])  # scale 1: .5 and -2.5 tie, round to even
    return x


@needs_native
@pytest.mark.parametrize("rows,width", [(1, 576), (2, 1536), (9, 49), (80, 576), (3, 1)])
def test_the_c_split_gives_the_torch_bits(rows, width):
    x = _activations(rows, width, rows * width)
    want_parts, want_scale = split_rows_torch(x)
    for dtype, split in ((torch.float32, split_rows_float), (torch.int8, split_rows)):
        parts, scale = split(x)
        assert parts.dtype == dtype and torch.equal(scale, want_scale)
        assert torch.equal(parts.float(), want_parts)
    assert torch.equal(split_rows_float(x)[0].view(torch.int32), want_parts.view(torch.int32))  # zeros' signs too


@needs_native
@pytest.mark.parametrize("rows,width,bias", [(1, 1536, False), (3, 576, True), (80, 3072, False), (2, 49, True),
                                             (1, 49152, False)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_the_c_combine_gives_the_torch_bits(rows, width, bias, dtype):
    gen = torch.Generator().manual_seed(rows * width)
    sums = torch.randint(-2**23, 2**23, (2 * rows, width), generator=gen, dtype=torch.int32).to(dtype)
    scale, weight_scale = torch.rand(rows, 1, generator=gen) / 60, torch.rand(width, generator=gen) / 100
    b = torch.randn(width, generator=gen) if bias else None
    assert torch.equal(combine_rows(sums, scale, weight_scale, b), combine_rows_torch(sums, scale, weight_scale, b))


def test_without_c_the_torch_version_runs(monkeypatch):
    """TEXTENV_NATIVE=0 (or no compiler): the same functions, in torch."""
    monkeypatch.setenv("TEXTENV_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert native.library() is None
        x = _activations(4, 64, 4)
        assert torch.equal(split_rows_float(x)[0], split_rows_torch(x)[0])
        assert split_rows(x)[0].dtype == torch.int8
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_a_failed_c_build_leaves_torch_running(monkeypatch, tmp_path, caplog):
    """A compiler that fails is an error, logged with what the compiler said (and build_error gives it: the C
    tests fail on it), and the torch version runs: a Space without a working toolchain still answers. The
    "compiler" here reports a syntax error as gcc would, and fails."""
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\necho \"int8_mm.c:12:3: error: expected ';' before '}' token\" >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TEXTENV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    native.library.cache_clear()
    try:
        with caplog.at_level("INFO", logger="app.kernels.native"):
            assert native.library() is None
        (error,) = [r for r in caplog.records if r.name == "app.kernels.native" and r.levelname == "ERROR"]
        message = native.build_error()
        assert message.startswith(f"could not build the C functions with {fake}: `{fake} -O3")
        assert "exited with status 1:\nint8_mm.c:12:3: error: expected ';' before '}' token" in message
        assert message in error.getMessage() and "runs in torch" in error.getMessage()
        assert not list((tmp_path / "cache").glob("native-*"))
        x = _activations(4, 64, 4)
        assert torch.equal(split_rows_float(x)[0], split_rows_torch(x)[0])  # (the torch version runs)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.build_error() is None  # (built again: the failure was that compiler's)


def test_no_compiler_and_c_turned_off_are_no_build_errors(monkeypatch):
    """build_error reports builds that failed; without a compiler, or with TEXTENV_NATIVE=0, none was tried."""
    for name, value in (("CC", "no-such-compiler-here"), ("TEXTENV_NATIVE", "0")):
        monkeypatch.setenv(name, value)
        native.library.cache_clear()
        try:
            assert native.library() is None and native.build_error() is None
        finally:
            monkeypatch.undo()
            native.library.cache_clear()


def test_an_unwritable_cache_folder_leaves_torch_running(monkeypatch, tmp_path, caplog):
    """Regression: the cache folder's path was taken outside the build's error handling, so a cache folder that
    cannot be made (here: a file in its way) would have failed the model's load instead of falling back."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TEXTENV_CACHE_DIR", str(blocker / "cache"))
    native.library.cache_clear()
    try:
        assert native.library() is None
        assert "could not build the C functions" in caplog.text
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_a_model_on_the_exact_kernel_holds_its_weights_at_load(tiny_llama):
    """The exact kernel's weights are held (fbgemm-packed) at load, not by the first question; the q/k/v views,
    which only transformers' own forward reads, on first use."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(copy.deepcopy(tiny_llama.model.config))
    to_int8(model, exact=True)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.prepared and model.lm_head.prepared
    assert not attn.q_proj.prepared
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7]]))
    assert attn.q_proj.prepared


def _int8_tiny(tiny_llama: LoadedModel) -> LoadedModel:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(copy.deepcopy(tiny_llama.model.config))  # converting changes the model's config
    model.load_state_dict(tiny_llama.model.state_dict())
    return LocalBackend(wrap(model, tiny_llama.tokenizer, "tiny-llama-int8", weights="int8"))


@pytest.mark.parametrize("few", [None, 8])
def test_the_exact_kernel_gives_a_models_int8_bits(tiny_llama, few):
    """Regression: on a CPU without VNNI, int8 ran ~30x slower than float32; its exact kernel must not change
    a single bit of the model's logits (so int8 answers are the same on every CPU). few=8: the exact kernel for
    up to 8 tokens (a prefill of 40 and decode steps of 1 and 3), as where _int_mm is fast."""
    loaded = _int8_tiny(tiny_llama)
    gen = torch.Generator().manual_seed(6)
    inputs = [torch.randint(5, 1000, (1, n), generator=gen) for n in (40, 1, 3)]
    with torch.inference_mode():
        want = [loaded.model(ids).logits for ids in inputs]
        for module in loaded.model.modules():
            if isinstance(module, Int8Linear):
                module.exact = None if module.exact is not None else ExactWeight(module.weight)
                module.few = few
        got = [loaded.model(ids).logits for ids in inputs]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_int8_tiny_llama_rows_are_bitwise_independent_and_match_its_own_forward(tiny_llama):
    loaded = _int8_tiny(tiny_llama)
    model = loaded.model
    assert loaded.weights == "int8" and hasattr(model.model.layers[0].self_attn, "qkv_proj")
    ids = torch.randint(5, 1000, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0]  # transformers' own forward: q/k/v as three views
        solo = ragged_forward(model, [Row(new_kv(model.config), ids, 0, len(ids))])[0]
        others = [Row(new_kv(model.config), ids[:7], 0, 2), Row(new_kv(model.config), ids[30:31], 0, 1)]
        mixed = ragged_forward(model, [others[0], Row(new_kv(model.config), ids, 0, len(ids)), others[1]])[1]
        float_logits = tiny_llama.model(torch.tensor([ids])).logits[0]
    assert torch.equal(solo, mixed)
    assert torch.allclose(solo, want, atol=1e-4)
    assert (solo.argmax(-1) == float_logits.argmax(-1)).float().mean() > 0.9


def real_int8(request) -> LoadedModel:
    """The real model in int8: the session's own where it runs in int8, else one loaded for the test (on a CPU
    without fast int8 matmuls, on the exact kernel: the same bits)."""
    real = request.getfixturevalue("real")
    return real if real.weights == "int8" else LocalBackend(load_model(weights="int8"))


@pytest.mark.parametrize("which", ["tiny_llama", "real"])
def test_rows_reading_shared_prefixes_are_bitwise_independent_of_each_other(which, request):
    """Regression for reading a shared prefix once a step for all its rows (app.model.ragged._prefix_attention): a
    row's logits are the same bits alone as beside decoding, drafting, prefilling and prefix-less rows, in any
    order, with enough queries to take several kernel calls."""
    model = (_int8_tiny(request.getfixturevalue(which)) if which == "tiny_llama" else real_int8(request)).model
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj")  # int8: bitwise only where the matmuls are exact
    ids = torch.randint(5, 1000, (400,), generator=torch.Generator().manual_seed(4)).tolist()
    prefixes = [new_kv(model.config), new_kv(model.config)]
    with torch.inference_mode():
        ragged_forward(model, [Row(prefixes[0], ids[:50], 0, 1), Row(prefixes[1], ids[50:80], 0, 1)])

        def rows() -> list[Row]:  # (prefix, own history, new tokens, logits kept): each call builds fresh caches
            made = []
            for which, history, new, keep in [(0, 3, 1, 1), (0, 10, 5, 5), (None, 20, 1, 1), (0, 0, 7, 2),
                                              (1, 4, 1, 1), (0, 30, 90, 1)]:
                prefix = None if which is None else prefixes[which]
                before = 0 if prefix is None else prefix.get_seq_length()
                kv, own = new_kv(model.config), ids[100 + 10 * len(made):][:history + new]
                if history:
                    ragged_forward(model, [Row(kv, own[:history], before, 1, prefix)])
                made.append(Row(kv, own[history:], before + history, keep, prefix))
            return made

        alone = [ragged_forward(model, [row])[0] for row in rows()]
        together = ragged_forward(model, rows())
        backwards = ragged_forward(model, rows()[::-1])[::-1]
    for solo, mixed, reversed_ in zip(alone, together, backwards):
        assert torch.equal(solo, mixed) and torch.equal(solo, reversed_)


@pytest.mark.parametrize("int_mm_s, fast", [(0.25, True), (3.0, False)])
def test_the_int8_probe_times_both_matmuls_once(monkeypatch, int_mm_s, fast):
    """Regression: int8 was the default everywhere, and on an AVX2-only CPU (no VNNI) `torch._int_mm` fell back
    to a loop ~30x slower than float32, so a 10-token greeting took minutes. The probe times `_int_mm` against a
    float32 matmul of the same (LM-head-like) size, best of three runs after a warm-up, says "fast" only where
    `_int_mm` wins, and answers once per process. On a clock of the test's own a float32 run takes 1 s and an
    `_int_mm` run `int_mm_s` (its real runs happen too, so its arguments are checked)."""
    import types

    from app.model import timing

    clock, calls = [0.0], []
    real_int_mm = torch._int_mm

    def perf_counter() -> float:  # a run is timed by two calls: 1 s apart
        clock[0] += 1.0
        return clock[0]

    def int_mm(a, b):
        calls.append((a.dtype, tuple(a.shape), b.dtype, tuple(b.shape)))
        clock[0] += int_mm_s - 1.0
        return real_int_mm(a, b)

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(torch, "_int_mm", int_mm)
    int8_matmul_is_fast.cache_clear()
    try:
        assert int8_matmul_is_fast() is fast
        assert calls == [(torch.int8, (2, 576), torch.int8, (576, 8192))] * 4  # a warm-up and three timed runs
        assert int8_matmul_is_fast() is fast and len(calls) == 4  # the answer is kept: no second timing
        assert int8_matmul_is_fast.cache_info().hits == 1
    finally:
        int8_matmul_is_fast.cache_clear()  # (the next caller times the real matmuls)


def test_int8_covers_the_fast_path_families_only(tokenizer):
    from tests.conftest import _tiny

    gpt2 = _tiny("gpt2", tokenizer)  # (llama: every int8 test above; qwen2, qwen3: tests/test_families.py)
    assert gpt2.model.config.model_type == "gpt2"
    with pytest.raises(ValueError, match="fast path's families only: model type 'gpt2'"):
        to_int8(gpt2.model)


@pytest.mark.parametrize("value,expected", [("", "int8"), ("int8", "int8"), ("FLOAT32", "float32"),
                                            (" float32 ", "float32"), ("bf16", None)])
def test_weights_setting(monkeypatch, value, expected):
    monkeypatch.setenv("WEIGHTS", value)
    if expected is None:
        with pytest.raises(ValueError, match="WEIGHTS='bf16'"):
            weight_format()
    else:
        assert weight_format() == expected


def test_int8_real_model_agrees_with_float32_on_the_system_prompt(real, request):
    """A guard on the conversion's accuracy: next-token agreement with float32 over the rendered system prompt
    (97.7 % measured with 7-bit parts, 97.8 % with 8-bit ones; one part per token instead of two gave ~93 %)."""
    from app.protocols.textenv.prompt import default_prompt_template, render_prompt
    from app.tools.registry import default_tools

    int8 = real_int8(request)
    reference = real if real.weights == "float32" else LocalBackend(load_model(weights="float32"))
    assert (int8.weights, reference.weights) == ("int8", "float32")
    ids = real.tokenizer(render_prompt(default_prompt_template(), default_tools()), return_tensors="pt").input_ids
    with torch.inference_mode():
        got, want = int8.model(ids).logits[0], reference.model(ids).logits[0]
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree > 0.95, agree


def _fresh_llama(tiny_llama: LoadedModel):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(copy.deepcopy(tiny_llama.model.config))
    model.load_state_dict(tiny_llama.model.state_dict())
    return model.eval()


def test_int8_weights_saved_once_are_read_back_unchanged(tiny_llama):
    """A start reads the int8 weights an earlier one saved instead of quantizing again (2.7-2.9 s -> 1.3 s for
    the bundled model): every layer comes from the saved tensors, and the logits are the same bits."""
    first, second = _fresh_llama(tiny_llama), _fresh_llama(tiny_llama)
    to_int8(first, exact=True)
    state = int8_state(first)
    assert "lm_head.weight" in state and not any(".q_proj." in key for key in state)  # (views are not saved)
    to_int8(second, exact=True, saved=state)
    assert all(state[key] is value for key, value in int8_state(second).items())
    ids = torch.randint(5, 1000, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(first(ids).logits, second(ids).logits)


def test_a_saved_int8_layer_that_does_not_fit_is_quantized_again(tiny_llama):
    model, reference = _fresh_llama(tiny_llama), _fresh_llama(tiny_llama)
    to_int8(reference, exact=True)
    state = dict(int8_state(reference))
    state["lm_head.weight"] = state["lm_head.weight"][:-1]  # (a foreign file: one row short)
    del state["model.layers.0.mlp.down_proj.scale"]
    to_int8(model, exact=True, saved=state)
    got = int8_state(model)
    assert got["lm_head.weight"] is not state["lm_head.weight"]
    assert all(torch.equal(got[key], value) for key, value in int8_state(reference).items())


def test_load_saves_int8_weights_in_the_model_folder_and_reads_them_back(tiny_llama, tmp_path, caplog):
    from app.model.int8 import SAVED_INT8

    def loaded(folder):  # (as load_model wraps a model converted into `folder`)
        return wrap(_fresh_llama(tiny_llama), tiny_llama.tokenizer, "tiny", weights="int8", folder=folder).model

    first = loaded(tmp_path)
    saved = tmp_path / SAVED_INT8
    assert saved.exists() and not list(tmp_path.glob("*.tmp*"))
    written = saved.stat().st_mtime_ns
    second = loaded(tmp_path)
    assert saved.stat().st_mtime_ns == written  # read, not written again
    saved.write_bytes(b"not a safetensors file")
    third = loaded(tmp_path)  # quantizes again and replaces the file
    assert "ignoring unreadable int8 weights" in caplog.text
    ids = torch.randint(5, 1000, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        logits = [model(ids).logits for model in (first, second, third)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert saved.stat().st_size > 1000
