"""The app in real Chromium, with the real bundled model: every check waits on elements the app owns
(the `#status` text, chat messages), never on network calls; a turn's end by its completion marker
(tests.ui.waits)."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
from playwright.sync_api import Locator, Page, expect

from tests.ui.conftest import OUT, ROOT, TURN_MS
from tests.ui.waits import before, wait_ended

pytestmark = pytest.mark.ui


def user_messages(page: Page):
    return page.locator("#chat .message.user")


def bot_messages(page: Page):
    return page.locator("#chat .message.bot")


def set_number(page: Page, elem_id: str, value: float) -> None:
    field = page.locator(f"#{elem_id} input")
    field.fill(str(value))
    field.blur()


def set_text(box: Locator, text: str) -> None:
    """Fill a settings text box and leave it, as a visitor does before Send: a fill alone sometimes reached the
    next turn too late (CI once sent the default prompt, which answered with a quick look-up)."""
    box.fill(text)
    box.blur()


def select_protocol(page: Page, name: str) -> None:
    choice = page.locator("#protocol").get_by_label(name, exact=True)
    choice.check()
    expect(choice).to_be_checked()


def send(page: Page, text: str, status: str | re.Pattern | None = None) -> None:
    """Type and send a message; wait for this turn's end (tests.ui.waits: the page's count of finished turns has
    grown, under a final status), then check its status."""
    mark = before(page)
    page.locator("#msg textarea").fill(text)
    page.locator("#send").click()
    wait_ended(mark)
    expect(page.locator("#status")).to_have_text(DONE if status is None else status)


# A story example: greedy, the bundled model then tells "a long story about a robot" past 120 tokens
# ("You write very long stories." alone got "A:" and EOS).
STORIES = ("Stories\n\nQ: Tell me a story about a cat.\nOnce upon a time, a cat lived in a small house by the sea. "
           "Every morning she walked along the beach, and every evening she told the fishermen what she had seen. "
           "One day she found a bottle with a letter inside, and that was the start of a long journey.\n")
DONE = re.compile(r"^\s*done( · ended by [^\n·]*)?( · protocol (textenv|chat))?\s*$")  # (tests' tiny max_new_tokens: "ended by max_length …")


def model_parts(page: Page) -> list[str]:
    """Text of each model segment (bot messages that are not tool parts)."""
    return [m.inner_text() for m in bot_messages(page).all() if m.locator(".thought-group").count() == 0]


def tool_parts(page: Page) -> list[str]:
    return [m.inner_text() for m in bot_messages(page).all() if m.locator(".thought-group").count() > 0]


STOP = re.compile(r"stop: (string match <call>|string match <submit>|string match \\nQ:|string match </tool_call>|EOS|"
                  r"max_length \((max_new_tokens|session max_length)\)|stopped by user) · "
                  r"prefill \d+ new tokens · \d+ reused from cache · \d+ generated · \d+ ms")


def test_calculator_question_shows_tool_call_result_and_stop_reasons(open_page):
    page = open_page()
    send(page, "What is 41 * 23?")
    tools = tool_parts(page)
    assert tools and "Tool Calculator: 41 * 23" in tools[0] and "tool\n943" in tools[0]
    models = model_parts(page)
    assert len(models) == len(tools) + 1
    assert all(STOP.search(text) for text in models), models
    # the default: chat, the guide off: the model's own call, its JSON and markers rendered as text
    assert '"name": "calculator"' in models[0] and "guided:" not in models[0]
    assert "string match </tool_call>" in models[0] and "943" in models[-1]
    legend = page.locator("#tokens")
    for role in ("system", "user", "model", "tool"):
        expect(legend).to_contain_text(role)
    expect(page.locator("#stats")).to_contain_text(re.compile(r"This chat: \d+ tokens, \d+ cached"))
    OUT.mkdir(exist_ok=True)
    shot = OUT / "calculator.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("UPDATE_SCREENSHOT") == "1":  # refresh the README's picture on purpose, not on every run
        shutil.copyfile(shot, ROOT / "assets" / "screenshot.png")


def test_search_question_ends_cleanly_with_the_definition(open_page):
    # Regression: the page's own example wrote a made-up next example ("Q: What is a kludge?") and called
    # Search again until max_turns, answering with text that was not in the tool's output.
    page = open_page()
    send(page, "What does kludge mean?")
    tools = tool_parts(page)
    assert len(tools) == 1 and "Tool Search: kludge" in tools[0]
    assert "kludge (see kluge): A Rube Goldberg" in tools[0]
    models = model_parts(page)
    assert len(models) == 2 and all(STOP.search(text) for text in models)
    assert "string match </tool_call>" in models[0] and "stop: EOS" in models[1]
    assert "kludge" in models[1] and "A Rube Goldberg" in models[1] and "Q:" not in models[1]
    page.screenshot(path=str(OUT / "search.png"), full_page=True)


def test_tiny_max_length_stops_with_max_length(open_page):
    page = open_page()
    set_number(page, "max-new-tokens", 1)
    send(page, "Hi", status="done · ended by max_length (max_new_tokens) · protocol chat")  # (the status says why: no answer)
    tokens = int(re.search(r"This chat: (\d+) tokens", page.locator("#stats").inner_text())[1])
    set_number(page, "max-length", tokens + 24)
    set_number(page, "max-new-tokens", 64)
    send(page, "Write a very long story about a dragon.", status="done · ended by max_length (session max_length) · protocol chat")
    assert "stop: max_length (session max_length)" in model_parts(page)[-1]
    send(page, "And another one?", status=re.compile(r"^\s*error: the context is full"))
    expect(page.locator("#status")).to_contain_text("start a new chat")
    expect(page.locator("#msg textarea")).to_have_value("And another one?")  # nothing typed is lost
    assert user_messages(page).count() == 2  # the chat so far is kept


def test_cache_off_gives_the_same_greedy_answer(open_page):
    page = open_page()
    set_number(page, "max-new-tokens", 48)  # (a chat call is ~30 tokens)
    send(page, "What is 41 * 23?")
    cached = [t.split("stop:")[0] for t in model_parts(page)]
    page.locator("#new-chat").click()
    expect(bot_messages(page)).to_have_count(0)
    page.locator("#use-cache input").uncheck()
    send(page, "What is 41 * 23?")
    assert [t.split("stop:")[0] for t in model_parts(page)] == cached
    assert all("· 0 reused from cache" in t for t in model_parts(page))
    expect(page.locator("#stats")).to_contain_text(" 0 cached")


def test_two_browser_contexts_see_only_their_own_chats_and_new_chat_clears(open_page):
    one, two = open_page(), open_page()
    for page, text in ((one, "Hello, who are you?"), (two, "What is 2 + 2?")):
        set_number(page, "max-new-tokens", 3)
        set_number(page, "max-turns", 0)
        send(page, text)
    expect(user_messages(one)).to_have_text(["Hello, who are you?"])
    expect(user_messages(two)).to_have_text(["What is 2 + 2?"])
    one.locator("#new-chat").click()
    expect(one.locator("#status")).to_have_text("new chat")
    expect(user_messages(one)).to_have_count(0)
    expect(bot_messages(one)).to_have_count(0)
    expect(one.locator("#stats")).to_contain_text("no tokens yet")
    expect(user_messages(two)).to_have_text(["What is 2 + 2?"])
    # closing a page frees its server-side session (demo.unload after the heartbeat drops)
    one.close()
    deadline = time.monotonic() + 30
    while True:
        two.locator("#new-chat").click()  # any event refreshes the stats panel
        expect(two.locator("#status")).to_have_text("new chat")
        if "Server: 1 session," in two.locator("#stats").inner_text() or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    expect(two.locator("#stats")).to_contain_text("Server: 1 session,")


def test_the_chats_trash_icon_starts_a_new_chat(open_page):
    """Regression: the Chatbot's own trash icon emptied the view only; the next answer showed the "cleared" turns
    again (the session still held them) and the stats panel kept counting them."""
    page = open_page()
    send(page, "What is 17 * 23?")
    page.locator("#chat button[aria-label*='Clear' i], #chat button[title*='Clear' i]").first.click()
    expect(page.locator("#status")).to_have_text(re.compile(r"^\s*new chat\s*$"), timeout=TURN_MS)
    send(page, "What is 2 + 3?")
    texts = " ".join(m.inner_text() for m in user_messages(page).all())
    assert "2 + 3" in texts and "17 * 23" not in texts


def test_stop_cancels_generation(open_page):
    page = open_page()
    set_number(page, "max-new-tokens", 400)
    select_protocol(page, "textenv")  # (STORIES is a textenv prompt)
    set_text(page.locator("#system-prompt textarea"), STORIES)  # the default prompt's answers end after a line or two
    page.locator("#msg textarea").fill("Tell me a long story about a robot.")
    page.locator("#send").click()
    expect(bot_messages(page).last).to_contain_text("generating", timeout=TURN_MS)
    expect(bot_messages(page).last).to_contain_text(re.compile(r"\w+ \w+ \w+"), timeout=TURN_MS)
    page.locator("#stop").click()
    expect(page.locator("#status")).to_have_text("done · protocol textenv", timeout=TURN_MS)  # (stopped: no "ended by")
    last = model_parts(page)[-1]
    assert "stop: stopped by user" in last
    generated = int(re.search(r"(\d+) generated", last)[1])
    assert 0 < generated < 400
    page.screenshot(path=str(OUT / "stopped.png"), full_page=True)
    set_number(page, "max-new-tokens", 2)
    send(page, "Hi")  # the session is still consistent and usable


def test_two_visitors_sending_at_once_both_see_their_message_waiting_then_their_own_answer(open_page):
    """Regression: a message sent while another visitor's turn ran vanished from the box and did not appear in
    the chat until that turn ended ("queue: 1/1" below the buttons was the only sign); turns now run together."""
    one, two = open_page(), open_page()
    for page, text in ((one, "What is 12 * 12?"), (two, "What is 21 * 3?")):
        page.locator("#msg textarea").fill(text)
    marks = [before(page) for page in (one, two)]
    one.locator("#send").click()
    two.locator("#send").click()
    for page, text in ((one, "What is 12 * 12?"), (two, "What is 21 * 3?")):
        expect(user_messages(page)).to_have_text([text], timeout=5_000)  # at once, not after the other's turn
        expect(bot_messages(page).last).to_contain_text(re.compile("waiting for the model|generating|stop:"))
    two.screenshot(path=str(OUT / "two-visitors.png"), full_page=True)
    for page, mark, answer in ((one, marks[0], "144"), (two, marks[1], "63")):
        wait_ended(mark)
        assert answer in model_parts(page)[-1]


def test_messages_sent_while_a_turn_runs_are_answered_in_order_and_a_draft_is_kept(open_page):
    """Regressions: Send during a running turn was dropped (Gradio's trigger_mode "once"); the box was emptied
    when a queued turn started, erasing what the visitor had typed since (and quick sends lost a message)."""
    page = open_page()
    set_number(page, "max-new-tokens", 24)
    set_number(page, "max-turns", 0)
    box = page.locator("#msg textarea")
    mark = before(page)
    box.fill("Write a long story about a robot who learns to paint.")  # 24 tokens of text, no tool call
    page.locator("#send").click()
    # the turn has started (shown at once; its answer may be short: the model may call a tool and stop there)
    expect(bot_messages(page).last).to_contain_text(re.compile("waiting for the model|generating"), timeout=TURN_MS)
    box.fill("What is 3 + 4?")
    page.locator("#send").click()
    expect(box).to_have_value("")  # emptied on submit, not when the queued turn starts
    box.fill("Say hi")
    box.press("Enter")
    expect(box).to_have_value("")
    box.fill("a draft I have not sent")
    expect(user_messages(page)).to_have_count(3, timeout=3 * TURN_MS)
    # ("done" alone is not the end: each of the three turns ends on a final status, so the three have ended when
    # the page's count of finished turns has grown by three)
    wait_ended(mark, pieces=3, timeout=3 * TURN_MS)
    expect(page.locator("#status")).to_have_text(DONE)
    expect(user_messages(page)).to_have_text(
        ["Write a long story about a robot who learns to paint.", "What is 3 + 4?", "Say hi"])
    assert len(model_parts(page)) == 3
    expect(box).to_have_value("a draft I have not sent")


def test_a_number_below_its_range_is_a_status_message(open_page):
    """Regression: the field's own minimum raised Gradio's raw error over every output, with a traceback."""
    page = open_page()
    set_number(page, "max-new-tokens", 0)
    send(page, "Hi", status="error: max_new_tokens must be between 1 and 4096")


def test_a_decimal_in_a_whole_number_field_is_a_status_message(open_page):
    """Regression: the fields rounded 2.5 to 2 before the check, so a turn ran with a value nobody typed."""
    page = open_page()
    set_number(page, "max-new-tokens", 2.5)
    send(page, "Hi", status="error: max_new_tokens must be a whole number, not 2.5")
    expect(page.locator("#max-new-tokens input")).to_have_value("2.5")


def test_empty_message_shows_an_error(open_page):
    page = open_page()
    send(page, "", status="error: the message is empty")
    expect(user_messages(page)).to_have_count(0)


def test_gradio_client_ask_returns_episode_json(app_url):
    from gradio_client import Client

    client = Client(app_url, verbose=False)
    result = client.predict("What is 41 * 23?", {"max_new_tokens": 32}, api_name="/ask")
    assert set(result) == {"question", "answer", "backend", "protocol", "total_tokens", "cache", "guide",
                         "segments"}
    assert result["question"] == "What is 41 * 23?" and result["guide"] is False  # (the default: the model alone)
    assert set(result["cache"]) == {"enabled", "prefill_tokens", "reused_tokens"}
    segment_keys = {"kind", "text", "stop_reason", "stop_string", "limit", "tool", "prefill_tokens",
                    "cached_tokens", "generated_tokens", "ms"}
    assert result["segments"] and all(set(s) == segment_keys | ({"guided"} if s["kind"] == "model" else set())
                                      for s in result["segments"])
    guided = client.predict("What is 41 * 23?", {"max_new_tokens": 32, "guide": True}, api_name="/ask")
    assert guided["guide"] is True and all(  # (one schema: "guided" in every model segment, zeros unguided)
        set(s) == segment_keys | ({"guided"} if s["kind"] == "model" else set()) for s in guided["segments"])
    assert result["segments"][0]["kind"] == "model" and result["segments"][0]["stop_reason"]
    chunks = list(client.submit("Hello, who are you?", {"max_new_tokens": 8, "max_turns": 0}, api_name="/chat"))
    assert chunks and all(isinstance(c, str) for c in chunks)
    assert all(b.startswith(a) for a, b in zip(chunks, chunks[1:]))
    chunks = list(client.submit("What is 2 + 2?", None, api_name="/chat"))  # settings None, as in the README
    assert '"name": "calculator"' in chunks[-1] and "tool\n4<|im_end|>" in chunks[-1]
    api = client.view_api(print_info=False, return_format="dict")
    assert set(api["named_endpoints"]) == {"/chat", "/ask", "/stats"} and not api["unnamed_endpoints"]
    stats = client.predict(api_name="/stats")
    assert stats["sessions"] >= 1 and stats["budget_mb"] > 0 and stats["scheduler"]["steps"] > 0
