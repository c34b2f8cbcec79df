"""The fast path's families beside Llama (app.model.family): Qwen2 (q/k/v biases, tied or untied head) and Qwen3
(per-head q/k norms, head_dim apart from hidden / heads) in the ragged pass, int8 weights and the fused C layer,
each against the model's own forward as for Llama (tests/test_int8.py, tests/test_int8_layer.py). Tiny random
models from a config (tests/conftest.py tiny_family); the C tests of the packed (VNNI) and AVX-512 paths skip on
CPUs without them, saying so."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from app.backends.local import LocalBackend
from app.kernels import attend_rows, int8_layer, native
from app.kernels.int8_layer import fused_layers
from app.model import ragged
from app.model.family import describe, fast_path_reason, layer_shape
from app.model.int8 import Int8Linear
from app.model.kvcache import new_kv
from app.model.loading import LoadedModel, wrap
from app.model.ragged import Row, ragged_forward, supports
from tests.conftest import logit_tolerance
from tests.native_support import AVX512, VNNI, c_library, needs


def test_the_layer_description_reads_each_familys_differences():
    qwen2 = layer_shape(Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                    tie_word_embeddings=False, rope_theta=1e6))
    assert (qwen2.qkv_bias, qwen2.head_norms, qwen2.tied_head, qwen2.head_dim, qwen2.groups) == (True, False, False,
                                                                                                  64, 2)
    assert qwen2.rope_theta == 1e6
    qwen3 = layer_shape(Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128))
    assert (qwen3.qkv_bias, qwen3.head_norms, qwen3.head_dim) == (False, True, 128)
    llama = layer_shape(LlamaConfig())
    assert (llama.qkv_bias, llama.head_norms) == (False, False)


def test_a_model_off_the_fast_path_says_why():
    assert fast_path_reason(Qwen2Config()) is None and fast_path_reason(Qwen3Config()) is None
    assert "gpt2" in fast_path_reason(GPT2Config())
    assert "sliding-window" in fast_path_reason(Qwen2Config(use_sliding_window=True, sliding_window=64,
                                                            max_window_layers=0))
    assert "SiLU" in fast_path_reason(LlamaConfig(hidden_act="gelu"))
    assert describe(GPT2Config()).startswith("the model's own forward, one row a step: model type 'gpt2'")
    assert describe(Qwen3Config()).startswith("batched pass (qwen3: ") and "q/k head norms" in describe(Qwen3Config())


def test_the_stats_panel_names_the_path(tiny_family_model, tiny):
    runs = tiny_family_model.stats().runs
    assert runs.startswith(f"batched pass ({tiny_family_model.model.config.model_type}")
    if tiny.model.config.model_type == "gpt2":
        assert "model type 'gpt2' is not one the fast path covers" in tiny.stats().runs


def _greedy_own(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from the model's own forward over the whole sequence at every step (no cache)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _greedy_ragged(model, prompts: list[list[int]], steps: int, batched: bool, cached: bool) -> list[list[int]]:
    """Greedy tokens of each prompt from ragged passes: all rows in one pass a step or each alone; each step's
    new token after the cache (`cached`) or the whole sequence again into a fresh cache."""
    seqs = [list(p) for p in prompts]
    kvs = [new_kv(model.config) for _ in prompts]
    fed = [0] * len(prompts)  # tokens each cache holds

    def row(i: int) -> Row:
        if not cached:
            kvs[i], fed[i] = new_kv(model.config), 0
        new = seqs[i][fed[i]:]
        made = Row(kvs[i], new, fed[i], 1)
        fed[i] = len(seqs[i])
        return made

    with torch.inference_mode():
        for _ in range(steps):
            if batched:
                logits = ragged_forward(model, [row(i) for i in range(len(seqs))])
            else:
                logits = [ragged_forward(model, [row(i)])[0] for i in range(len(seqs))]
            for seq, out in zip(seqs, logits):
                seq.append(int(out[-1].argmax()))
    return [seq[len(p):] for seq, p in zip(seqs, prompts)]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in (23, 9, 40)]


def _int8_copy(loaded: LoadedModel) -> LoadedModel:
    model = type(loaded.model)(copy.deepcopy(loaded.model.config))  # (converting changes the model's config)
    model.load_state_dict(loaded.model.state_dict())
    return LocalBackend(wrap(model, loaded.tokenizer, f"{loaded.name}-int8", weights="int8"))


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_the_ragged_pass_gives_the_models_own_greedy_tokens(tiny_family_model, weights):
    """Per family and weight format: the model's own forward (uncached) and the ragged pass, cache on and off,
    rows batched and alone, give the same greedy tokens; the prompt's logits agree within rounding."""
    loaded = tiny_family_model if weights == "float32" else _int8_copy(tiny_family_model)
    model = loaded.model
    assert supports(model) and loaded.weights == weights
    prompts, steps = _prompts(), 6
    want = [_greedy_own(model, p, steps) for p in prompts]
    for batched in (True, False):
        for cached in (True, False):
            assert _greedy_ragged(model, prompts, steps, batched, cached) == want, (batched, cached)
    with torch.inference_mode():
        own = model(torch.tensor([prompts[2]])).logits[0]
        solo = ragged_forward(model, [Row(new_kv(model.config), prompts[2], 0, len(prompts[2]))])[0]
    assert (own - solo).abs().max() <= 1e-4


