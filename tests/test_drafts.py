"""Prompt-lookup drafts: fewer forward passes, the same greedy tokens, and every limit still exact."""

from __future__ import annotations

import pytest

from app.decoding.sampling import PromptLookup
from app.decoding.stops import Limit, StopReason
from app.engine.engine import Engine
from app.settings import Settings

QUESTIONS = ["What is 41 * 23?", "What does kludge mean?", "What is 1234 + 4321?"]


def test_prompt_lookup_proposes_what_followed_the_last_occurrence():
    ids = [1, 2, 3, 4, 5, 9, 2, 3]
    lookup = PromptLookup(ids)
    assert lookup.propose(3) == [4, 5, 9]
    ids.extend([7, 7])
    lookup.sync()
    assert lookup.propose(2) == []  # (3, 7, 7) and (7, 7) never occurred with a known continuation
    ids.extend([8, 2, 3])
    lookup.sync()
    assert lookup.propose(4) == [7, 7, 8, 2]  # the most recent occurrence wins


@pytest.fixture(scope="module")
def engine(real):
    return Engine(real)


@pytest.mark.parametrize("use_cache", [True, False])
def test_drafts_give_the_same_tokens_as_plain_greedy(engine, use_cache):
    for question in QUESTIONS:
        plain = engine.ask(engine.new_session(), question, Settings(max_new_tokens=40, use_cache=use_cache))
        drafted = engine.ask(engine.new_session(), question,
                             Settings(max_new_tokens=40, use_cache=use_cache, draft_tokens=8))
        assert drafted.token_ids == plain.token_ids
        assert [s.stop for s in drafted.segments] == [s.stop for s in plain.segments]
        assert [s.generated_tokens for s in drafted.segments] == [s.generated_tokens for s in plain.segments]
        # (a segment's first pass carries drafts too, not counted as prefilled prompt: its prefilled and reused
        # tokens are those before it; an accepted draft may have fed the previous segment's last token already)
        for segment in (s for s in drafted.segments + plain.segments if s.kind == "model"):
            ran = segment.generated_tokens > 0 or segment.forced_tokens < segment.end - segment.start
            assert segment.prefill_tokens + segment.cached_tokens == (segment.start if ran else 0)  # (0: a claimed
            # call the engine wrote, with no pass)
        assert [s.provenance for s in drafted.segments] == [s.provenance for s in plain.segments]
        first = drafted.segments[0]
        assert (first.prefill_tokens, first.cached_tokens) == (plain.segments[0].prefill_tokens,
                                                               plain.segments[0].cached_tokens)


def test_drafts_respect_max_new_tokens(engine):
    episode = engine.ask(engine.new_session(), QUESTIONS[0], Settings(max_new_tokens=7, draft_tokens=8, max_turns=0, guide=False))
    (segment,) = episode.segments
    assert (segment.stop.reason, segment.stop.limit, segment.generated_tokens) == (
        StopReason.MAX_LENGTH, Limit.MAX_NEW_TOKENS, 7)
    assert segment.end - segment.start == 7


def test_drafts_respect_max_length(engine):
    session = engine.new_session()
    budget = len(session.cache) + 12 + 9
    episode = engine.ask(session, QUESTIONS[0], Settings(max_new_tokens=40, max_length=budget, draft_tokens=8))
    assert episode.total_tokens <= budget and len(session.cache) <= budget
    assert episode.stop.limit is Limit.MAX_LENGTH or episode.stop.reason is StopReason.STRING_MATCH
    session.cache.check()


def test_drafts_need_fewer_forward_passes(engine, monkeypatch):
    """The point of drafts: without this, every test above would pass with drafting switched off."""
    stats = engine.backend.scheduler.stats  # one step = one forward pass (this test's row runs alone)
    passes = []
    for drafts in (0, 8):
        before = stats.steps
        engine.ask(engine.new_session(), QUESTIONS[0], Settings(max_new_tokens=40, draft_tokens=drafts))
        passes.append(stats.steps - before)
    assert passes[1] < passes[0]


def record_keeps(monkeypatch) -> list[int | None]:
    """Every pass's keep (its drafts + 1) as the rows give them, from their start and after each pass."""
    from app.backends.row import Row

    keeps: list[int | None] = []
    for name in ("begin", "update"):
        real = getattr(Row, name)
        monkeypatch.setattr(Row, name, lambda self, *args, real=real: (keeps.append((step := real(self, *args)).keep),
                                                                       step)[1])
    return keeps


def test_rows_draft_less_when_many_share_the_step(engine, monkeypatch):
    """Eight rows at once share one step's drafts (app.backends.row.DRAFTS_PER_STEP): each drafts at most 2."""
    from app.backends.row import DRAFTS_PER_STEP

    scheduler = engine.backend.scheduler
    plain = engine.ask(engine.new_session(), QUESTIONS[1], Settings(max_new_tokens=40))
    keeps = record_keeps(monkeypatch)
    monkeypatch.setattr(scheduler, "rows_in_turns", lambda: 8)
    busy = engine.ask(engine.new_session(), QUESTIONS[1], Settings(max_new_tokens=40, draft_tokens=8))
    assert busy.token_ids == plain.token_ids
    assert max(k for k in keeps if k) == DRAFTS_PER_STEP // 8 + 1  # (a draft and the model's own next token)
    keeps.clear()
    monkeypatch.setattr(scheduler, "rows_in_turns", lambda: 1)
    engine.ask(engine.new_session(), QUESTIONS[1], Settings(max_new_tokens=40, draft_tokens=8))
    assert max(k for k in keeps if k) > DRAFTS_PER_STEP // 8 + 1


def test_a_segments_first_pass_drafts_too(engine, monkeypatch):
    """After a question the model starts as the prompt's examples do ("<request><..."): the prefill pass verifies
    drafts, so the first text comes a pass earlier (8 questions at once: ~110-120 ms to first text -> ~100)."""
    keeps = record_keeps(monkeypatch)
    episode = engine.ask(engine.new_session(), QUESTIONS[0], Settings(max_new_tokens=40, draft_tokens=8))
    assert keeps[0] > 1
    assert episode.segments[0].text.startswith("<request><Calculator>")
