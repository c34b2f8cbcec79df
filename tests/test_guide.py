"""Guided answers (app.decoding.guide): the grammar of each segment state, and who chose every token of a guided turn."""

from __future__ import annotations

import llguidance
import pytest

from app.protocols.textenv.grammar import build_guide
from app.decoding.guide import claimed_guide, literal, owed_text
from app.decoding.guide_matcher import GuideError, GuideVocab, replay
from app.engine.engine import Engine
from app.episode import Provenance
from app.protocols.base import encode
from app.settings import Settings
from app.tools.registry import default_tools
from tests.conftest import prime, writing

PROMPT = "Answer with tools.\n{tools}\n\n"
TOOLS = {"Calculator": 200, "Search": 32}


@pytest.fixture(scope="module")
def vocab(tokenizer) -> GuideVocab:
    return GuideVocab(tokenizer, {tokenizer.eos_token_id})


def accepts(vocab: GuideVocab, grammar: str, text: str, tokenizer) -> bool:
    """Whether the grammar takes `text` (tokenized as the engine would) and may end after it."""
    matcher = llguidance.LLMatcher(vocab.tokenizer, llguidance.grammar_from("gbnf", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(encode(tokenizer, text)) and not matcher.is_error()
    return ok and matcher.is_accepting()


GUIDES = {
    "after a question": build_guide(TOOLS),
    "no calls left": build_guide(TOOLS, calls=False),
    "after a number": build_guide(TOOLS, owed="-24", after_tool=True),
    "after a look-up": build_guide(TOOLS, owed='grok: To "understand". \\o/ ½', after_tool=True),
    "after an error": build_guide(TOOLS, owed="error: division by zero", after_tool=True),
    "no tools": build_guide({}),
}


@pytest.mark.parametrize("state, text, ok", [
    ("after a question", "Result = 4<submit>", True),
    ("after a question", "Result = 3 < 5<submit>", True),
    ("after a question", "Result = 4", True),  # (EOS may end the line)
    ("after a question", "<request><Calculator>2 + 2<call>", True),
    ("after a question", "<request><Search>grok<call>", True),
    ("after a question", "<request><Weather>Paris<call>", False),  # not a session tool
    ("after a question", "<request><Search>two\nlines<call>", False),
    ("after a question", "<request><Search>a line\n<call>", True),  # (where the model ends the line, the call ends)
    ("after a question", "<request><Search>" + "x" * 32 + "<call>", True),
    ("after a question", "<request><Search>" + "x" * 33 + "<call>", False),
    ("after a question", "<request><Calculator>" + "1+" * 99 + "1<call>", True),
    ("after a question", "Q: What is next?", False),
    ("after a question", "Result = one\nQ: next", False),
    ("after a question", "Result = done<response>", False),
    ("after a question", "Hello!", False),
    ("no calls left", "<request><Calculator>2 + 2<call>", False),
    ("no calls left", "Result = 4<submit>", True),
    ("after a number", "\nResult = -24<submit>", True),
    ("after a number", "Result = -24 degrees<submit>", True),
    ("after a number", "\nResult = 24<submit>", False),
    ("after a number", "\nResult = -245<submit>", False),
    ("after a number", "\nResult = -24.5<submit>", False),
    ("after a number", "\nResult = -24.<submit>", True),  # (a review: a full stop after the number was banned)
    ("after a number", "\nResult = -24, or so<submit>", True),
    ("after a number", "\n<request><Calculator>-24 * 2<call>", True),
    ("after a look-up", '\nResult = grok: To "understand". \\o/ ½<submit>', True),
    ("after a look-up", '\nResult = grok: To "understand". \\o/ ½ More.<submit>', True),
    ("after a look-up", "\nResult = To understand.<submit>", False),
    ("after an error", "\nResult = error: division by zero<submit>", True),
    ("after an error", "\nResult = 10<submit>", False),
    ("no tools", "<request><Calculator>1<call>", False),
    ("no tools", "Result = Hi!<submit>", True),
])
def test_each_segment_states_grammar_takes_what_the_format_allows(vocab, tokenizer, state, text, ok):
    assert accepts(vocab, GUIDES[state].grammar, text, tokenizer) is ok


@pytest.mark.parametrize("text", ['say "hi"', "back\\slash", "two\nlines", "tab\there", "\x01 bell", "½ ™ 漢字", ""])
def test_literals_escape_quotes_backslashes_newlines_and_keep_non_ascii(vocab, tokenizer, text):
    grammar = f"root ::= {literal(text)}\n"
    vocab.check(grammar)
    assert accepts(vocab, grammar, text, tokenizer) or not text
    assert "\n" not in literal(text)


def test_a_grammar_llguidance_rejects_is_a_clear_error(vocab):
    with pytest.raises(GuideError, match="guide"):
        vocab.check('root ::= "unclosed\n')


def test_a_claimed_call_is_the_guides_opening_with_no_grammar_after_it():
    guide = claimed_guide("<request><Calculator>2 + 2<call>")
    assert guide.opening == "<request><Calculator>2 + 2<call>" and guide.grammar is None


@pytest.mark.parametrize("output, ok, owed", [
    ("943", True, "943"),
    ("grok: To understand.\nother: entry", True, "grok: To understand."),
    ('no results for "zork"', True, None),
    ("error: division by zero", False, "error: division by zero"),
    ("", True, None),  # an empty tool output: nothing to copy
])
def test_what_an_answer_copies_from_a_tools_output(output, ok, owed):
    from app.tools.search import first_entry

    assert owed_text(output, ok, first_entry) == owed


def guided_turn(tiny_llama, *pieces: str, question: str = "go", **settings):
    """A turn whose model writes `pieces`, with the guide on unless `settings` say otherwise."""
    engine = Engine(writing(tiny_llama, *pieces), tools=default_tools(), prompt=PROMPT)
    session = prime(engine)
    episode = engine.ask(session, question, Settings(max_new_tokens=40, **{"guide": True, **settings}))
    if session.cache.cached == len(session.cache):  # (a stop on a verified draft: its keys/values were computed)
        session.cache.truncate(len(session.cache) - 1)
        session.cache.extend(episode.token_ids[-1:])
    session.cache.check()
    return session, episode


def test_a_look_ups_answer_is_the_guides_not_the_models(tiny_llama):
    """The model opens the answer; the entry it copies is fixed by the grammar: forced, mask 0."""
    session, episode = guided_turn(tiny_llama, "<request><Search>grok<call>", "\nResult = made up<submit>")
    call, tool, answer = episode.segments
    entry = tool.text.removesuffix("<response>").split("\n")[0]
    assert answer.text.startswith("\nResult = " + entry)
    kinds = answer.token_provenance()
    assert Provenance.FORCED in kinds and kinds[0] is Provenance.MODEL  # the model chose to answer
    forced_text = tiny_llama.tokenizer.decode([t for t, p in zip(session.cache.ids[answer.start:answer.end], kinds)
                                               if p is Provenance.FORCED])
    assert entry.split(":")[0] in forced_text
    mask = dict(zip(range(episode.query_start, episode.query_start + len(episode.mask)), episode.mask))
    assert all(mask[answer.start + i] == 0 for i, p in enumerate(kinds) if p is Provenance.FORCED)
    assert episode.to_json()["guide"] is True
    assert episode.to_json()["segments"][2]["guided"] == {"forced_tokens": answer.forced_tokens,
                                                          "steered_tokens": answer.steered_tokens}


def test_a_token_the_grammar_bans_is_steered(tiny_llama):
    """The model's first choice, a newline on the answer line, is banned: the token chosen instead is steered."""
    _, episode = guided_turn(tiny_llama, "Result = 5\nQ: next", max_turns=0)
    answer = episode.segments[0]
    assert "\n" not in answer.text and answer.steered_tokens >= 1
    assert "steered" in answer.guided_label


def test_with_the_guide_off_every_generated_token_is_the_models(tiny_llama):
    _, episode = guided_turn(tiny_llama, "<request><Search>grok<call>", "\nResult = made up<submit>", guide=False)
    assert episode.segments[-1].text == "\nResult = made up<submit>"
    assert all(p in ("user", "tool", "model") for p in episode.provenance)
    # (every model segment says "guided", the guide off too: one JSON schema whatever the settings)
    assert episode.to_json()["segments"][0]["guided"] == {"forced_tokens": 0, "steered_tokens": 0}
    assert episode.to_json()["guide"] is False
    assert all(s.guided_label == "" for s in episode.segments)


def test_a_claimed_call_is_forced_and_not_generated(tiny_llama):
    _, episode = guided_turn(tiny_llama, "", "\nResult = 7<submit>", question="What is 2 + 2 * 3?")
    call = episode.segments[0]
    assert call.text == "<request><Calculator>2 + 2 * 3<call>" and call.stop.string == "<call>"
    assert call.generated_tokens == 0 and call.forced_tokens == call.end - call.start
    assert episode.segments[2].text.startswith("\nResult = 8")


@pytest.mark.parametrize("settings", [dict(use_cache=False), dict(draft_tokens=8), dict(draft_tokens=0)])
def test_cache_and_drafts_give_the_same_tokens_and_provenance(tiny_llama, settings):
    pieces = ("<request><Search>grok<call>", "\nResult = x<submit>")
    _, base = guided_turn(tiny_llama, *pieces)
    _, other = guided_turn(tiny_llama, *pieces, **settings)
    assert other.token_ids == base.token_ids and other.provenance == base.provenance


def test_a_model_servers_tokens_are_replayed_through_the_same_grammar(vocab, tokenizer):
    guide = build_guide(TOOLS, owed="943", after_tool=True)
    tokens = encode(tokenizer, "\nResult = 943<submit>")
    kinds = replay(vocab, guide.grammar, tokens)
    assert kinds[0] is Provenance.MODEL and Provenance.FORCED in kinds
    with pytest.raises(GuideError):  # a server that did not apply the grammar
        replay(vocab, guide.grammar, encode(tokenizer, "\nResult = 42<submit>"))


def test_a_custom_prompt_without_the_markers_works_with_the_guide_on_and_off(tiny_llama):
    for guide in (True, False):
        engine = Engine(writing(tiny_llama, "Hello there"), tools=default_tools(), prompt="You are terse.\n\n")
        episode = engine.ask(prime(engine), "Hi", Settings(max_new_tokens=8, guide=guide))
        assert episode.segments and episode.segments[0].kind == "model"
        assert episode.segments[0].text.startswith("Result =") is guide


def test_text_forced_before_the_first_pass_is_the_segments_not_prompt(tiny_llama):
    """With no call left (max_turns 0) the reply can only be the answer line: `Result =` is forced before the
    segment's first pass, fed with the question, and counted as the segment's tokens, not as prefilled prompt."""
    _, episode = guided_turn(tiny_llama, " 5<submit>", max_turns=0)
    (answer,) = episode.segments
    assert answer.text.startswith("Result =") and answer.token_provenance()[0] is Provenance.FORCED
    assert answer.prefill_tokens + answer.cached_tokens == answer.start


def test_a_model_without_eos_ids_still_gets_a_guide(tokenizer):
    """Regression (review): llguidance refuses an empty EOS list; the tokenizer's own EOS is used instead."""
    GuideVocab(tokenizer, frozenset()).check(build_guide(TOOLS).grammar)


@pytest.mark.parametrize("text, seed", [("Result = 4", 0), ("Result = 4", 1), ("<request><Search>x", 2), ("", 3)])
def test_the_greedy_shortcut_picks_what_the_masked_argmax_picks(vocab, tokenizer, text, seed):
    import torch

    from app.decoding.sampling import greedy

    matcher = vocab.matcher(build_guide(TOOLS).grammar)
    matcher.consume(encode(tokenizer, text))
    torch.manual_seed(seed)
    for boost in (None, encode(tokenizer, "\n")[0], encode(tokenizer, " 5")[0]):  # the model's first choice
        logits = torch.randn(len(tokenizer))
        if boost is not None:
            logits[boost] = 50.0
        masked, steered = matcher.mask(logits)
        assert matcher.greedy(logits) == (greedy(masked), steered)


def test_in_process_and_replayed_provenance_agree_where_the_grammar_fixes_a_tokens_text(tiny_llama, vocab):
    """Regression (review): the last token of forced text, which llguidance leaves to a pass, was the model's in
    process and forced in a server's replay: one rule now, forced wherever the grammar fixed the next text."""
    session, episode = guided_turn(tiny_llama, "<request><Search>grok<call>", "\nResult = made up<submit>")
    for segment in episode.model_segments:
        if segment.forced_tokens == segment.end - segment.start and segment.generated_tokens == 0:
            continue  # (the claimed call: the engine's text, no grammar)
        grammar = episode_guide_grammar(episode, segment)
        replayed = replay(vocab, grammar, session.cache.ids[segment.start:segment.end])
        assert [p is Provenance.FORCED for p in segment.token_provenance()] == [
            p is Provenance.FORCED for p in replayed]


def episode_guide_grammar(episode, segment) -> str:
    from app.protocols.textenv.grammar import segment_guide

    i = episode.segments.index(segment)
    after = episode.segments[i - 1] if i and episode.segments[i - 1].kind == "tool" else None
    return segment_guide(default_tools(), None, after, True).grammar