def test_int8_rows_are_bitwise_independent_and_agree_with_float32(tiny_family_model):
    """As for Llama (tests/test_int8.py): a row's int8 logits are the same bits alone and beside others, close to
    the int8 model's own forward, and its greedy tokens mostly float32's."""
    loaded = _int8_copy(tiny_family_model)
    model = loaded.model
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj")
    assert (model.model.layers[0].self_attn.qkv_proj.bias is not None) == layer_shape(model.config).qkv_bias
    ids = torch.randint(5, 1000, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0]
        solo = ragged_forward(model, [Row(new_kv(model.config), ids, 0, len(ids))])[0]
        others = [Row(new_kv(model.config), ids[:7], 0, 2), Row(new_kv(model.config), ids[30:31], 0, 1)]
        mixed = ragged_forward(model, [others[0], Row(new_kv(model.config), ids, 0, len(ids)), others[1]])[1]
        float_logits = tiny_family_model.model(torch.tensor([ids])).logits[0]
    assert torch.equal(solo, mixed)
    assert torch.allclose(solo, want, atol=5e-4)  # (qwen3-128: 1.1e-4 off, an activation across an int8 step)
    agree = (solo.argmax(-1) == float_logits.argmax(-1)).float().mean().item()
    assert agree > 0.9, agree


def test_the_c_head_norm_is_qwen3s_norm():
    c_library()
    n, heads, groups, dim = 5, 4, 2, 16
    width = (heads + 2 * groups) * dim
    y = torch.randn(n, width) * 3
    q_norm, k_norm = Qwen3RMSNorm(dim, eps=1e-6), Qwen3RMSNorm(dim, eps=1e-6)
    q_norm.weight.data, k_norm.weight.data = torch.rand(dim) + 0.5, torch.rand(dim) + 0.5
    with torch.no_grad():
        want_q = q_norm(y[:, :heads * dim].view(n, heads, dim)).reshape(n, -1)
        want_k = k_norm(y[:, heads * dim:(heads + groups) * dim].view(n, groups, dim)).reshape(n, -1)
    values = y[:, (heads + groups) * dim:].clone()
    lib = native.library()
    lib.norm_heads(y.data_ptr(), n, width, 0, heads, dim, q_norm.weight.data_ptr(), 1e-6)
    lib.norm_heads(y.data_ptr(), n, width, heads, groups, dim, k_norm.weight.data_ptr(), 1e-6)
    assert torch.allclose(y[:, :heads * dim], want_q, atol=1e-5, rtol=1e-5)
    assert torch.allclose(y[:, heads * dim:(heads + groups) * dim], want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[:, (heads + groups) * dim:], values)  # values are not normed


def _fused_and_torch(model, make_rows) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    with torch.inference_mode():
        fused = ragged_forward(model, make_rows())
        original = ragged.fused_layers
        ragged.fused_layers = lambda model: None
        try:
            plain = ragged_forward(model, make_rows())
        finally:
            ragged.fused_layers = original
    return fused, plain


