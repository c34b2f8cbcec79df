"""Compare, timing chart, Batch tab and custom system prompt in real Chromium with the real model. Small
max_new_tokens keep each check to seconds on a 2-core CPU; every wait is on an element the app owns."""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import Page, expect

from tests.ui.conftest import OUT, TURN_MS
from tests.ui.test_app import bot_messages, select_protocol, send, set_number, set_text, user_messages
from tests.ui.waits import BATCH, TURN, Lane, before, wait_ended

pytestmark = pytest.mark.ui


def click_and_wait(page: Page, button: str, lane: Lane = TURN) -> str:
    """Click a button; wait for the end of the work it started (tests.ui.waits: the lane's count of finished work
    has grown, under a final status); its final status."""
    mark = before(page, lane)
    page.locator(f"#{button}").click()
    return wait_ended(mark)


def test_compare_shows_both_columns_and_identical_tokens(open_page):
    page = open_page()
    set_number(page, "max-new-tokens", 48)  # (a chat call is ~30 tokens)
    page.locator("#msg textarea").fill("What is 41 * 23?")
    assert click_and_wait(page, "compare") == "done · protocol chat"
    result = page.locator("#compare-result")
    expect(result.locator("th")).to_have_text(["", "cache on", "cache off"])
    expect(result).to_contain_text("identical tokens: yes")
    expect(result).to_contain_text(re.compile(r"speed-up with the cache: [\d.]+×"))
    for row in ("answer", "wall time", "tokens prefilled, all segments", "tokens reused, all segments"):
        expect(result.locator("td", has_text=re.compile(f"^{row}$"))).to_have_count(1)
    answers = result.locator("tr", has_text="answer").first.locator("td")
    assert "943" in answers.nth(1).inner_text() and answers.nth(1).inner_text() == answers.nth(2).inner_text()
    expect(user_messages(page)).to_have_count(0)  # the chat is unchanged
    page.screenshot(path=str(OUT / "compare.png"), full_page=True)


def test_timing_plot_after_a_turn(open_page):
    page = open_page()
    set_number(page, "max-new-tokens", 4)
    set_number(page, "max-turns", 0)
    send(page, "Hi")
    send(page, "Hello again")
    expect(page.locator("#timing-summary")).to_contain_text(
        re.compile(r"Turn 2: \d+ segments?, \d+ tokens prefilled new, \d+ reused from cache"))
    for elem_id in ("timing", "timing-ms"):
        plot = page.locator(f"#{elem_id}")
        expect(plot).to_be_visible()
        expect(plot.locator("canvas, svg").first).to_be_visible(timeout=30_000)
    page.locator("#timing").screenshot(path=str(OUT / "timing.png"))


def test_batch_tab_with_builtin_questions(open_page):
    page = open_page()
    set_number(page, "max-new-tokens", 48)
    page.get_by_role("tab", name="Batch").click()
    questions = page.locator("#batch-questions textarea")
    page.locator("#batch-load").click()
    expect(questions).to_have_value(re.compile(r"\| 943\n"))
    questions.fill("\n".join(questions.input_value().splitlines()[:2]))
    assert click_and_wait(page, "batch-run", BATCH) == "done · protocol chat"
    rows = page.locator("#batch-results div[role=row]")  # data rows (the header is a <tr>)
    expect(rows).to_have_count(2)
    expect(rows.first).to_contain_text("What is 41 * 23?")
    expect(rows.first).to_contain_text("EOS")  # (chat: the answer ends at the model's end of turn)
    summary = page.locator("#batch-summary")
    expect(summary).to_contain_text(re.compile(r"accuracy: \d+/2 = \d+%"))
    expect(summary).to_contain_text(re.compile(r"total time, cache on: [\d.]+ s"))
    expect(summary).to_contain_text(re.compile(r"total time, cache off: [\d.]+ s"))
    expect(summary).to_contain_text("identical answers: yes")
    page.screenshot(path=str(OUT / "batch.png"), full_page=True)
    # the episodes as JSONL, one line each, as a trainer reads them
    download = page.locator("#batch-download")
    expect(download).to_be_enabled()
    with page.expect_download() as info:
        download.click()
    assert info.value.suggested_filename == "batch-episodes.jsonl"
    lines = [json.loads(line) for line in open(info.value.path(), encoding="utf-8")]
    assert [line["question"] for line in lines] == ["What is 41 * 23?", questions.input_value().splitlines()[1]
                                                    .rpartition("|")[0].strip()]
    for line in lines:
        assert len(line["token_ids"]) == len(line["mask"]) == len(line["provenance"]) > 0
        assert line["reward"] in (0.0, 1.0) and line["guide"] is False  # (the default: the model's own work)
        assert all(m == (p == "model") for m, p in zip(line["mask"], line["provenance"]))
        assert "forced" not in line["provenance"] and "model" in line["provenance"]
    # bad input is a clear message; the server stays up
    questions.fill("")
    assert click_and_wait(page, "batch-run", BATCH).startswith("error: no questions")


def test_batch_stop_button_stops_the_run(open_page):
    page = open_page()
    set_number(page, "max-new-tokens", 48)
    page.get_by_role("tab", name="Batch").click()
    page.locator("#batch-load").click()
    expect(page.locator("#batch-questions textarea")).to_have_value(re.compile(r"\| 943\n"))
    page.locator("#batch-run").click()
    status = page.locator("#batch-status")
    expect(status).to_contain_text("running", timeout=TURN_MS)  # (the rows run at once: they finish together)
    page.locator("#batch-stop").click()
    expect(status).to_have_text("done (stopped by user) · protocol chat", timeout=TURN_MS)
    expect(page.locator("#batch-summary")).not_to_contain_text("cache off")  # the second pass never ran


def test_custom_system_prompt_is_used_and_a_change_starts_a_new_chat(open_page):
    page = open_page()
    set_number(page, "max-new-tokens", 3)
    set_number(page, "max-turns", 0)
    select_protocol(page, "textenv")  # (its prompt format: {tools} listed one per line)
    prompt = page.locator("#system-prompt textarea")
    expect(prompt).to_have_value(re.compile(r"\{tools\}"))
    set_text(prompt, "You are Custom Bot.\nTools:\n{tools}\n")
    send(page, "Hi")
    tokens = page.locator("#tokens")
    expect(tokens).to_contain_text("You are Custom Bot.")
    expect(tokens).to_contain_text("- Calculator:")
    set_text(prompt, "You are Other Bot. {tools}")
    send(page, "Hi again")
    expect(bot_messages(page).first).to_contain_text("System prompt changed")
    expect(user_messages(page)).to_have_text(["Hi again"])
    expect(tokens).to_contain_text("You are Other Bot.")
    set_text(prompt, " ")
    send(page, "kept", status=re.compile(r"^\s*error: the system prompt is empty"))
    expect(page.locator("#msg textarea")).to_have_value("kept")
