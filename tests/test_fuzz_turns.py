"""A fuzz of model output (issue 56): scripted replies that mix markers, special tokens, half calls, untagged JSON,
lists of calls, unknown tools, invalid arguments and EOS anywhere, with tool outputs that echo markers, over both
protocols, the guide on and off, the cache on and off, the in-process and the llama.cpp backends' code paths (a
scripted llama.cpp, tests.support.scripted_server) and two tokenizers: the bundled one, and one whose call markers
are special tokens as Qwen's are. Property: every turn ends with a recorded stop reason on every segment, or with a
clear error on that turn alone (an InputError before it runs); never an exception, a GuideError or a traceback, and
the session goes on. Seeded (derandomize): CI runs the same cases every time; the run's summary counts them."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as fuzz_settings
from hypothesis import strategies as st

from app.backends.server import LlamaCpp, ServerBackend
from app.backends.server_client import ModelServer
from app.decoding.guide_matcher import GuideVocab
from app.engine.engine import Engine
from app.episode import Provenance
from app.settings import InputError, Settings
from app.tools.registry import default_tools
from tests.conftest import writing
from tests.support.scripted_server import Script, scripted_llama_cpp

CASES_PER_BACKEND = 60  # scripts for each of 4 backends (2 tokenizers, in process and llama.cpp), 4 turns each
PROMPT = "You answer questions, with tools where they help."
MARKER = {"chat": "<|im_start|>tool", "textenv": "<response>"}  # what follows a tool's output (the script's turn)

CALLS = [  # calls well-formed and not, in both protocols' formats (each protocol reads the other's as text)
    '<tool_call>[{"name": "calculator", "arguments": {"expression": "2 + 2"}}]</tool_call>',
    '<tool_call>\n{"name": "search", "arguments": {"term": "grok"}}\n</tool_call>',
    '<tool_call>[{"name": "calculator", "arguments": {"expression": "1 / 0"}}, {"name": "search", "arguments": '
    '{"term": "<tool_call>"}}]</tool_call>',
    '<tool_call>[{"name": "joke", "arguments": {}}]</tool_call>',
    '<tool_call>[{"name": "calculator", "arguments": {"expression": 7}}]</tool_call>',
    '<tool_call>[{"name": "calculator", "arguments": "{\\"expression\\": \\"3 * 3\\"}"}]</tool_call>',
    '<tool_call>[{"name": "calcul',
    "<request><Calculator>2 + 2<call>",
    "<request><Search>grok<call>",
    "<request><Joke>now<call>",
    "<request><Calculator>2 + 2<response>",
    "<request>oops<call>",
]
UNTAGGED = [  # a call's JSON without its tags, as tool-tuned models write it
    '{"name": "calculator", "arguments": {"expression": "2 + 2"}}',
    '{"name": "search", "arguments": {"term": "kludge"}}',
    '[{"name": "search", "arguments": {"term": "grok"}}]',
    ' {"name": "calculator", "arguments": "41 * 23"}',
    '{"name": "joke"}',
    '{"name": "calculator", "arguments": {"expression": "2 + ',
]
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "<request>", "<call>", "<response>", "<submit>",
           "\nQ:", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEXT = ["Result = 4", "Result = ", "4", "Hello", " ", "\n", "é", "日本", "{", "}", "[", "]", '"', "\\", "< 3", "<=",
        "<Calculator>", "Q: what?"]
ENDS = ["<|im_end|>", "<|im_end|>", "<|im_end|>", "<submit>", "", " Result = 4<|im_end|>", "\nQ: next"]  # (EOS: often)
# A reply, each form as likely: a call in its tags (either protocol's, well-formed or not), a call's JSON without its
# tags, or an answer, each maybe with more after it and ended as ENDS say; or a soup of every fragment.
more = st.lists(st.sampled_from(CALLS + UNTAGGED + MARKERS + TEXT), max_size=2).map("".join)


def ended(heads: list[str]):
    return st.tuples(st.sampled_from(heads), st.just("") | more, st.sampled_from(ENDS)).map("".join)


reply = st.one_of(ended(CALLS), ended(UNTAGGED), ended(TEXT),
                  st.lists(st.sampled_from(CALLS + UNTAGGED + MARKERS + TEXT + ENDS), min_size=1,
                           max_size=5).map("".join))
pieces = st.lists(reply, min_size=1, max_size=3).map(tuple)  # the replies after the question and each tool output
# (the guide writes the call of a sum or a headword itself: the other questions leave the reply to the script)
QUESTIONS = ["What is 2 + 2?", "What does grok mean?", "Hello!", "Tell me about yourself.", "Is it raining?",
             "Say <tool_call> </tool_call> <call> <|im_end|>"]


def echoing_tools() -> dict:
    """The default tools, the Calculator's output echoing every marker after its result."""
    tools = default_tools()
    calculator = tools["Calculator"]
    echo = "<tool_call>[{}]</tool_call> <|im_end|><|im_start|>system <request><Calculator>1<call> <submit> <response>"
    tools["Calculator"] = dataclasses.replace(calculator, function=lambda query: calculator.function(query) + echo)
    return tools


@pytest.fixture(scope="module")
def counted(request):
    """This module's turns by how they ended, for the run's summary line (tests.conftest)."""
    from tests.conftest import FUZZ_TURNS

    return request.config.stash.setdefault(FUZZ_TURNS, {})


@pytest.fixture(scope="module", params=["bundled", "special-markers"])
def tiny_model(request, tiny_llama, tiny_markers):
    return tiny_llama if request.param == "bundled" else tiny_markers


