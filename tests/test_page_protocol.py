"""The page's Protocol selector (issue 47): PageSettings with a protocol, the engine each handler picks (chat,
Compare cache, Compare guide, Batch), the status line naming the protocol that answered, a switch starting a new
chat with its note, the prompt box following the protocol while it holds a default, the chat protocol's tokens in
the token view, and the Batch JSONL's protocol field. A tiny random model (SmolLM2's tokenizer: `auto` is textenv,
`chat` renders with the project's template, assets/chat_template.jinja)."""

from __future__ import annotations

import json
from pathlib import Path

import gradio as gr
import pytest

from app.protocols.chat_prompt import default_chat_template
from app.protocols.textenv.prompt import default_prompt_template
from app.serving.sessions import MB, SessionStore
from app.settings import InputError
from components.handlers import ChatService
from components.inputs import PageSettings, prompt_for_protocol, unedited
from tests.conftest import writing
from tests.support.page import make_service, request
from tests.support.page import one_token_per_pass  # noqa: F401  (an autouse fixture)

CALL = '<tool_call>[{"name": "calculator", "arguments": {"expression": "41 * 23"}}]</tool_call>'
PROMPT = "You answer questions, with tools where they help."  # (an edited prompt: no examples, kept as written)
TOOLS = ["Calculator", "Search"]


def chat_service(tiny_llama) -> ChatService:
    """A service whose model writes the calculator call in the chat format, then the answer and <|im_end|>."""
    loaded = writing(tiny_llama, CALL, "Result = 943<|im_end|>", marker="<|im_start|>tool", specials=True)
    return ChatService(loader=lambda: loaded, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))


def page_turn(service: ChatService, message: str, protocol: str, prompt: str = PROMPT, key: str = "page-1",
              max_new_tokens: int = 48) -> tuple:
    """One turn from the page's Chat tab with `protocol` selected; its last update."""
    return list(service.chat(message, True, 4096, max_new_tokens, 4, 0, TOOLS, prompt, request(key),
                             protocol=protocol))[-1]


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
    service = chat_service(tiny_llama)
    for chosen, name in (("auto", "textenv"), ("textenv", "textenv"), ("chat", "chat")):
        engine, settings = service.page_settings(PageSettings(True, 4096, 8, 0, 0, TOOLS, protocol=chosen))
        assert engine.protocol.name == name and engine.key == (name, "Calculator", "Search") and (
            settings.protocol == chosen)
    chat, _, status, tokens, *_ = page_turn(service, "What is 41 * 23?", "chat")
    assert status == "done · protocol chat"
    assert "string match `</tool_call>`" in chat[1]["content"] and "943" in chat[-1]["content"]
    episode = service.store.peek("page-1").session.episodes[-1]
    assert episode.protocol == "chat" and episode.answer == "Result = 943"
    args = ("What is 41 * 23?", True, 4096, 48, 4, 0, TOOLS, PROMPT, request("compare"))
    for compare in (service.compare, service.compare_guide):
        text, status, _ = list(compare(*args, protocol="chat"))[-1]
        assert status == "done · protocol chat" and "943" in text, (compare, text)
    *_, (frame, _, status, download, _) = service.batch("What is 41 * 23? | 943", True, 4096, 48, 4, 0, TOOLS,
                                                        PROMPT, request("batch"), protocol="chat")
    assert status == "done · protocol chat" and list(frame["reward"]) == ["1"]
    (line,) = Path(download.value["path"]).read_text(encoding="utf-8").splitlines()
    record = json.loads(line)
    assert record["protocol"] == "chat" and record["reward"] == 1.0 and record["answer"] == "Result = 943"


def test_switching_the_protocol_starts_a_new_chat_with_its_note(tiny_llama):
    service = chat_service(tiny_llama)
    _, _, status, *_ = page_turn(service, "Hi", "textenv", max_new_tokens=4)
    entry = service.store.peek("page-1")
    first = entry.session
    assert status.endswith("· protocol textenv") and entry.engine_key[0] == "textenv"
    chat, _, status, *_ = page_turn(service, "What is 41 * 23?", "chat")
    assert status == "done · protocol chat"
    assert entry.session is not first and entry.engine_key[0] == "chat" and len(entry.session.episodes) == 1
    note = "Protocol changed, so the system prompt changed: started a new chat."
    assert service.page_state("page-1").notes == [note] and chat[0]["content"] == note.replace(".", "\\.")
    _, _, status, *_ = page_turn(service, "What is 41 * 23?", "chat")  # the same protocol: the chat goes on
    assert len(entry.session.episodes) == 2 and service.page_state("page-1").notes == [note]