def test_the_fused_c_layer_computes_what_the_torch_layers_do(tiny_family_model):
    """The fused int8 layer (app.kernels.int8_layer: C norms with Qwen3's head norms, Qwen2's biases in the q/k/v
    sums) against the same int8 model's torch layers, rows with and without a shared prefix."""
    c_library()
    loaded = _int8_copy(tiny_family_model)
    model = loaded.model
    assert fused_layers(model) is not None
    ids = torch.randint(5, 1000, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    prefix = new_kv(model.config)
    with torch.inference_mode():
        ragged_forward(model, [Row(prefix, ids[:100], 0, 1)])

    def rows() -> list[Row]:
        return [Row(new_kv(model.config), ids[:150], 0, 150), Row(new_kv(model.config), ids[100:103], 100, 3, prefix)]

    fused, plain = _fused_and_torch(model, rows)
    for a, b in zip(fused, plain):
        assert (a - b).abs().max() <= logit_tolerance(loaded)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.98


@needs(VNNI)
def test_the_packed_qkv_call_gives_the_bits_of_the_per_piece_calls(tiny_family_model):
    """qkv_packed/finish_packed (with the head norms and biases) against the pieces called one by one."""
    c_library()
    model = _int8_copy(tiny_family_model).model
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    ids = torch.randint(5, 1000, (200,), generator=torch.Generator().manual_seed(8)).tolist()

    def run(packed: bool) -> list[torch.Tensor]:
        for m in linears:
            m.packed = packed
        with torch.inference_mode():
            past = new_kv(model.config)
            ragged_forward(model, [Row(past, ids[:150], 0, 1)])
            return ragged_forward(model, [Row(new_kv(model.config), ids[:1], 0, 1), Row(past, ids[150:154], 150, 4)])

    was = [m.packed for m in linears]
    try:
        packed, pieces = run(True), run(False)
    finally:
        for m, w in zip(linears, was):
            m.packed = w
    assert all(torch.equal(a, b) for a, b in zip(packed, pieces))


@needs(AVX512)  # rows attend in app/kernels/attend_rows.c, whose fast path is AVX-512 code (64- or 128-value heads)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_qwen3_layer_in_one_call_gives_the_bits_of_the_calls_layer_by_layer(tokenizer, monkeypatch, head_dim):
    c_library()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand_like(param) + 0.5)
    model = wrap(model, tokenizer, f"tiny-qwen3-{head_dim}-int8", weights="int8").model
    assert attend_rows.available(model.config)
    ids = torch.randint(5, 1000, (200,), generator=torch.Generator().manual_seed(9)).tolist()
    real, taken = int8_layer.FusedInt8Layers.whole_pass, []

    def run(one_call: bool) -> list[torch.Tensor]:
        def whole_pass(self, *args) -> bool:
            taken.append(one_call and real(self, *args))
            return taken[-1]

        monkeypatch.setattr(int8_layer.FusedInt8Layers, "whole_pass", whole_pass)
        with torch.inference_mode():
            past, kv = new_kv(model.config), new_kv(model.config)
            ragged_forward(model, [Row(past, ids[:150], 0, 1)])
            return ragged_forward(model, [Row(past, ids[150:153], 150, 3), Row(kv, ids[:2], 0, 2)])

    one_call, by_layer = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(one_call, by_layer))


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_a_gguf_of_the_family_converts_once_and_runs_the_fast_path(kind, tokenizer, tmp_path, monkeypatch, caplog):
    """A GGUF written by llama.cpp's own conversion script (tests/support/gguf_convert.py, f32) loads through the
    converted cache folder as the bundled model does: the same logits as the model it was written from, converted
    once (a second load reads the folder), its int8 weights saved beside, and the batched pass."""
    import logging

    from tests.conftest import tiny_family
    from tests.support.gguf_convert import convert

    source = tiny_family(kind, tokenizer)
    folder = tmp_path / "hf"
    source.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    convert(folder, tmp_path / f"tiny-{kind}.gguf")  # (before the cache folder moves: the script lives there)
    monkeypatch.setenv("TEXTENV_CACHE_DIR", str(tmp_path / "cache"))
    from app.model.loading import load_model

    ids = torch.tensor([torch.randint(5, 1000, (30,), generator=torch.Generator().manual_seed(4)).tolist()])
    with caplog.at_level(logging.INFO, logger="app.model.loading"):
        first = load_model(str(tmp_path), f"tiny-{kind}.gguf", weights="float32")
        assert "converting" in caplog.text and "runs on the fast path" in caplog.text
        caplog.clear()
        again = LocalBackend(load_model(str(tmp_path), f"tiny-{kind}.gguf", weights="int8"))
        assert "converting" not in caplog.text
    assert first.model.config.model_type == kind and again.weights == "int8"
    with torch.inference_mode():
        assert torch.equal(first.model(ids).logits, source.model(ids).logits)
    converted = next((tmp_path / "cache" / "models").glob(f"tiny-{kind}-*"))
    assert (converted / "config.json").exists() and (converted / "int8-weights-v1.safetensors").exists()
    assert again.stats().runs.startswith(f"batched pass ({kind}")
    assert _greedy_ragged(again.model, [ids[0].tolist()], 4, True, True) == [_greedy_own(again.model, ids[0].tolist(),
                                                                                           4)]
