"""The shipped adapter (assets/adapter, scripts/train.py's) on the bundled model: by default (ADAPTER unset, or
`on`) it is merged and named, `auto` answers in the protocol it was tuned for, and the model calls the calculator
itself with the guide off; ADAPTER=off runs the base model, which sends the same sum to Search and reads an error
naming the Calculator."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from app.backends.local import LocalBackend
from app.engine.engine import Engine
from app.model.adapter import GGUF_FILE, TRAINED_FILE
from app.model.loading import BUNDLED_ADAPTER, ModelUnavailable, load_model
from app.serving.service import DEFAULTS

SUM = "What is 8215 - 8454?"  # (in no question set)
UNGUIDED = dataclasses.replace(DEFAULTS, guide=False)


def test_the_adapter_is_shipped_small_with_its_gguf_and_its_card():
    files = {p.name: p.stat().st_size for p in BUNDLED_ADAPTER.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", GGUF_FILE, TRAINED_FILE} <= set(files)
    assert sum(files.values()) < 11 * 2 ** 20
    trained = json.loads((BUNDLED_ADAPTER / TRAINED_FILE).read_text())
    assert trained["protocol"] == "chat" and trained["command"].startswith("python3 scripts/train.py")


@pytest.fixture(scope="module")
def base():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ADAPTER", "off")
        backend = LocalBackend(load_model())
    yield backend
    backend.scheduler.release()


def test_by_default_the_shipped_adapter_is_merged_and_the_model_calls_the_calculator_itself(real):
    tuned = real  # (ADAPTER unset: the tests' bundled model, as a visitor's)
    assert tuned.loaded.adapter is not None and tuned.loaded.adapter.folder == BUNDLED_ADAPTER
    assert f"+ adapter {tuned.loaded.adapter.digest}" in tuned.name
    assert re.search(r"trained by stage \d \(\w+\) of python3 scripts/train\.py.* at [0-9a-f]{7}", tuned.stats().adapter)
    engine = Engine(tuned, protocol="auto")
    assert engine.protocol.name == "chat"
    episode = engine.ask(engine.new_session(), SUM, UNGUIDED)
    assert [s.tool for s in episode.segments if s.kind == "tool"] == ["Calculator"]
    assert episode.answer.endswith("-239") and set(episode.provenance) <= {"user", "tool", "model"}


def test_adapter_off_runs_the_base_model_whose_sum_sent_to_search_is_an_error_naming_the_calculator(base):
    assert base.loaded.adapter is None and "adapter" not in base.name and base.stats().adapter is None
    assert Engine(base, protocol="auto").protocol.name == "textenv"
    chat = Engine(base, protocol="chat")
    episode = chat.ask(chat.new_session(), SUM, UNGUIDED)
    tools = [s for s in episode.segments if s.kind == "tool"]
    assert tools and tools[0].tool == "Search" and not tools[0].ok  # (no longer passed on to the Calculator)
    assert tools[0].result.endswith("to calculate it, use Calculator")


def test_a_missing_adapter_folder_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("ADAPTER", "/nowhere/adapter")
    with pytest.raises(ModelUnavailable, match="ADAPTER=/nowhere/adapter: no adapter_config.json"):
        load_model()
