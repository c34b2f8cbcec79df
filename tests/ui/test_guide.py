"""Guided answers in real Chromium with the real bundled model: the checkbox, the "guide" colour in the token
view, Compare guide, and two visitors at once with the guide on and off. Every wait is on an element the app
owns (a turn's end by its completion marker, tests.ui.waits)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from components.tokens import COLOR_MAP
from tests.ui.conftest import OUT
from tests.ui.test_app import DONE, model_parts, send, set_number, tool_parts
from tests.ui.test_views import click_and_wait
from tests.ui.waits import before, wait_ended

pytestmark = pytest.mark.ui

LOOK_UP = "What does kludge mean?"
ENTRY = "A Rube Goldberg"  # the opening of Search's entry for kludge, which the guide's answer line begins with
GUIDED = re.compile(r"guided: \d+ forced")


def rgb(hex_colour: str) -> str:
    """"#c084fc" -> "192, 132, 252", as the token view's inline background colour has it."""
    return ", ".join(str(int(hex_colour[i:i + 2], 16)) for i in (1, 3, 5))


def guide_tokens(page: Page):
    """The token view's spans in the guide's colour."""
    return page.locator(f'#tokens .token[style*="{rgb(COLOR_MAP["guide"])}"]')


def set_guide(page: Page, on: bool) -> None:
    box = page.locator("#guide input[type=checkbox]")
    box.set_checked(on)
    expect(box).to_be_checked(checked=on)


def test_a_guided_look_up_shows_the_guides_tokens_and_the_status_lines_say_so(open_page):
    page = open_page()
    expect(page.locator("#guide")).to_contain_text("Guided answers")
    expect(page.locator("#guide input[type=checkbox]")).not_to_be_checked()  # off by default: the model's own work
    set_guide(page, True)
    send(page, LOOK_UP)
    assert len(tool_parts(page)) == 1
    models = model_parts(page)
    assert ENTRY in models[-1] and GUIDED.search(models[-1]), models
    expect(page.locator("#tokens")).to_contain_text("guide")  # the legend
    guided = guide_tokens(page)
    expect(guided.first).to_be_visible()
    assert ENTRY in " ".join(guided.all_inner_texts())  # the entry the answer opens with is the guide's


def test_switching_the_guide_off_gives_the_models_own_answer(open_page):
    page = open_page()
    set_guide(page, True)
    set_guide(page, False)
    send(page, LOOK_UP)
    models = model_parts(page)
    assert models and not any("guided:" in text for text in models), models
    expect(page.locator("#tokens")).to_contain_text("What does kludge mean?")
    expect(guide_tokens(page)).to_have_count(0)
    set_guide(page, True)  # the next turn of the same chat is guided again
    send(page, "What is 41 * 23?")
    assert GUIDED.search(model_parts(page)[-1]), model_parts(page)
    expect(guide_tokens(page).first).to_be_visible()


def test_compare_guide_shows_the_guide_on_and_off_side_by_side(open_page):
    page = open_page()
    set_number(page, "max-new-tokens", 48)
    page.locator("#msg textarea").fill(LOOK_UP)
    assert click_and_wait(page, "compare-guide") == "done · protocol chat"
    result = page.locator("#compare-result")
    expect(result.locator("th")).to_have_text(["", "guide on", "guide off"])
    for row in ("answer", "tool calls", "tokens forced by the guide", "tokens steered by the guide",
                "tokens the model chose", "wall time"):
        expect(result.locator("td", has_text=re.compile(f"^{row}$"))).to_have_count(1)
    forced = result.locator("tr", has_text="tokens forced by the guide").locator("td")
    assert int(forced.nth(1).inner_text()) > 0 and forced.nth(2).inner_text() == "0"
    assert ENTRY in result.locator("tr", has_text="answer").first.locator("td").nth(1).inner_text()
    expect(result).to_contain_text(re.compile(r"same answer: (yes|no)"))
    expect(page.locator("#chat .message.user")).to_have_count(0)  # the chat is unchanged
    page.screenshot(path=str(OUT / "compare-guide.png"), full_page=True)


def test_two_visitors_at_once_one_with_the_guide_off(open_page):
    """Each visitor's checkbox is theirs: sent at the same moment, one turn is guided and the other is not."""
    on, off = open_page(), open_page()
    set_guide(on, True)  # (off is the default)
    for page in (on, off):
        page.locator("#msg textarea").fill(LOOK_UP)
    marks = [before(page) for page in (on, off)]
    for page in (on, off):
        page.locator("#send").click()
    for page, mark in zip((on, off), marks):
        wait_ended(mark)
        expect(page.locator("#status")).to_have_text(DONE)
    assert GUIDED.search(model_parts(on)[-1]) and not any("guided:" in t for t in model_parts(off))
    expect(guide_tokens(on).first).to_be_visible()
    expect(guide_tokens(off)).to_have_count(0)
    guide_tokens(on).last.scroll_into_view_if_needed()  # (the token view scrolls: show the answer's tokens)
    off.locator("#tokens .token").last.scroll_into_view_if_needed()
    on.screenshot(path=str(OUT / "two-visitors-guide-on.png"), full_page=True)
    off.screenshot(path=str(OUT / "two-visitors-guide-off.png"), full_page=True)