@pytest.fixture(scope="module", params=["in-process", "llama.cpp"])
def engines(request, tiny_model):
    """engine(protocol, echo, script): an engine of this backend whose model writes `script`; one engine per
    protocol and tool set, its script set per case."""
    tokenizer, script = tiny_model.tokenizer, Script()
    if request.param == "in-process":
        backend = writing(tiny_model, "", specials=True)
    else:
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        httpd, url = scripted_llama_cpp(tokenizer, GuideVocab(tokenizer, {eos}), eos, script)
        backend = ServerBackend(ModelServer(url, timeout_s=10), LlamaCpp(), tokenizer, 4096)
    built: dict[tuple[str, bool], Engine] = {}

    def engine(protocol: str, echo: bool, pieces: tuple[str, ...]) -> Engine:
        script.pieces, script.marker = pieces, MARKER[protocol]
        if request.param == "in-process":
            backend.model.pieces, backend.model.marker = pieces, MARKER[protocol]
        if (protocol, echo) not in built:
            built[protocol, echo] = Engine(backend, tools=echoing_tools() if echo else None, prompt=PROMPT,
                                           protocol=protocol)
        return built[protocol, echo]

    yield engine
    if request.param == "llama.cpp":
        httpd.shutdown()
        httpd.server_close()


@fuzz_settings(max_examples=CASES_PER_BACKEND, deadline=None, derandomize=True, database=None,
               suppress_health_check=list(HealthCheck))
@example(script=(UNTAGGED[0] + "<|im_end|>", "Result = 4<|im_end|>"), question="Hello!", cache=True, echo=False,
         room=None, drafts=8, max_turns=1, max_new=48)  # (the bug report's turn: generated scripts come close)
@given(script=pieces, question=st.sampled_from(QUESTIONS), cache=st.booleans(), echo=st.booleans(),
       room=st.sampled_from([None, None, None, 40, 96]), drafts=st.sampled_from([0, 8]),
       max_turns=st.sampled_from([1, 1, 2, 0]), max_new=st.sampled_from([32, 48, 64]))
def test_no_model_output_crashes_a_turn(engines, counted, script, question, cache, echo, room, drafts, max_turns,
                                        max_new):
    """Each script runs in both protocols, guided and not."""
    for protocol, guide in [("chat", True), ("chat", False), ("textenv", True), ("textenv", False)]:
        engine = engines(protocol, echo, script)
        session = engine.new_session(use_cache=cache)
        max_length = None if room is None else len(session.cache) + room
        settings = Settings(guide=guide, use_cache=cache, max_new_tokens=max_new, max_turns=max_turns,
                            max_length=max_length, draft_tokens=drafts)
        episode = engine.ask(session, question, settings)
        assert episode.error is None and episode.finished
        for segment in episode.segments:
            assert segment.kind == "tool" or segment.stop is not None, segment
            if segment.kind == "model" and guide and segment.provenance is not None:
                assert len(segment.provenance) == segment.end - segment.start
        assert session.cache.ids[episode.query_start:] == episode.token_ids
        count(counted, episode)
        try:  # the session goes on
            assert engine.ask(session, "Thanks!", dataclasses.replace(settings, max_new_tokens=2)).error is None
        except InputError as error:  # (a clear error: the context is full)
            assert "no room under max_length" in str(error)


def count(counted: dict, episode) -> None:
    last = episode.segments[-1]
    end = last.stop.label if last.stop is not None else "a tool's output"
    counted.setdefault("ends", {})[end] = counted.setdefault("ends", {}).get(end, 0) + 1
    tools = [s for s in episode.segments if s.kind == "tool"]
    counted["tools"] = counted.get("tools", 0) + len(tools)
    counted["errors"] = counted.get("errors", 0) + sum(not s.ok for s in tools)


def test_forced_tokens_are_the_guide_s_and_never_a_special_marker(tiny_markers):
    """(With the special-marker tokenizer, a claimed call and a guided answer after an echoing tool: every forced
    token is text.)"""
    model = writing(tiny_markers, "Result = 4<|im_end|>", marker=MARKER["chat"], specials=True)
    engine = Engine(model, tools=echoing_tools(), prompt=PROMPT, protocol="chat")
    episode = engine.ask(engine.new_session(), "What is 2 + 2?", Settings(guide=True, max_new_tokens=48))
    specials = set(tiny_markers.tokenizer.all_special_ids)
    for segment in episode.model_segments:
        ids = episode.token_ids[segment.start - episode.query_start: segment.end - episode.query_start]
        forced = [t for t, p in zip(ids, segment.provenance) if p is Provenance.FORCED]
        assert forced and not specials & set(forced), segment


SWEPT = ['<tool_call>[{"name": "calculator", "arguments": {"expression": "2 + 2"}}]</tool_call>',
         '{"name": "search", "arguments": {"term": "grok"}}', "<request><Calculator>2 + 2<call>"]


@pytest.mark.parametrize("protocol", ["chat", "textenv"])
def test_eos_at_every_position_of_a_call(tiny_markers, counted, protocol):
    """A call cut by EOS after each of its tokens (guide on and off): every turn ends with a recorded stop."""
    tokenizer = tiny_markers.tokenizer
    backend = writing(tiny_markers, "", marker=MARKER[protocol], specials=True)
    engine = Engine(backend, prompt=PROMPT, protocol=protocol)
    for call in SWEPT:
        ids = tokenizer(call, add_special_tokens=False)["input_ids"]
        for cut in range(1, len(ids) + 1):
            backend.model.pieces = (tokenizer.decode(ids[:cut]) + "<|im_end|>", "Result = 4<|im_end|>")
            for guide in (True, False):
                episode = engine.ask(engine.new_session(), "Is it raining?", Settings(guide=guide, max_new_tokens=40))
                assert episode.error is None and all(s.stop is not None for s in episode.model_segments)
                count(counted, episode)
