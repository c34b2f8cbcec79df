"""Every way a segment stops, recorded by the code that stopped it (forced tokens on a tiny random llama)."""

from __future__ import annotations

import threading

import torch

import pytest

from app.backends.local import LocalBackend
from app.decoding.stops import Holdback, Limit, StopReason, tokens_before
from app.engine.engine import Engine
from app.episode import EpisodeFinished, TextDelta
from app.protocols.base import encode
from app.settings import InputError, Settings
from tests.conftest import ForcedModel, forced, plan_text, prime, writing

PROMPT = "Answer with tools.\n{tools}\n\n"


def run(loaded, question="What is two plus three?", **settings):
    """One turn on forced tokens; the guide off unless asked for (these tests are about the stops themselves)."""
    engine = Engine(loaded, prompt=PROMPT)
    session = prime(engine)
    episode = engine.ask(session, question, Settings(**{"guide": False, **settings}))
    if session.cache.cached == len(session.cache):  # every kept token was fed (a cut stop string dropped the rest)
        session.cache.truncate(len(session.cache) - 1)  # (as the next forward pass does) to check the rest
        session.cache.extend(episode.token_ids[-1:])
    session.cache.check()
    return engine, session, episode


def test_string_at_segment_end(tiny_llama, tokenizer):
    call = "<request><Calculator>2+3<call>"
    model = forced(tiny_llama, plan_text(tokenizer, (0, call), (len(encode(tokenizer, call)), "\nResult = 5<submit>")))
    _, session, episode = run(model, max_new_tokens=40)
    first, tool, last = episode.segments
    assert (first.stop.reason, first.stop.string) == (StopReason.STRING_MATCH, "<call>")
    assert first.text == "<request><Calculator>2+3<call>"
    assert first.generated_tokens == len(encode(tokenizer, "<request><Calculator>2+3<call>"))
    assert (tool.kind, tool.tool, tool.query, tool.text) == ("tool", "Calculator", "2+3", "5<response>")
    assert (last.stop.reason, last.stop.string) == (StopReason.STRING_MATCH, "<submit>")
    assert episode.answer == "Result = 5"


def test_string_ending_inside_a_token_keeps_that_token_and_nothing_after(tiny_llama, tokenizer):
    # "><" is one token: "<call" + "><" completes "<call>" inside it, one character before the token ends.
    inside = tokenizer.convert_tokens_to_ids("><")
    plan = plan_text(tokenizer, (0, "<request><Calculator>2+3<call"))
    step = len(plan)
    plan[step] = inside
    plan.update(plan_text(tokenizer, (step + 1, "junk after the stop")))
    _, session, episode = run(forced(tiny_llama, plan), max_new_tokens=60, max_turns=0)
    segment = episode.segments[0]
    assert segment.stop.string == "<call>"
    assert segment.generated_tokens == step + 1
    assert session.cache.ids[segment.end - 1] == inside
    assert segment.text.endswith("<call><")
    assert "junk" not in segment.text


@pytest.mark.parametrize("draft_tokens", [0, 8])
def test_next_question_ends_the_answer_and_is_not_kept(tiny_llama, tokenizer, draft_tokens):
    # Regression: the model finished its answer, then wrote the few-shot format's next example
    # ("\n\nQ: What is a kludge?\n<request><Search>kludge<call>") and went on calling tools until max_turns.
    answer = "5"
    plan = plan_text(tokenizer, (0, answer + "\n\nQ: What is a kludge?\n<request><Search>kludge<call>"))
    engine, session, episode = run(forced(tiny_llama, plan), max_new_tokens=60, draft_tokens=draft_tokens)
    (segment,) = episode.segments
    assert (segment.stop.reason, segment.stop.string, segment.stop.label) == (
        StopReason.STRING_MATCH, "\nQ:", "string match \\nQ:")
    assert segment.text == answer == episode.answer
    assert session.cache.ids[segment.start:segment.end] == encode(tokenizer, answer)  # no "\n\nQ:" in the ids
    assert segment.end == len(session.cache) and segment.generated_tokens > segment.end - segment.start
    assert episode.to_json()["segments"][0]["stop_string"] == "\nQ:"
    nxt = engine.ask(session, "And 1+1?", Settings(guide=False, max_new_tokens=3))  # the session goes on from the answer
    assert nxt.segments[0].cached_tokens + nxt.segments[0].prefill_tokens == nxt.segments[0].start


