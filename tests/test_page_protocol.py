"""The page's Protocol selector (issue 47): PageSettings with a protocol, the engine each handler picks (chat,
Compare cache, Compare guide, Batch), the status line naming the protocol that answered, a switch starting a new
chat with its note, the prompt box following the protocol while it holds a default, the chat protocol's tokens in
the token view, and the Batch JSONL's protocol field. A tiny random model (SmolLM2's tokenizer: `auto` is textenv,
`chat` renders with the project's template, assets/chat_template.jinja)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.protocols.chat_prompt import default_chat_template
from app.protocols.textenv.prompt import default_prompt_template
from app.serving import prompt_for_protocol, unedited
from app.settings import InputError
from components.chat_tab import ChatView
from components.inputs import PageSettings
from components.page import Page
from tests.conftest import writing
from tests.support.page import make_page, new_page, page_settings, request
from tests.support.page import one_token_per_pass  # noqa: F401  (an autouse fixture)

CALL = '<tool_call>[{"name": "calculator", "arguments": {"expression": "41 * 23"}}]</tool_call>'
PROMPT = "You answer questions, with tools where they help."  # (an edited prompt: no examples, kept as written)
TOOLS = ["Calculator", "Search"]


def chat_format_page(tiny_llama) -> Page:
    """A page whose model writes the calculator call in the chat format, then the answer and <|im_end|>."""
    loaded = writing(tiny_llama, CALL, "Result = 943<|im_end|>", marker="<|im_start|>tool", specials=True)
    return new_page(lambda: loaded)


def page_turn(page: Page, message: str, protocol: str, prompt: str = PROMPT, key: str = "page-1",
              max_new_tokens: int = 48) -> ChatView:
    """One turn from the page's Chat tab with `protocol` selected; its last update."""
    submitted = {"message": message, "ticket": None, "sent": None}
    settings = page_settings(max_new_tokens=max_new_tokens, tools=TOOLS, prompt=prompt, protocol=protocol)
    return list(page.chat.turn(submitted, settings, request(key)))[-1]


# ---- pure functions ---------------------------------------------------------------------------------------------
def test_page_settings_carry_the_selected_protocol_and_refuse_an_unknown_one():
    for chosen in ("auto", "textenv", "chat"):
        assert PageSettings(True, 2048, 8, 0, 0, [], protocol=chosen).settings().protocol == chosen
    assert PageSettings(True, 2048, 8, 0, 0, []).settings().protocol is None  # (not given: the default)
    with pytest.raises(InputError, match="protocol must be one of auto, textenv, chat, not 'hermes'"):
        PageSettings(True, 2048, 8, 0, 0, [], protocol="hermes").settings()


def test_an_unedited_default_follows_the_protocol_and_an_edited_prompt_is_kept():
    textenv, chat = default_prompt_template(), default_chat_template()
    defaults = [textenv, chat]
    assert textenv != chat
    assert prompt_for_protocol(textenv, chat, defaults) == chat
    assert prompt_for_protocol(chat, textenv, defaults) == textenv
    assert prompt_for_protocol(chat, chat, defaults) == chat
    assert unedited(textenv.replace("\n", "\r\n") + "\n", defaults)  # (a browser's line ends, a trailing newline)
    edited = textenv + "\nQ: One more example."
    assert not unedited(edited, defaults) and prompt_for_protocol(edited, chat, defaults) == edited
    assert not unedited(None, defaults)


# ---- the handlers -----------------------------------------------------------------------------------------------
def test_every_handler_runs_on_the_selected_protocols_engine_and_says_which_answered(tiny_llama):
    page = chat_format_page(tiny_llama)
    for chosen, name in (("auto", "textenv"), ("textenv", "textenv"), ("chat", "chat")):
        job = page.service.choose(PageSettings(True, 4096, 8, 0, 0, TOOLS, PROMPT, protocol=chosen).asked())
        engine, settings = job.engine, job.settings
        assert engine.protocol.name == name and engine.key == (name, "Calculator", "Search") and (
            settings.protocol == chosen)
    shown = page_turn(page, "What is 41 * 23?", "chat")
    chat = shown.chat
    assert shown.status == "done · protocol chat"
    assert "string match `</tool_call>`" in chat[1]["content"] and "943" in chat[-1]["content"]
    episode = page.service.store.peek("page-1").session.episodes[-1]
    assert episode.protocol == "chat" and episode.answer == "Result = 943"
    settings = page_settings(max_new_tokens=48, tools=TOOLS, prompt=PROMPT, protocol="chat")
    for compare in (page.chat.compare, page.chat.compare_guide):
        last = list(compare("What is 41 * 23?", settings, request("compare")))[-1]
        text, status = last.compare_result, last.status
        assert status == "done · protocol chat" and "943" in text, (compare, text)
    last = list(page.batch.run("What is 41 * 23? | 943", settings, request("batch")))[-1]
    frame, status, download = last.batch_results, last.batch_status, last.batch_download
    assert status == "done · protocol chat" and list(frame["reward"]) == ["1"]
    (line,) = Path(download.value["path"]).read_text(encoding="utf-8").splitlines()
    record = json.loads(line)
    assert record["protocol"] == "chat" and record["reward"] == 1.0 and record["answer"] == "Result = 943"


