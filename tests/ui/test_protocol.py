"""The Protocol selector in real Chromium with the real bundled model: two visitors at once, one on textenv and one on
chat, each answered in their own protocol (the chat's call ending at `</tool_call>`), the status line naming it, the
prompt box showing the chat protocol's default, and the token view showing the template's special tokens coloured by
author. Every wait is on an element the app owns (a turn's end by its completion marker, tests.ui.waits)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from components.tokens import COLOR_MAP
from tests.ui.conftest import OUT
from tests.ui.test_app import model_parts, select_protocol, tool_parts
from tests.ui.test_guide import rgb
from tests.ui.waits import before, wait_ended

pytestmark = pytest.mark.ui

QUESTION = "What is 41 * 23?"


def tokens_of(page: Page, role: str):
    """The token view's spans in `role`'s colour."""
    return page.locator(f'#tokens .token[style*="{rgb(COLOR_MAP[role])}"]')


def test_two_visitors_at_once_one_on_textenv_one_on_chat(open_page):
    textenv, chat = open_page(), open_page()
    expect(chat.locator("#protocol").get_by_label("auto", exact=True)).to_be_checked()  # the default
    select_protocol(textenv, "textenv")
    select_protocol(chat, "chat")
    # the unedited prompt box follows the protocol: the chat protocol's examples (assets/chat_prompt.txt)
    expect(chat.locator("#system-prompt textarea")).to_have_value(re.compile(r"> calculator: 13 \* 7"))
    expect(textenv.locator("#system-prompt textarea")).to_have_value(re.compile(r"<call>"))
    for page in (textenv, chat):
        page.locator("#msg textarea").fill(QUESTION)
    marks = [before(page) for page in (textenv, chat)]
    for page in (textenv, chat):
        page.locator("#send").click()
    for page, mark, name in ((textenv, marks[0], "textenv"), (chat, marks[1], "chat")):
        wait_ended(mark)
        expect(page.locator("#status")).to_have_text(f"done · protocol {name}")
    models, tools = model_parts(chat), tool_parts(chat)
    assert tools and "Tool Calculator: 41 * 23" in tools[0] and "943" in tools[0], tools
    assert "stop: string match </tool_call>" in models[0] and "<tool_call>" in models[0], models
    assert "943" in models[-1] and "stop: EOS" in models[-1], models
    theirs = model_parts(textenv)
    assert "string match <call>" in theirs[0] and "943" in theirs[-1], theirs
    # the chat's token view: the template's special tokens, each in its author's colour
    expect(chat.locator("#tokens")).to_contain_text("<|im_start|>system")
    expect(tokens_of(chat, "user").filter(has_text="<|im_start|>user")).not_to_have_count(0)
    expect(tokens_of(chat, "tool").filter(has_text="<|im_start|>tool")).not_to_have_count(0)
    expect(tokens_of(chat, "model").or_(tokens_of(chat, "guide")).filter(has_text="</tool_call>")).not_to_have_count(0)
    expect(textenv.locator("#tokens")).not_to_contain_text("<|im_start|>")
    for page, name in ((textenv, "textenv"), (chat, "chat")):
        page.locator("#tokens .token").last.scroll_into_view_if_needed()  # (the token view scrolls: the answer)
        page.screenshot(path=str(OUT / f"two-visitors-protocol-{name}.png"), full_page=True)
