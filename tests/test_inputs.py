"""The page's and the API's inputs (components/inputs.py): settings checked into a clear InputError, and
max_length fitted to the backend's context, on the page, its field and the API."""

from __future__ import annotations

import dataclasses

import gradio as gr
import pytest

from app.settings import InputError, Settings
from components import inputs
from components.inputs import make_settings, settings_from_dict
from tests.support.page import new_page, page_settings, plain, request, turn
from tests.support.page import one_token_per_pass  # noqa: F401  (an autouse fixture)


def test_make_settings_builds_a_new_frozen_value_and_rejects_bad_fields():
    s = make_settings(False, 300, 8.0, 2, 0, 42.0)
    assert (s.use_cache, s.max_length, s.max_new_tokens, s.max_turns, s.temperature, s.seed) == (
        False, 300, 8, 2, 0.0, 42)
    assert make_settings(True, 2048, 8, 2, 0).max_length is None  # the page's default: the backend's, resolved later
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_length = 5
    assert inputs.DEFAULTS.max_length == 2048 and inputs.DEFAULTS.use_cache  # the shared defaults untouched
    with pytest.raises(InputError, match="max_length is empty"):
        make_settings(True, None, 8, 2, 0)
    with pytest.raises(InputError, match="whole number"):
        make_settings(True, 10.5, 8, 2, 0)
    with pytest.raises(InputError, match="must be a number"):
        make_settings(True, 10, "x", 2, 0)
    assert make_settings(True, 10, 8, 2, 0).guide is inputs.DEFAULTS.guide  # (None: the default)
    assert make_settings(True, 10, 8, 2, 0, 0, True).guide is True
    assert make_settings(True, 10, 8, 2, 0, 0, False).guide is False
    with pytest.raises(InputError, match="guide must be true or false, not 'yes'"):
        make_settings(True, 10, 8, 2, 0, 0, "yes")


def test_settings_from_dict():
    asked = settings_from_dict({"max_new_tokens": 5, "temperature": 1, "tools": ["Calculator"],
                                "prompt": "Be brief.\n{tools}\n"})
    s, tools, prompt = asked.settings, asked.tools, asked.prompt
    assert s.max_new_tokens == 5 and s.temperature == 1 and tools == ["Calculator"] and prompt == "Be brief.\n{tools}\n"
    assert settings_from_dict(None).tools is None and settings_from_dict(None).prompt is None
    assert settings_from_dict(None).settings.max_length is None  # not given: the backend's default, resolved later
    assert settings_from_dict({"max_length": 2048}).settings.max_length == 2048  # given: checked as given
    with pytest.raises(InputError, match="system prompt is empty"):
        settings_from_dict({"prompt": "  "})
    with pytest.raises(InputError, match="prompt must be text"):
        settings_from_dict({"prompt": ["x"]})
    with pytest.raises(InputError, match="unknown setting"):
        settings_from_dict({"max_tokens": 5})
    with pytest.raises(InputError, match="max_length must be int"):
        settings_from_dict({"max_length": "big"})
    with pytest.raises(InputError, match="tools must be a list"):
        settings_from_dict({"tools": "Calculator"})
    assert settings_from_dict({"guide": False}).settings.guide is False
    assert settings_from_dict({"guide": True}).settings.guide is True
    for bad in ("no", 0, 1, None, [True]):
        with pytest.raises(InputError, match="setting guide must be true or false"):
            settings_from_dict({"guide": bad})
    with pytest.raises(InputError, match="setting use_cache must be true or false"):
        settings_from_dict({"use_cache": "off"})


def test_settings_not_given_fit_the_backends_context_and_given_ones_are_still_checked():
    assert Settings().validated(8192).max_length == 4096  # the default where the context holds it
    assert Settings().validated(2048).max_length == 2048  # (a llama-server slot of `-c 4096 -np 2`)
    assert Settings().validated(8192, default_max_length=2048).max_length == 2048  # (the page's default)
    assert Settings().validated(1024, default_max_length=2048).max_length == 1024
    assert Settings(max_length=2048).validated(2048).max_length == 2048
    with pytest.raises(InputError, match=r"^max_length must be between 1 and 2048$"):
        Settings(max_length=4096).validated(2048)
    with pytest.raises(InputError, match=r"^max_length must be between 1 and 2048$"):
        Settings(max_length=0).validated(2048)


def test_the_pages_untouched_max_length_fits_a_shorter_context_and_a_typed_one_is_checked(short_llama):
    """The page shows its default max_length (2,048) before it knows the backend; on a model (or a server's slot)
    that holds 1,024 tokens a turn with it answers within 1,024, and the page's next load shows 1,024 and why; a
    value typed above the context is refused as before."""
    page = new_page(lambda: short_llama)
    service = page.service
    # (the backend not loaded: the field as built)
    assert page.settings.on_load(request("early")).max_length is None
    job = service.choose(page_settings(max_length=inputs.DEFAULTS.max_length, max_new_tokens=8, max_turns=0,
                                       tools=["Calculator"]).asked())
    assert job.engine.context_limit == 1024 and job.settings.max_length == 1024
    shown = turn(page, "hi", max_length=inputs.DEFAULTS.max_length, max_new_tokens=2, max_turns=0)[-1]
    assert plain(shown.status) == "done" and shown.chat[0]["content"] == "hi"
    shown = turn(page, "hi", max_length=4096, max_new_tokens=2, max_turns=0)[-1]
    assert shown.status == "error: max_length must be between 1 and 1024" and shown.msg == "hi"
    typed = page_settings(max_length=1000, max_new_tokens=8, max_turns=0, tools=[])
    assert service.choose(typed.asked()).settings.max_length == 1000  # (typed, and it fits)
    field = page.settings.on_load(request("later")).max_length
    assert isinstance(field, gr.Number) and field.value == 1024 and "at most 1,024 tokens" in field.info


def test_the_pages_field_is_left_as_built_where_the_context_holds_its_default(tiny_llama):
    page = new_page(lambda: tiny_llama)
    page.service.warm_up()
    assert page.settings.on_load(request()).max_length is None
    untouched = page_settings(max_length=inputs.DEFAULTS.max_length, max_new_tokens=8, max_turns=0, tools=[])
    assert page.service.choose(untouched.asked()).settings.max_length == 2048


def test_the_apis_max_length_not_given_fits_a_shorter_context_and_a_given_one_is_checked(short_llama):
    page = new_page(lambda: short_llama)
    assert page.service.choose(settings_from_dict(None)).settings.max_length == 1024
    assert page.service.choose(settings_from_dict({"max_length": None})).settings.max_length == 1024
    assert page.service.choose(settings_from_dict({"max_length": 512})).settings.max_length == 512
    episode = page.api.ask("hi", {"max_new_tokens": 2, "max_turns": 0})
    assert episode["segments"][0]["generated_tokens"] >= 1
    with pytest.raises(gr.Error) as caught:
        page.api.ask("hi", {"max_length": 2048})
    assert caught.value.message == "max_length must be between 1 and 1024"