def test_a_request_closed_with_response_runs_the_tool_and_keeps_no_response_the_model_wrote(tiny_llama, tokenizer):
    # Regression: "<request><Calculator>123 + 456 + 789<response>\nResult = 100<submit>": the model wrote the
    # tools' marker where <call> belongs, no tool ran, and it went on to invent the tool's output.
    written = "<request><Calculator>2+3<response>"
    n = len(encode(tokenizer, written))
    plan = plan_text(tokenizer, (0, written + "\nResult = 100<submit>"), (n, "\nResult = 5<submit>"))
    _, session, episode = run(forced(tiny_llama, plan), max_new_tokens=40)
    first, tool, last = episode.segments
    assert (first.stop.reason, first.stop.string, first.stop.label) == (
        StopReason.STRING_MATCH, "<response>", "string match <response>")
    assert first.text == "<request><Calculator>2+3" and first.generated_tokens == n
    assert session.cache.ids[first.start:first.end] == encode(tokenizer, "<request><Calculator>2+3")
    # the engine closes the request in the inserted text: the transcript reads as a well-formed call
    assert (tool.kind, tool.tool, tool.query, tool.ok, tool.text) == ("tool", "Calculator", "2+3", True, "<call>5<response>")
    assert (last.stop.string, episode.answer) == ("<submit>", "Result = 5")
    mask = episode.mask
    generated = [t for t, m in zip(episode.token_ids, mask) if m]
    assert "<call>" not in tokenizer.decode(generated) and "<response>" not in tokenizer.decode(generated)


# (a request broken by a newline, "<request><Calculator>2+3\nIt is 5<response>", cannot be written in process any
# more: a call's input is one line, test_a_calls_input_is_one_line_and_ends_where_it_would_end_or_repeat)
@pytest.mark.parametrize("text", ["The sum is 5<response>", "The sum is 5\nIt is 5<response>"])
def test_response_written_outside_a_request_ends_the_answer_and_is_not_kept(tiny_llama, tokenizer, text):
    _, session, episode = run(forced(tiny_llama, plan_text(tokenizer, (0, text + " more"))), max_new_tokens=40)
    (segment,) = episode.segments
    assert (segment.stop.reason, segment.stop.string) == (StopReason.STRING_MATCH, "<response>")
    assert segment.text == episode.answer == text[: -len("<response>")]
    assert "<response>" not in tokenizer.decode(session.cache.ids[segment.start:])


def test_next_question_streams_no_text_that_is_dropped(tiny_llama, tokenizer):
    plan = plan_text(tokenizer, (0, "It is 5\nQ: next"))
    engine = Engine(forced(tiny_llama, plan), prompt=PROMPT)
    session = prime(engine)
    streamed = "".join(e.text for e in engine.turn(session, "What is two plus three?", Settings(guide=False, max_new_tokens=30))
                       if isinstance(e, TextDelta))
    assert streamed.rstrip() == "It is 5"



def test_a_line_that_is_no_answer_still_ends_in_a_newline(tiny_llama, tokenizer):
    plan = plan_text(tokenizer, (0, "Results vary\nQ: next"))
    _, _, episode = run(forced(tiny_llama, plan), max_new_tokens=30)
    assert (episode.stop.string, episode.answer) == ("\nQ:", "Results vary")


@pytest.mark.parametrize("ends, at, keep", [
    ([5, 6, 9], 5, 1),  # the cut starts where token 0 ends: tokens 1 and 2 go
    ([5, 7, 9], 6, 2),  # token 1 holds answer text and the cut's first character: it stays whole
    ([5, 7, 9], 0, 0),
    ([5, 5, 9], 5, 2),  # a token whose text was held back (an incomplete character) ends where its neighbour does
    ([5, 7, 9], 9, 3),
])
def test_tokens_before_a_cut_keep_every_character_before_it(ends, at, keep):
    assert tokens_before(ends, at) == keep


