"""Forced text is text: what the engine or the guide writes into a model segment never becomes a special token, and
the guide keeps calls in their tags (issue 56). The bug: under a tokenizer whose call markers are special tokens
(Qwen's `<tool_call>`), a guided answer that copied a tool error naming `<tool_call>` was forced as that special
token, which the grammar refused: a GuideError ended the turn and the CLI exited 1."""

from __future__ import annotations

import pytest

from app.decoding.guide import literal
from app.decoding.guide_matcher import GuideError, GuideVocab
from app.engine.engine import Engine
from app.protocols.base import encode
from app.protocols import make_protocol
from app.settings import Settings
from app.tools.registry import default_tools
from tests.conftest import CALL_MARKERS, writing

UNTAGGED = '{"name": "calculator", "arguments": {"expression": "2 + 2"}}'
TAGGED = '<tool_call>[{"name": "calculator", "arguments": {"expression": "2 + 2"}}]</tool_call>'
PROMPT = "You answer questions, with tools where they help."


@pytest.fixture(scope="module")
def marker_vocab(marker_tokenizer) -> GuideVocab:
    return GuideVocab(marker_tokenizer, {marker_tokenizer.eos_token_id})


def forced_run(vocab: GuideVocab, grammar: str) -> list[int]:
    """Every token the grammar forces from its start, consumed as the backend does."""
    matcher, out = vocab.matcher(grammar), []
    while forced := matcher.forced():
        matcher.consume(forced)
        out += forced
    return out


def test_forced_text_holding_a_special_token_s_text_is_forced_as_text(marker_tokenizer, marker_vocab):
    """The regression at the guide: llguidance's own tokenization of the forced text gives the special token."""
    owed = "Result = error: a tool call goes between <tool_call> and </tool_call>: write it so"
    forced = forced_run(marker_vocab, f"root ::= {literal(owed)} [a-z]*\n")
    specials = {marker_tokenizer.convert_tokens_to_ids(m) for m in CALL_MARKERS}
    assert forced and not specials & set(forced)
    assert owed.startswith(marker_tokenizer.decode(forced)) and "</tool_call>" in marker_tokenizer.decode(forced)
    assert forced == encode(marker_tokenizer, marker_tokenizer.decode(forced))  # (untrusted text's tokenization)


@pytest.mark.parametrize("guide", [True, False], ids=["guided", "unguided"])
def test_an_untagged_call_then_the_answer_under_special_call_markers_fails_no_turn(tiny_markers, marker_tokenizer,
                                                                                   guide):
    """The regression end to end, as the bug report's model wrote it: a call's JSON without its tags, then EOS."""
    model = writing(tiny_markers, UNTAGGED + "<|im_end|>", "Result = 4<|im_end|>", marker="<|im_start|>tool",
                    specials=True)
    engine = Engine(model, prompt=PROMPT, protocol="chat")
    episode = engine.ask(engine.new_session(), "What is two plus two?", Settings(guide=guide, max_new_tokens=40))
    assert episode.error is None and episode.segments[-1].stop is not None
    specials = {marker_tokenizer.convert_tokens_to_ids(m) for m in CALL_MARKERS}
    model_ids = [i for s in episode.model_segments for i in episode.token_ids[s.start - episode.query_start:
                                                                               s.end - episode.query_start]]
    assert not specials & set(model_ids)  # the model wrote no marker token, and nothing forced one
    if guide:  # the grammar refuses the untagged call: the reply is a tagged call or an answer
        assert not episode.segments[0].text.lstrip().startswith(("{", "["))
    else:  # the model reads the error, its markers in look-alikes, and the turn goes on
        error = episode.segments[1]
        assert error.kind == "tool" and not error.ok and "‹tool_call›" in error.result
        assert "<tool_call>" not in error.result and episode.answer == "Result = 4"


def test_a_tool_error_naming_the_markers_is_read_in_look_alikes(tiny_llama):
    """The bundled tokenizer too: the error would teach the model to write the markers in its answer."""
    model = writing(tiny_llama, UNTAGGED + "<|im_end|>", "Sorry.<|im_end|>", marker="<|im_start|>tool",
                    specials=True)
    engine = Engine(model, prompt=PROMPT, protocol="chat")
    episode = engine.ask(engine.new_session(), "What is 2 + 2?", Settings(guide=False, max_new_tokens=40))
    error = episode.segments[1].result
    assert error.startswith("error: a tool call goes between ‹tool_call› and ‹/tool_call›: write ‹tool_call›[")
    assert "<" not in error.replace(" < ", "")


@pytest.mark.parametrize("protocol", ["chat", "textenv"])
@pytest.mark.parametrize("reply", [UNTAGGED, f"[{UNTAGGED}]", f" {UNTAGGED}", "<Calculator>2 + 2<call>"])
def test_with_the_guide_on_a_call_outside_its_tags_cannot_be_written(tokenizer, protocol, reply):
    vocab = GuideVocab(tokenizer, {tokenizer.eos_token_id})
    tools = default_tools()
    guide = make_protocol(protocol, tokenizer, tokenizer.all_special_tokens).guide(tools, None, None, calls=True)
    with pytest.raises(GuideError):
        vocab.matcher(guide.grammar).consume(encode(tokenizer, reply))
    tagged = TAGGED if protocol == "chat" else "<request><Calculator>2 + 2<call>"
    vocab.matcher(guide.grammar).consume(encode(tokenizer, tagged))  # (the call in its tags: taken)


def test_a_model_whose_call_markers_are_special_tokens_calls_a_tool(tiny_markers, marker_tokenizer):
    """The model writes `<tool_call>` as its one special token (guide off): the segment's text shows the markers, the
    call stops at the closing one and runs."""
    model = writing(tiny_markers, TAGGED, "Result = 4<|im_end|>", marker="<|im_start|>tool", specials=True)
    engine = Engine(model, prompt=PROMPT, protocol="chat")
    episode = engine.ask(engine.new_session(), "What is 2 + 2?", Settings(guide=False, max_new_tokens=48))
    call, tool, answer = episode.segments
    assert call.text == TAGGED and call.stop.string == "</tool_call>"
    ids = episode.token_ids[call.start - episode.query_start: call.end - episode.query_start]
    assert marker_tokenizer.convert_tokens_to_ids("<tool_call>") in ids  # (the model's own marker token)
    assert tool.tool == "Calculator" and tool.result == "4" and answer.text == "Result = 4"