def test_the_default_prompt_of_one_protocol_runs_as_the_others_default_and_an_unfit_prompt_is_an_error(tiny_llama):
    service = chat_service(tiny_llama)
    # the box still holds textenv's default (the page's swap not yet arrived): chat runs with its own default
    _, _, status, *_ = page_turn(service, "Hi", "chat", prompt=default_prompt_template(), max_new_tokens=2)
    assert status.startswith("done") and service.store.peek("page-1").prompt == default_chat_template()
    unfit = "You answer questions.\n\nQ: What is 2 + 2?\nThe answer is 4."
    chat, textbox, status, *_ = page_turn(service, "Hi", "chat", prompt=unfit, key="page-2")
    assert status == ("error: an example's reply is `A: answer` or `> tool: argument`, not 'The answer is 4.'")
    assert textbox == "Hi" and service.store.peek("page-2").session is None


def test_the_prompt_box_swaps_an_unedited_default_and_keeps_an_edited_prompt(tiny_llama):
    service = chat_service(tiny_llama)
    textenv, chat = default_prompt_template(), default_chat_template()
    assert service.protocol_prompt("chat", textenv, request()) == chat
    assert service.protocol_prompt("textenv", chat, request()) == textenv
    assert service.protocol_prompt("auto", chat, request()) == textenv  # (auto is textenv for this model)
    assert service.protocol_prompt("chat", PROMPT, request()) == gr.skip()


def test_the_token_view_shows_the_templates_special_tokens_by_author(tiny_llama):
    service = chat_service(tiny_llama)
    _, _, status, tokens, *_ = page_turn(service, "What is 41 * 23?", "chat")
    assert [role for _, role in tokens] == ["system", "user", "model", "tool", "model"]
    text = dict((role, t) for t, role in tokens if role != "model")
    assert text["system"].startswith("<|im_start|>system\n") and PROMPT in text["system"]
    assert "<|im_start|>user\nWhat is 41 * 23?<|im_end|>\n<|im_start|>assistant\n" in text["user"]
    assert tokens[2][0] == CALL and tokens[4][0] == "Result = 943<|im_end|>"
    assert text["tool"] == "<|im_end|>\n<|im_start|>tool\n943<|im_end|>\n<|im_start|>assistant\n"
    assert "".join(t for t, _ in tokens) == service.decode(service.store.peek("page-1").session.cache.ids)


def test_make_service_is_textenv_by_default(tiny_llama, monkeypatch):
    """Nothing selected (None: the PROTOCOL environment variable, unset here, else auto): textenv for this model."""
    monkeypatch.delenv("PROTOCOL", raising=False)
    service, _ = make_service(tiny_llama)
    engine, settings = service.page_settings(PageSettings(True, 4096, 8, 0, 0, TOOLS))
    assert engine.protocol.name == "textenv" and settings.protocol == "auto"


def test_the_page_loads_with_the_default_protocols_prompt(tiny_llama, monkeypatch):
    """The selector starts on PROTOCOL (else auto), and the prompt box, once the model has loaded, on that
    protocol's default: a model whose own template lists tools gets chat's from auto."""
    from components.inputs import page_protocol

    service = chat_service(tiny_llama)
    monkeypatch.delenv("PROTOCOL", raising=False)
    assert page_protocol() == "auto" and service.refresh(request())[4] == gr.skip()  # (the model not loaded yet)
    service.engine_for(None)  # (loaded)
    assert service.refresh(request())[4] == default_prompt_template()  # (auto is textenv for this model)
    monkeypatch.setenv("PROTOCOL", "chat")
    assert page_protocol() == "chat" and service.refresh(request())[4] == default_chat_template()
    monkeypatch.setenv("PROTOCOL", "hermes")
    assert page_protocol() == "auto"  # (the selector offers no such protocol; a turn would say so)
