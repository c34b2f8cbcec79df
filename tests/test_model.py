"""Model loading: the bundled GGUF through its converted cache, and any local folder named by MODEL_ID."""

from __future__ import annotations

import pytest

from app.engine.turns import Engine
from app.model.int8 import SAVED_INT8
from app.model.loading import _converted_dir, load_model, model_source
from app.settings import Settings


def test_bundled_default_and_its_converted_cache(real):
    model_id, gguf_file = model_source()
    assert gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    folder = _converted_dir(model_id, gguf_file)
    assert (folder / "model.safetensors").exists()
    assert real.weights != "int8" or (folder / SAVED_INT8).exists()  # int8: quantized at the first start only
    assert real.eos_ids == frozenset({2}) and real.kv_bytes_per_token == 46_080


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_local_folder_from_model_id_loads_and_answers(tmp_path, monkeypatch, tokenizer, kind, request):
    tiny = request.getfixturevalue("tiny_llama") if kind == "llama" else None
    if tiny is None:
        from tests.conftest import _tiny
        tiny = _tiny("gpt2", tokenizer)
    tiny.model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("MODEL_ID", str(tmp_path))
    monkeypatch.delenv("GGUF_FILE", raising=False)
    loaded = load_model()
    assert loaded.name == str(tmp_path) and type(loaded.model) is type(tiny.model)
    engine = Engine(loaded, prompt="{tools}\n\n")
    episode = engine.ask(engine.new_session(), "hello", Settings(max_new_tokens=4))
    assert episode.segments[0].generated_tokens >= 1


def test_a_missing_model_is_a_clear_error(monkeypatch, tmp_path):
    """An OSError, which the CLI prints as one `error: ...` line (app.cli catches it), naming what MODEL_ID asked
    for. (The text itself is transformers': a path that is no folder reads as a malformed hub id.)"""
    missing = tmp_path / "nothing-here"
    monkeypatch.setenv("MODEL_ID", str(missing))
    with pytest.raises(OSError) as caught:
        load_model()
    assert f"'{missing}'" in str(caught.value)
