"""The page's handlers on a tiny forced model, for the tests of components/ (test_handlers.py, test_api.py, …):
a Page (components/page.py) on a forced-token model, the page's settings as one PageSettings, a turn or a queued
page turn run to its end, a hand-built episode, and the fixture that keeps one planned token per forward pass with
the guide off."""

from __future__ import annotations

import re
import types

import pytest

from app.decoding.guide_matcher import GuideVocab
from app.decoding.stops import Stop, StopReason
from app.protocols.textenv.prompt import default_prompt_template
from app.episode import Episode, Segment
from app.serving import MB, Service
from components.chat_tab import ChatView
from components.inputs import PageSettings
from components.page import Page
from tests.conftest import forced, plan_text, writing

CALL_STOP = Stop(StopReason.STRING_MATCH, string="<call>")
SUBMIT_STOP = Stop(StopReason.STRING_MATCH, string="<submit>")


def calculator_episode() -> Episode:
    episode = Episode("What is 41 * 23?", 700, 713, use_cache=True)
    episode.segments = [
        Segment("model", "<request><Calculator>41 * 23<call>", 713, 728, stop=CALL_STOP, prefill_tokens=13,
                cached_tokens=700, generated_tokens=15, ms=1814.4),
        Segment("tool", "943<response>", 728, 734, tool="Calculator", query="41 * 23", ms=43.0),
        Segment("model", "\nResult = 943<submit>", 734, 744, stop=SUBMIT_STOP, prefill_tokens=7, cached_tokens=727,
                generated_tokens=10, ms=1240.0),
    ]
    return episode


@pytest.fixture(autouse=True)
def one_token_per_pass(monkeypatch):
    """Forced plans name the token of each forward pass; prompt-lookup drafts verify several per pass. The guide
    is off unless a test turns it on (guide=True): these tests are about the handlers, and the guide would change
    the planned text (its own tests: tests/test_guide.py, and the guided ones in test_handlers.py, test_api.py)."""
    import dataclasses

    from components import inputs

    monkeypatch.setattr(inputs, "DEFAULTS", dataclasses.replace(inputs.DEFAULTS, draft_tokens=0, guide=False))


def request(key: str = "page-1"):
    return types.SimpleNamespace(session_hash=key)


def new_page(loader, **store) -> Page:
    """A Page on its own Service (`loader` gives the backend), with a 512 MB KV budget unless `store` says."""
    store = {"budget_bytes": 512 * MB, "idle_timeout_s": 3600, **store}
    return Page(Service(loader=loader, **store))


def make_page(tiny_llama, plan=None, eos_ids=None) -> tuple[Page, object]:
    loaded = forced(tiny_llama, plan, eos_ids=eos_ids)
    if eos_ids is not None and not eos_ids:  # a model that never stops: the guide (warm_up's turn runs it) still
        # needs its tokenizer's end token (llguidance rejects an empty EOS list)
        loaded.__dict__["guide_vocab"] = GuideVocab(loaded.tokenizer, tiny_llama.eos_ids)
    page = new_page(lambda: loaded)
    page.service.warm_up()  # prefill the shared prompt now, so plan step 0 is the first generated token
    loaded.model.step = 0
    return page, loaded


def page_settings(use_cache=True, max_length=4096, max_new_tokens=16, max_turns=4, temperature=0,
                  tools=("Calculator", "Search"), prompt=None, **more) -> PageSettings:
    """The page's settings controls as a visitor may set them (the textenv prompt unless `prompt` says)."""
    prompt = default_prompt_template() if prompt is None else prompt
    return PageSettings(use_cache, max_length, max_new_tokens, max_turns, temperature, list(tools), prompt, **more)


def plain(status: str) -> str:
    """A final status without its ending note (these turns' tiny max_new_tokens end them: "ended by max_length")
    and without the protocol that answered ("protocol textenv")."""
    return re.sub(r" · (ended by [^·]*?|protocol \w+)(?= · |$)", "", status)


def turn(page: Page, message: str, key: str = "page-1", ticket: int | None = None, sent: int | None = None,
         **settings) -> list[ChatView]:
    """Every update of one turn of `message` sent from the page (with its Stop `ticket` and number among the
    waiting messages, `sent`, where given), on page_settings(**settings)."""
    submitted = {"message": message, "ticket": ticket, "sent": sent}
    return list(page.chat.turn(submitted, page_settings(**settings), request(key)))


@pytest.fixture
def calculator_plan(tokenizer):
    first = "<request><Calculator>41 * 23<call>"
    return plan_text(tokenizer, (0, first), (len(tokenizer(first, add_special_tokens=False)["input_ids"]),
                                             "Result = 943<submit>"))


def page_turn(page: Page, submitted: dict, max_new_tokens: int = 50) -> ChatView:
    """The last update of a turn the page queued: ChatTab.turn on what submit() handed over."""
    return list(page.chat.turn(submitted, page_settings(max_new_tokens=max_new_tokens), request()))[-1]


CLAIMED = "What is 2 + 2 * 3?"  # a question the Calculator claims: with the guide on, the engine writes the call
ALONE = "\nResult = 7<submit>"  # what the model writes (tests/conftest.py WritingModel), the guide off or on


def writing_page(tiny_llama, *pieces: str) -> Page:
    loaded = writing(tiny_llama, *pieces)
    return new_page(lambda: loaded)