def test_holdback_withholds_what_may_start_a_cut_string():
    stream = Holdback(frozenset({"\nQ:"}))
    assert [stream.push(d) for d in ["Result = 5", "\n", "\n", "Q", ":"]] == ["Result = 5", "", "\n", "", ""]
    assert stream.close(end=10) == ""  # the kept text ends at "5": nothing of the cut was shown
    other = Holdback(frozenset({"\nQ:"}))
    assert other.push("a\n") == "a" and other.push("b") == "\nb" and other.push("\n") == ""
    assert other.close() == "\n"  # another stop: everything is shown


def test_a_loop_stops_as_repetition_instead_of_running_to_max_length(tiny_llama, tokenizer):
    # Regression (measured by benchmarks/answer_quality.py): "Result = tweak: A value; esp. one that is changed;
    # esp. one that is changed; ..." until max_new_tokens.
    loop = "esp. one that is changed; "
    plan = plan_text(tokenizer, (0, "Result = tweak: A value; " + loop * 6))
    _, session, episode = run(forced(tiny_llama, plan), max_new_tokens=60)
    (segment,) = episode.segments
    assert (segment.stop.reason, segment.stop.label) == (StopReason.REPETITION, "repetition")
    assert segment.text.count("esp. one that is changed") == 3 and segment.generated_tokens < 60
    assert episode.to_json()["segments"][0]["stop_reason"] == "repetition"


@pytest.mark.parametrize("text", ["Result = 1000000000000000000000", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13"])
def test_long_answers_that_are_no_loop_go_on(tiny_llama, tokenizer, text):
    plan = plan_text(tokenizer, (0, text + "<submit>"))
    _, _, episode = run(forced(tiny_llama, plan), max_new_tokens=60)
    assert episode.stop.string == "<submit>"


def test_eos(tiny_llama, tokenizer):
    plan = plan_text(tokenizer, (0, "Hello there"))
    plan[len(plan)] = 2
    _, _, episode = run(forced(tiny_llama, plan))
    (segment,) = episode.segments
    assert segment.stop.reason is StopReason.EOS
    assert (segment.stop.string, segment.stop.limit) == (None, None)
    assert episode.answer == "Hello there"


def test_eos_and_stop_string_on_the_same_token_is_a_string_match(tiny_llama, tokenizer):
    gt = tokenizer.convert_tokens_to_ids(">")
    plan = plan_text(tokenizer, (0, "1+1<call>"))  # its only ">" completes "<call>"
    model = forced(tiny_llama, plan, eos_ids=frozenset({2, gt}))  # ">" is also an EOS token
    _, _, episode = run(model, max_turns=0)
    first = episode.segments[0]
    assert first.stop.reason is StopReason.STRING_MATCH and first.stop.string == "<call>"


def test_eos_token_that_completes_no_string_is_eos(tiny_llama, tokenizer):
    gt = tokenizer.convert_tokens_to_ids(">")
    plan = plan_text(tokenizer, (0, "a <b>"))
    assert plan[len(plan) - 1] == gt
    _, _, episode = run(forced(tiny_llama, plan, eos_ids=frozenset({2, gt})))
    assert episode.segments[0].stop.reason is StopReason.EOS


def test_max_new_tokens(tiny_llama):
    _, _, episode = run(forced(tiny_llama, {i: 1000 + i for i in range(20)}), max_new_tokens=5)
    (segment,) = episode.segments
    assert (segment.stop.reason, segment.stop.limit) == (StopReason.MAX_LENGTH, Limit.MAX_NEW_TOKENS)
    assert segment.generated_tokens == 5


def test_max_length_batch_size_1(tiny_llama):
    model = forced(tiny_llama, {i: 1000 + i for i in range(50)})
    engine = Engine(model, prompt=PROMPT)
    session = prime(engine)
    budget = len(session.cache) + 12 + 3
    episode = engine.ask(session, "What is two plus three?", Settings(guide=False, max_new_tokens=50, max_length=budget))
    (segment,) = episode.segments
    assert (segment.stop.reason, segment.stop.limit) == (StopReason.MAX_LENGTH, Limit.MAX_LENGTH)
    assert len(session.cache) == budget == episode.total_tokens


def test_max_length_in_a_batch_never_exceeded(tiny_llama, tokenizer):
    plan = plan_text(tokenizer, (0, "<request><Calculator>2+3<call>"))
    engine = Engine(forced(tiny_llama, plan), prompt=PROMPT)
    prompt_len = len(prime(engine).cache)
    budget = prompt_len + 20
    episodes = engine.run(["What is two plus three?", "What is four plus four?", "Hi"],
                          Settings(guide=False, max_new_tokens=50, max_length=budget))
    assert len(episodes) == 3
    for episode in episodes:
        assert episode.total_tokens <= budget
        assert episode.stop.reason is StopReason.MAX_LENGTH and episode.stop.limit is Limit.MAX_LENGTH


def test_tool_output_filling_the_budget_leaves_a_max_length_segment(tiny_llama, tokenizer):
    plan = plan_text(tokenizer, (0, "<request><Calculator>2**200<call>"))
    engine = Engine(forced(tiny_llama, plan), prompt=PROMPT)
    session = prime(engine)
    query = len(encode(tokenizer, "Q: big?\n"))
    budget = len(session.cache) + query + len(encode(tokenizer, "<request><Calculator>2**200<call>")) + 4
    episode = engine.ask(session, "big?", Settings(guide=False, max_length=budget, max_new_tokens=60))
    model_segments = episode.model_segments
    assert [s.kind for s in episode.segments] == ["model", "tool", "model"]
    assert model_segments[-1].stop.limit is Limit.MAX_LENGTH and model_segments[-1].generated_tokens == 0
    assert len(session.cache) == budget


def test_prompt_alone_over_max_length_is_a_clear_error(tiny_llama):
    engine = Engine(tiny_llama, prompt=PROMPT)
    session = engine.new_session()
    with pytest.raises(InputError, match="context is full"):
        engine.ask(session, "What is two plus three?", Settings(max_length=len(session.cache) + 2))
    assert session.episodes == [] and len(session.cache) == session.prompt_tokens  # nothing half-added


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(max_length=0), dict(max_turns=-1),
                                 dict(temperature=-1), dict(top_p=0), dict(max_length=10**9)])