def test_switching_the_protocol_starts_a_new_chat_with_its_note(tiny_llama):
    page = chat_format_page(tiny_llama)
    status = page_turn(page, "Hi", "textenv", max_new_tokens=4).status
    entry = page.service.store.peek("page-1")
    first = entry.session
    assert status.endswith("· protocol textenv") and entry.engine_key[0] == "textenv"
    shown = page_turn(page, "What is 41 * 23?", "chat")
    assert shown.status == "done · protocol chat"
    assert entry.session is not first and entry.engine_key[0] == "chat" and len(entry.session.episodes) == 1
    note = "Protocol changed, so the system prompt changed: started a new chat."
    assert page.page_state("page-1").notes == [note] and shown.chat[0]["content"] == note.replace(".", "\\.")
    page_turn(page, "What is 41 * 23?", "chat")  # the same protocol: the chat goes on
    assert len(entry.session.episodes) == 2 and page.page_state("page-1").notes == [note]


def test_the_default_prompt_of_one_protocol_runs_as_the_others_default_and_an_unfit_prompt_is_an_error(tiny_llama):
    page = chat_format_page(tiny_llama)
    # the box still holds textenv's default (the page's swap not yet arrived): chat runs with its own default
    status = page_turn(page, "Hi", "chat", prompt=default_prompt_template(), max_new_tokens=2).status
    assert status.startswith("done") and page.service.store.peek("page-1").prompt == default_chat_template()
    unfit = "You answer questions.\n\nQ: What is 2 + 2?\nThe answer is 4."
    shown = page_turn(page, "Hi", "chat", prompt=unfit, key="page-2")
    assert shown.status == ("error: an example's reply is `A: answer` or `> tool: argument`, not 'The answer is 4.'")
    assert shown.msg == "Hi" and page.service.store.peek("page-2").session is None


def test_the_prompt_box_swaps_an_unedited_default_and_keeps_an_edited_prompt(tiny_llama):
    settings = chat_format_page(tiny_llama).settings
    textenv, chat = default_prompt_template(), default_chat_template()
    assert settings.protocol_prompt("chat", textenv, request()).prompt == chat
    assert settings.protocol_prompt("textenv", chat, request()).prompt == textenv
    assert settings.protocol_prompt("auto", chat, request()).prompt == textenv  # (auto is textenv for this model)
    assert settings.protocol_prompt("chat", PROMPT, request()).prompt is None  # (the box as it is)


def test_the_token_view_shows_the_templates_special_tokens_by_author(tiny_llama):
    page = chat_format_page(tiny_llama)
    tokens = page_turn(page, "What is 41 * 23?", "chat").tokens
    assert [role for _, role in tokens] == ["system", "user", "model", "tool", "model"]
    text = dict((role, t) for t, role in tokens if role != "model")
    assert text["system"].startswith("<|im_start|>system\n") and PROMPT in text["system"]
    assert "<|im_start|>user\nWhat is 41 * 23?<|im_end|>\n<|im_start|>assistant\n" in text["user"]
    assert tokens[2][0] == CALL and tokens[4][0] == "Result = 943<|im_end|>"
    assert text["tool"] == "<|im_end|>\n<|im_start|>tool\n943<|im_end|>\n<|im_start|>assistant\n"
    service = page.service
    assert "".join(t for t, _ in tokens) == service.decode(service.store.peek("page-1").session.cache.ids)


def test_make_page_is_textenv_by_default(tiny_llama, monkeypatch):
    """Nothing selected (None: the PROTOCOL environment variable, unset here, else auto): textenv for this model."""
    monkeypatch.delenv("PROTOCOL", raising=False)
    page, _ = make_page(tiny_llama)
    job = page.service.choose(PageSettings(True, 4096, 8, 0, 0, TOOLS, PROMPT).asked())
    assert job.engine.protocol.name == "textenv" and job.settings.protocol == "auto"


def test_the_page_loads_with_the_default_protocols_prompt(tiny_llama, monkeypatch):
    """The selector starts on PROTOCOL (else auto), and the prompt box, once the model has loaded, on that
    protocol's default: a model whose own template lists tools gets chat's from auto."""
    from components.inputs import page_protocol

    page = chat_format_page(tiny_llama)
    monkeypatch.delenv("PROTOCOL", raising=False)
    # (the model not loaded yet: the box as built)
    assert page_protocol() == "auto" and page.settings.on_load(request()).prompt is None
    page.service.engine_for(None)  # (loaded)
    assert page.settings.on_load(request()).prompt == default_prompt_template()  # (auto is textenv for this model)
    monkeypatch.setenv("PROTOCOL", "chat")
    assert page_protocol() == "chat" and page.settings.on_load(request()).prompt == default_chat_template()
    monkeypatch.setenv("PROTOCOL", "hermes")
    assert page_protocol() == "auto"  # (the selector offers no such protocol; a turn would say so)