def test_bad_settings_are_clear_errors(tiny_llama, bad):
    engine = Engine(tiny_llama, prompt=PROMPT)
    with pytest.raises(InputError, match="must be"):
        engine.ask(engine.new_session(), "hi", Settings(**bad))


@pytest.mark.parametrize("question", ["", "   ", "x" * 5000, "caf\udce9?", "\ud800"])
def test_bad_questions_are_clear_errors(tiny_llama, question):
    """Lone surrogates (undecodable terminal bytes, a JSON "\\ud800") used to reach the tokenizer: TypeError."""
    engine = Engine(tiny_llama, prompt=PROMPT)
    with pytest.raises(InputError, match="empty|too long|not valid UTF-8"):
        engine.ask(engine.new_session(), question)


class Gated(ForcedModel):
    """A ForcedModel whose forward pass for plan step `hold` (and later) waits for `release`: the scheduler's
    thread cannot run ahead of the reader by more than the passes before it, whatever the machine's load."""

    def __init__(self, base, plan, hold: int, release: threading.Event):
        super().__init__(base, plan)
        self.hold, self.release = hold, release
        self.gating = False  # off while the session's prompt is prefilled

    def forward(self, input_ids, **kwargs):
        if self.gating and self.step >= self.hold:
            self.release.wait()
        return super().forward(input_ids, **kwargs)


def test_cancel_stops_between_tokens_and_keeps_the_session_consistent(tiny_llama):
    """Stop ends the segment before the row's next pass: one may be under way already (a row's per-token work runs
    in the scheduler's thread right after each pass), and its token is then kept and streamed; either way the
    segment holds exactly the tokens whose text was streamed. The model's pass for token 4 waits for the Stop, so
    the scheduler cannot have run further ahead when it comes (no timing: the passes themselves are held)."""
    import dataclasses

    plan = {i: 1000 + i for i in range(100)}
    cancel = threading.Event()
    model = Gated(tiny_llama.model, plan, hold=3, release=cancel)
    engine = Engine(LocalBackend(dataclasses.replace(tiny_llama.loaded, model=model)), prompt=PROMPT)
    session = prime(engine)
    model.gating = True
    deltas, streamed = 0, ""
    for event in engine.turn(session, "count", Settings(guide=False, max_new_tokens=100), cancel=cancel):
        if isinstance(event, TextDelta):
            deltas += 1
            streamed += event.text
            if deltas == 3:
                assert not cancel.is_set()
                cancel.set()
        if isinstance(event, EpisodeFinished):
            episode = event.episode
    (segment,) = episode.segments
    n = segment.generated_tokens
    assert segment.stop.reason is StopReason.CANCELLED and n in (3, 4)  # the pass held at Stop may be kept
    # exactly the tokens streamed: the planned ones, in the segment's ids, and their text is what the reader got
    assert session.cache.ids[segment.start:segment.end] == [plan[i] for i in range(n)]
    assert segment.end - segment.start == n
    assert segment.text == streamed == tiny_llama.tokenizer.decode([plan[i] for i in range(n)])
    session.cache.check()
    # The session goes on: the next turn prefills only its new tokens.
    model.gating = False
    nxt = engine.ask(session, "again", Settings(guide=False, max_new_tokens=2))
    assert nxt.segments[0].cached_tokens == len(session.cache) - nxt.segments[0].generated_tokens - nxt.segments[0].prefill_tokens


def test_closing_the_stream_records_the_partial_segment(tiny_llama):
    engine = Engine(forced(tiny_llama, {i: 1000 + i for i in range(100)}), prompt=PROMPT)
    session = prime(engine)
    stream = engine.turn(session, "count", Settings(guide=False, max_new_tokens=100))
    for _ in range(6):
        next(stream)
    stream.close()  # what a web framework does when the browser goes away
    (episode,) = session.episodes
    assert episode.finished and episode.segments[0].stop.reason is StopReason.CANCELLED
    assert episode.segments[0].end == len(session.cache)
    session.cache.check()


@pytest.mark.parametrize("prompt, message", [("", "system prompt is empty"), ("word " * 5000, "model reads at most"),
                                             ("Hi \ud800 {tools}", "system prompt is not valid UTF-8")])
def test_unusable_system_prompts_are_clear_errors(tiny_llama, prompt, message):
    engine = Engine(tiny_llama)
    with pytest.raises(InputError, match=message):
        engine.new_session(prompt=prompt)


class Exploding(torch.nn.Module):
    """Runs the real model, but raises on the chosen forward pass (after the cache layers were updated)."""

    def __init__(self, base, fail_at: int):
        super().__init__()
        self.base, self.config, self.fail_at, self.calls = base, base.config, fail_at, 0

    @property
    def dtype(self):
        return self.base.dtype

    def forward(self, **kwargs):
        out = self.base(**kwargs)
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("out of memory (simulated)")
        return out


def test_a_model_error_mid_segment_is_recorded_and_the_session_goes_on(tiny_llama):
    import dataclasses

    model = Exploding(tiny_llama.model, fail_at=10**9)
    engine = Engine(LocalBackend(dataclasses.replace(tiny_llama.loaded, model=model)), prompt=PROMPT)
    session = engine.new_session()
    before = len(session.cache)
    model.fail_at = model.calls + 4  # the 4th step of the next turn fails, after its layers took the new positions
    with pytest.raises(RuntimeError, match="simulated"):
        engine.ask(session, "hello", Settings(guide=False, max_new_tokens=10, draft_tokens=4))
    (episode,) = session.episodes
    segment = episode.segments[-1]
    assert segment.stop.reason is StopReason.ERROR and segment.stop.label == "error"
    assert segment.end == len(session.cache) == before + (episode.query_end - episode.query_start) + 3
    session.cache.check()  # the cache was dropped, not left half-updated
    nxt = engine.ask(session, "again", Settings(guide=False, max_new_tokens=3))  # recomputes the dropped cache, then goes on
    first = nxt.segments[0]  # (the system prompt's part is copied from the shared prefilled prompt)
    assert first.generated_tokens == 3 and first.cached_tokens == session.prompt_tokens
    assert first.prefill_tokens == first.start - session.prompt_tokens


def test_a_batch_row_whose_model_fails_is_logged_shown_and_not_scored(tiny_llama, caplog):
    """Regression (review): a failing row's error was kept as text on its episode only: nothing logged, the Batch
    tab showed an empty answer and scored it as a wrong one."""
    import dataclasses

    from components.batch import BatchRun, Item, accuracy, batch_frame, batch_summary, rewards

    model = Exploding(tiny_llama.model, fail_at=10**9)
    engine = Engine(LocalBackend(dataclasses.replace(tiny_llama.loaded, model=model)), prompt=PROMPT)
    engine.new_session()  # (the prompt prefilled before the model fails)
    model.fail_at = model.calls + 2
    with caplog.at_level("ERROR", logger="app.engine.rows"):
        (episode,) = engine.run(["What is 2 + 2?"], Settings(guide=False, max_new_tokens=6))
    assert episode.error == "out of memory (simulated)"
    assert any("row 0 failed" in r.message and r.exc_info for r in caplog.records)
    items = [Item("What is 2 + 2?", "4")]
    assert rewards([episode], items) == [None] and accuracy([None]) is None
    assert "error: out of memory (simulated)" in batch_frame([episode], items).loc[0, "answer"]
    assert "accuracy: n/a (1 failed, not scored)" in batch_summary(items, BatchRun([episode], 1.0, True))


def test_settings_reject_a_seed_torch_cannot_take(tiny_llama):
    engine = Engine(tiny_llama, prompt=PROMPT)
    with pytest.raises(InputError, match="seed"):
        engine.ask(engine.new_session(), "hi", Settings(seed=2**64))


def test_a_message_that_is_not_text_is_a_clear_error(tiny_llama):
    engine = Engine(tiny_llama, prompt=PROMPT)
    with pytest.raises(InputError, match="text"):
        engine.ask(engine.new_session(), None)



@pytest.mark.parametrize("draft_tokens", [0, 8])
def test_after_a_tool_the_model_answers_instead_of_writing_the_next_question(tiny_llama, tokenizer, draft_tokens):
    """Regression (answer_quality.py): after a search's output the model wrote "\\nQ:" at once, and the turn ended
    with no answer ("(no text)" on the page). Now the line after a tool's output opens the answer or another
    call; the tiny model, kept from "Q", writes one of the two openings."""
    import re

    call = "<request><Calculator>2+3<call>"
    _, _, episode = run(writing(tiny_llama, call, "\nQ: next one"), max_new_tokens=12, max_turns=1,
                        draft_tokens=draft_tokens, guide=True)
    after = episode.segments[2]
    assert after.stop is None or after.stop.string != "\nQ:", after
    assert re.match(r"\n?(Result =|<request>)", after.text), after.text


@pytest.mark.parametrize("draft_tokens", [0, 8])
@pytest.mark.parametrize("written", ["Q: What is a calculator?", "\nQ: next", "Q:"])
def test_right_after_the_question_the_reply_does_not_ask_the_next_one(tiny_llama, tokenizer, written, draft_tokens):
    """Regression: asked "meaning of cruft", the model wrote "Q: What is the difference between a calculator and a
    calculator?" (the "\nQ:" stop cannot see that one: the newline is the question's), then a search for luser,
    and answered with its definition. The tiny model, kept from "Q", writes something else."""
    plan = plan_text(tokenizer, (0, written))
    _, _, episode = run(forced(tiny_llama, plan), max_new_tokens=6, max_turns=0, draft_tokens=draft_tokens,
                         guide=True)
    first = episode.segments[0]
    assert not first.text.lstrip("\n").startswith("Q") and first.stop.string != "\nQ:", first


def test_a_later_line_may_still_be_the_next_question(tiny_llama, tokenizer):
    plan = plan_text(tokenizer, (0, "Quite so\nQ: next"))  # (a reply may begin with a Q that is not "Q:")
    _, _, episode = run(forced(tiny_llama, plan), max_new_tokens=12)
    assert (episode.stop.string, episode.answer) == ("\nQ:", "Quite so")



def _kept(grammar, line, vocabulary: int) -> list[str]:
    """The texts of the tokens the grammar's mask keeps after `line`, over flat logits."""
    out = grammar.mask(torch.zeros(vocabulary), line)
    return [grammar.text(i) for i in (out > float("-inf")).nonzero().flatten().tolist()]


