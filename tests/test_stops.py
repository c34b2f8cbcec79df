"""Every way a segment stops, recorded by the code that stopped it (forced tokens on a tiny random llama)."""

from __future__ import annotations

import threading

import torch

import pytest

from app.decoding import Holdback, Limit, StopReason, tokens_before
from app.engine import Engine, EpisodeFinished, InputError, Settings, TextDelta
from app.protocol import encode
from tests.conftest import ForcedModel, forced, plan_text, prime

PROMPT = "Answer with tools.\n{tools}\n\n"


def run(loaded, question="What is two plus three?", **settings):
    engine = Engine(loaded, prompt=PROMPT)
    session = prime(engine)
    episode = engine.ask(session, question, Settings(**settings))
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
    answer = "5"  # (not a `Result =` line, which cannot end in a newline: test_the_answer_line_...)
    plan = plan_text(tokenizer, (0, answer + "\n\nQ: What is a kludge?\n<request><Search>kludge<call>"))
    engine, session, episode = run(forced(tiny_llama, plan), max_new_tokens=60, draft_tokens=draft_tokens)
    (segment,) = episode.segments
    assert (segment.stop.reason, segment.stop.string, segment.stop.label) == (
        StopReason.STRING_MATCH, "\nQ:", "string match \\nQ:")
    assert segment.text == answer == episode.answer
    assert session.cache.ids[segment.start:segment.end] == encode(tokenizer, answer)  # no "\n\nQ:" in the ids
    assert segment.end == len(session.cache) and segment.generated_tokens > segment.end - segment.start
    assert episode.to_json()["segments"][0]["stop_string"] == "\nQ:"
    nxt = engine.ask(session, "And 1+1?", Settings(max_new_tokens=3))  # the session goes on from the answer
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
    streamed = "".join(e.text for e in engine.turn(session, "What is two plus three?", Settings(max_new_tokens=30))
                       if isinstance(e, TextDelta))
    assert streamed.rstrip() == "It is 5"


@pytest.mark.parametrize("before", ["", "<request><Calculator>2+3<call>"])
def test_a_newline_on_the_answer_line_ends_it_with_submit(tiny_llama, tokenizer, before):
    # Regression (benchmarks/answer_quality.py): "Result = Goodbye!" then "\nQ: ..." instead of <submit>; then,
    # with the newline masked, "Result = Thanks, I'm glad you helped me. I'm glad you helped me. ..." until the
    # repetition stop. The newline the model writes becomes the `<` of <submit>, which the line then spells
    # (the tiny model's own next tokens are anything but "submit>").
    answer = "Result = 5"
    plan = plan_text(tokenizer, (0, before))
    if before:
        plan.update(plan_text(tokenizer, (len(plan), "\n" + answer)))
    else:
        plan.update(plan_text(tokenizer, (0, answer)))
    plan.update(plan_text(tokenizer, (len(plan), "\nQ: next")))
    engine = Engine(forced(tiny_llama, plan), prompt=PROMPT)
    session = prime(engine)
    episode = engine.ask(session, "What is two plus three?", Settings(max_new_tokens=40))
    last = episode.segments[-1]
    assert (last.stop.reason, last.stop.string) == (StopReason.STRING_MATCH, "<submit>"), last
    assert last.text.lstrip("\n") == answer + "<submit>" and episode.answer == answer
    assert len(episode.segments) == (3 if before else 1)


def choose(loaded, tokenizer, line: str, drafted: list[str], best: str,
           second: str) -> tuple[list[int], list[int], dict[str, int]]:
    """LocalBackend._choose on logits that agree with every draft, then prefer `best`; second best everywhere:
    `second`. Returns (chosen ids, the model's unmasked greedy ids, ids of the texts by name)."""
    from app.answer_line import AnswerLine
    from app.local_backend import LocalBackend

    ids = {text: encode(tokenizer, text)[0] for text in {*drafted, best, second, "<"}}
    drafts = [ids[t] for t in drafted]
    wanted = drafts + [ids[best]]  # the model's greedy choice at each position
    logits = torch.zeros(len(wanted), len(tokenizer))
    for i, token in enumerate(wanted):
        logits[i, token] = 10.0
        logits[i, ids[second]] = 5.0
    from app.decoding import Detokenizer

    state = AnswerLine()
    state.push(line)
    return LocalBackend(loaded)._choose(logits, drafts, Settings(), None, state, Detokenizer(tokenizer)), wanted, ids


@pytest.mark.parametrize("line, drafted, expected", [
    ("Result = 5", [], []),  # one token, no drafts: the newline becomes the `<` of <submit>
    ("Result = 5", ["\n", "Q", ":"], []),  # a draft newline is not accepted, the drafts after it dropped
    ("", ["Result", " =", " ", "5", "\n", "Q"], ["Result", " =", " ", "5"]),  # the line opens inside the drafts
    ("Result =", [], None),  # no answer on the line yet: nothing to end (the newline is masked: "!")
    ("The sum is 5", ["\n", "Q"], None),  # no answer line: the newline stays
])
def test_drafts_never_put_a_newline_on_the_answer_line(tiny_llama, tokenizer, line, drafted, expected):
    chosen, wanted, ids = choose(tiny_llama, tokenizer, line, drafted, best="\n", second="!")
    if line == "Result =":
        assert chosen == [ids["!"]]
    else:
        assert chosen == (wanted if expected is None else [ids[t] for t in expected] + [ids["<"]])


def test_the_answer_line_never_writes_response(tiny_llama, tokenizer):
    """The model's "response" after "Result = 5<" is masked on real forward passes (the tiny model then writes
    whatever it likes best), so the answer is not cut at a `<response>`."""
    _, session, episode = run(forced(tiny_llama, plan_text(tokenizer, (0, "Result = 5<response> more"))),
                              max_new_tokens=12)
    (segment,) = episode.segments
    assert segment.text.startswith("Result = 5<") and segment.stop.string != "<response>"
    assert "<response" not in tokenizer.decode(session.cache.ids[segment.start:])


@pytest.mark.parametrize("line, drafted, expected", [
    ("Result = Hi!<", [], []),  # "<" then "response": masked, the best allowed token is "submit"
    ("Result = Hi!", ["<"], ["<"]),  # a drafted "<" is fine; the model's "response" after it is not
    ("Result = Hi!", ["<", "response", ">"], ["<"]),  # an accepted draft "response" is replaced, ">" dropped
    ("Hi!", ["<"], None),  # no answer line: the tools' marker stays (the stop then ends the segment)
])
def test_on_the_answer_line_a_tag_can_only_be_submit(tiny_llama, tokenizer, line, drafted, expected):
    """Regression (answer_quality.py, int8): "Result = Good morning!<response>" ended the answer without
    <submit>. The model prefers "response" after the drafts; its second best is "submit"."""
    chosen, wanted, ids = choose(tiny_llama, tokenizer, line, drafted, best="response", second="submit")
    assert chosen == (wanted if expected is None else [ids[t] for t in expected] + [ids["submit"]])


@pytest.mark.parametrize("line, expected", [
    ("Result = toaster: Toaster<", "submit"),  # right after the answer's text, a `<` goes on to `<submit>` only
    ("Result = 3 <", "1"),  # after a space it is a sign ("3 < 5"), free
    ("Result = 5<submit", ">"),  # and `<submit` closes with `>`
])
def test_a_lt_glued_to_the_answer_can_only_spell_submit(tiny_llama, tokenizer, line, expected):
    """Regression (answer_quality.py --set wide, with the newline's probability on `<`): "Result = toaster:
    Toaster<1><submit>". The model prefers "1" after the `<`; its second best is "submit" (or ">")."""
    second = ">" if line.endswith("submit") else "submit"
    chosen, _, ids = choose(tiny_llama, tokenizer, line, [], best="1", second=second)
    assert chosen == [ids[expected]]


@pytest.mark.parametrize("line, expected", [
    ("Result = a release (which may take place", ")"),  # the ending's probability goes to `)`, which closes it
    ("Result = a release (which may) take place", "<"),  # closed: the line may end
    ("Result = a (b) (c", ")"),
])
def test_an_answer_does_not_end_inside_an_open_bracket(tiny_llama, tokenizer, line, expected):
    """Regression (answer_quality.py, a test-set look-up): "Result = vaporware: Products announced far in advance
    of any release (which may or may not actually take place<submit>", one `)` short: the model put 0.50 on `<`
    and 0.40 on `)` and `)<`. Here it prefers `<`, then `)`."""
    chosen, _, ids = choose(tiny_llama, tokenizer, line, [], best="<", second=")")
    assert chosen == [encode(tokenizer, expected)[0]]


@pytest.mark.parametrize("pushed, owes", [
    (["Result = a (b"], True), (["Result = a (b", ")"], False), (["Result = (a", "\n", "Result = b"], False),
    (["Result = a) (b"], True), (["Result = ((a)"], True), (["Result = :)"], False),
])
def test_the_answer_line_counts_its_open_brackets(pushed, owes):
    from app.answer_line import AnswerLine

    line = AnswerLine()
    for delta in pushed:
        line.push(delta)
    assert line.owes_bracket is owes
    assert line.copy().owes_bracket is owes


@pytest.mark.parametrize("pushed, can_end, glued", [
    (["Result = 5"], True, False), (["Result ="], False, False), (["Result = "], False, False),
    (["Result = Hi!<"], False, True), (["Result = Hi!<sub"], False, True), (["Result = 3 <"], False, False),
    (["Q: x"], False, False), (["Result = 5\n"], False, False), (["Result = 5", "\nResult = 6"], True, False),
])
def test_where_the_answer_line_can_end(pushed, can_end, glued):
    from app.answer_line import AnswerLine

    line = AnswerLine()
    for delta in pushed:
        line.push(delta)
    assert (line.can_end, line.glued_tag) == (can_end, glued)


@pytest.mark.parametrize("text, breaks", [
    ("Result = 5", False), ("\n", True), ("<", False), ("<sub", False), ("<submit>", False), ("<response>", True),
    ("<r", True), ("< 5", False), ("3 <5", False), ("<submitted", True), ("<s>", True), ("<|im_end|>", False),
    (".<", False), ("a<call>", True),
])
def test_what_breaks_the_answer_line(text, breaks):
    from app.answer_line import breaks_the_line

    assert breaks_the_line(text) is breaks


@pytest.mark.parametrize("pushed, on_answer, open_tag", [
    (["Result = 5"], True, None), (["Result = 5<"], True, ""), (["Result = 5", "<sub"], True, "sub"),
    (["Result = 5<sub", "mit>"], True, None), (["Result = 5\n", "Q:"], False, None), (["Q: x <"], False, ""),
    (["Result = a very long answer that goes on and on", " <sub"], True, "sub"),
])
def test_the_answer_line_knows_its_opening_and_an_open_tag(pushed, on_answer, open_tag):
    from app.answer_line import AnswerLine

    line = AnswerLine()
    for delta in pushed:
        line.push(delta)
    assert (line.on_answer, line.open_tag) == (on_answer, open_tag)


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
    episode = engine.ask(session, "What is two plus three?", Settings(max_new_tokens=50, max_length=budget))
    (segment,) = episode.segments
    assert (segment.stop.reason, segment.stop.limit) == (StopReason.MAX_LENGTH, Limit.MAX_LENGTH)
    assert len(session.cache) == budget == episode.total_tokens


def test_max_length_in_a_batch_never_exceeded(tiny_llama, tokenizer):
    plan = plan_text(tokenizer, (0, "<request><Calculator>2+3<call>"))
    engine = Engine(forced(tiny_llama, plan), prompt=PROMPT)
    prompt_len = len(prime(engine).cache)
    budget = prompt_len + 20
    episodes = engine.run(["What is two plus three?", "What is four plus four?", "Hi"],
                          Settings(max_new_tokens=50, max_length=budget))
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
    episode = engine.ask(session, "big?", Settings(max_length=budget, max_new_tokens=60))
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
    engine = Engine(dataclasses.replace(tiny_llama, model=model, lock=threading.RLock()), prompt=PROMPT)
    session = prime(engine)
    model.gating = True
    deltas, streamed = 0, ""
    for event in engine.turn(session, "count", Settings(max_new_tokens=100), cancel=cancel):
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
    nxt = engine.ask(session, "again", Settings(max_new_tokens=2))
    assert nxt.segments[0].cached_tokens == len(session.cache) - nxt.segments[0].generated_tokens - nxt.segments[0].prefill_tokens


def test_closing_the_stream_records_the_partial_segment(tiny_llama):
    engine = Engine(forced(tiny_llama, {i: 1000 + i for i in range(100)}), prompt=PROMPT)
    session = prime(engine)
    stream = engine.turn(session, "count", Settings(max_new_tokens=100))
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
    engine = Engine(dataclasses.replace(tiny_llama, model=model, lock=threading.RLock()), prompt=PROMPT)
    session = engine.new_session()
    before = len(session.cache)
    model.fail_at = model.calls + 4  # the 4th step of the next turn fails, after its layers took the new positions
    with pytest.raises(RuntimeError, match="simulated"):
        engine.ask(session, "hello", Settings(max_new_tokens=10, draft_tokens=4))
    (episode,) = session.episodes
    segment = episode.segments[-1]
    assert segment.stop.reason is StopReason.ERROR and segment.stop.label == "error"
    assert segment.end == len(session.cache) == before + (episode.query_end - episode.query_start) + 3
    session.cache.check()  # the cache was dropped, not left half-updated
    nxt = engine.ask(session, "again", Settings(max_new_tokens=3))  # recomputes the dropped cache, then goes on
    first = nxt.segments[0]  # (the system prompt's part is copied from the shared prefilled prompt)
    assert first.generated_tokens == 3 and first.cached_tokens == session.prompt_tokens
    assert first.prefill_tokens == first.start - session.prompt_tokens


def test_a_batch_row_whose_model_fails_is_logged_shown_and_not_scored(tiny_llama, caplog):
    """Regression (review): a failing row's error was kept as text on its episode only: nothing logged, the Batch
    tab showed an empty answer and scored it as a wrong one."""
    import dataclasses

    from components.batch import BatchRun, Item, accuracy, batch_frame, batch_summary, rewards

    model = Exploding(tiny_llama.model, fail_at=10**9)
    engine = Engine(dataclasses.replace(tiny_llama, model=model, lock=threading.RLock()), prompt=PROMPT)
    engine.new_session()  # (the prompt prefilled before the model fails)
    model.fail_at = model.calls + 2
    with caplog.at_level("ERROR", logger="app.engine"):
        (episode,) = engine.run(["What is 2 + 2?"], Settings(max_new_tokens=6))
    assert episode.error == "out of memory (simulated)"
    assert any("batch row 0 failed" in r.message and r.exc_info for r in caplog.records)
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


@pytest.mark.parametrize("head, well", [
    ("", True), ("\n", True), ("\nR", True), ("\nResult =", True), ("\nResult = 5", True), ("Result", True),
    ("\n<request><Calculator>2", True), ("\nQ", False), ("\nQ:", False), ("\n\n", False), ("\nResult =\n", False),
    ("\n<submit>", False), ("<|im_end|>", False), ("\nResult = 5<response>", False), (" The", False),
])
def test_what_opens_the_line_after_a_tool(head, well):
    from app.answer_line import opens_well

    assert opens_well(head) is well


def test_the_line_after_a_tool_is_held_until_it_opens():
    from app.answer_line import AnswerLine

    line = AnswerLine(after_tool=True)
    assert line.head == ""
    line.push("\nRes")
    assert line.head == "\nRes" and not line.on_answer
    line.push("ult = 5")
    assert line.head is None and line.on_answer
    call = AnswerLine(after_tool=True)
    call.push("<request><Search>grok")
    assert call.head is None and not call.on_answer
    assert AnswerLine().head is None  # a segment that does not follow a tool: no such rule


@pytest.mark.parametrize("draft_tokens", [0, 8])
def test_after_a_tool_the_model_answers_instead_of_writing_the_next_question(tiny_llama, tokenizer, draft_tokens):
    """Regression (answer_quality.py): after a search's output the model wrote "\\nQ:" at once, and the turn ended
    with no answer ("(no text)" on the page). Now the line after a tool's output opens the answer or another
    call; the tiny model, kept from "Q", writes one of the two openings."""
    import re

    call = "<request><Calculator>2+3<call>"
    plan = plan_text(tokenizer, (0, call), (len(encode(tokenizer, call)), "\nQ: next one"))
    _, _, episode = run(forced(tiny_llama, plan), max_new_tokens=12, max_turns=1, draft_tokens=draft_tokens)
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
    _, _, episode = run(forced(tiny_llama, plan), max_new_tokens=6, max_turns=0, draft_tokens=draft_tokens)
    first = episode.segments[0]
    assert not first.text.lstrip("\n").startswith("Q") and first.stop.string != "\nQ:", first


def test_a_later_line_may_still_be_the_next_question(tiny_llama, tokenizer):
    plan = plan_text(tokenizer, (0, "Quite so\nQ: next"))  # (a reply may begin with a Q that is not "Q:")
    _, _, episode = run(forced(tiny_llama, plan), max_new_tokens=12)
    assert (episode.stop.string, episode.answer) == ("\nQ:", "Quite so")


@pytest.mark.parametrize("start, asks", [("", False), ("Q", True), ("Q:", True), ("\nQ", True), ("Qu", False),
                                         ("\n\nQ", False), ("Result", False), ("<request>", False), (" Q", False)])
def test_what_opens_the_next_question_right_after_a_question(start, asks):
    from app.answer_line import asks_next

    assert asks_next(start) is asks


@pytest.mark.parametrize("text, follows", [
    ("Q: What is it?\n", True), ("Result = 4<submit>\n\nQ: meaning of cruft\n", True),
    ("Q: What is it?\nResult", False), ("Q: What is it?", False), ("A: What is it?\n", False),
    ("<request><Search>grok<call>grok: To understand<response>", False), ("Q: " + "word " * 1300 + "\n", False),
])
def test_which_ids_end_with_the_question(tokenizer, text, follows):
    from app.answer_grammar import AnswerGrammar

    ids = tokenizer("You answer questions.\n\n" + text, add_special_tokens=False)["input_ids"]
    assert AnswerGrammar(tokenizer).follows_a_question(ids) is follows


@pytest.mark.parametrize("written, text, allowed", [
    ("", " -", True), ("", " -24", True), ("", " 24", False), ("", " +", False), ("", " The", False), ("", "<", False),
    ("", " (", False), ("", " (-", False), ("", "  ", False), ("", " –", False),
    (" ", "-", True), (" ", "+24", False), (" -", "2", True), (" -", "3", False), (" -", " apples", False),
    (" -24", "0", False), (" -24", ".5", False), (" -24", "<", True), (" -24", ".", True), (" -24", " apples", True),
    ("", " -24<", True), ("", " -240", False),
    (" -24.", "5", False), (" -24.", " It", True), (" -24,", "000", False), (" -24,", " which", True),
    (" -24e", "5", False), (" -24e-", "5", False),  # (review: sampling wrote 64.2536 after the Calculator's 64)
])
def test_after_the_calculator_the_answer_line_begins_with_its_output(written, text, allowed):
    """Regressions: after the Calculator said -24 the model answered "Result = 24" (the sign dropped); where
    only a number the line began was held to the output, it answered "Result = (-150)" and "Result =  –15"."""
    from app.answer_line import number_allows

    assert number_allows(written, " -24", text) is allowed


@pytest.mark.parametrize("tail, number", [
    ("<request><Calculator>5 - 29<call>-24<response>", "-24"), ("<request><Calculator>0.1+0.2<call>0.3<response>", "0.3"),
    ("<request><Calculator>2**100<call>1.26765060023e30<response>", "1.26765060023e30"),
    ("<request><Calculator>x<call>error: name 'x' is not allowed<response>", None),
    ("<request><Search>2<call>2: infix<response>", None), ("<request><Calculator>1+1<call>2<response>\nResult = 2", None),
    ("<request><Search>3 - 7<call>-4<response>", "-4"),  # (a sum Search passed on to the Calculator)
])
def test_the_grammar_finds_the_calculators_number_at_the_end_of_the_ids(tokenizer, tail, number):
    from app.answer_grammar import AnswerGrammar

    ids = tokenizer("Q: What is it?\n" + tail, add_special_tokens=False)["input_ids"]
    assert AnswerGrammar(tokenizer).calculated(ids) == number


@pytest.mark.parametrize("tail, entry", [
    ("<request><Search>grok<call>grok: To understand<response>", "grok: To understand"),
    ("<request><Search>kludge<call>kludge (see kluge): A Rube Goldberg device<response>",
     "kludge (see kluge): A Rube Goldberg device"),
    ("<request><Search>kernel<call>userland: Anywhere outside the kernel\nneat hack: A clever technique<response>",
     "userland: Anywhere outside the kernel"),  # (several entries: the first, the best)
    ("<request><Calculator>x<call>error: name 'x' is not allowed<response>", "error: name 'x' is not allowed"),
    ("<request><Calculator>10 / 0<call>error: division by zero<response>", "error: division by zero"),  # (any tool's)
    ('<request><Search>xyzzyqq<call>no results for "xyzzyqq"<response>', None),
    ('<request><Search>a: b<call>no results for "a: b"<response>', None),
    ("<request><Nope>x<call>unknown tool Nope (available: Calculator, Search)<response>", None),  # (only Search's)
    ("<request><Search>x<call>error: index: gone<response>", "error: index: gone"),
    ("<request><Calculator>x<call>error: a\nb<response>", None),
    # (a character split over tokens reads as U+FFFD in their texts: the quote stops before it; review)
    ("<request><Calculator>½ + ½<call>error: could not parse '½ + ½' as arithmetic<response>",
     "error: could not parse '½ +"),  # (its second ½ is two tokens here)
    ("<request><Search>TM<call>(TM): Used to indicate ™ appended<response>", "(TM): Used to indicate"),
    ("<request><Calculator>1+1<call>2<response>", None),
    ("<request><Search>grok<call>grok: To understand<response>\nResult = grok: To understand", None),
    ("<request><Search>x<call>x: " + "word " * 300 + "<response>", None),  # (not within the last 200 ids)
])
def test_the_grammar_finds_the_line_an_answer_quotes_at_the_end_of_the_ids(tokenizer, tail, entry):
    from app.answer_grammar import AnswerGrammar

    ids = tokenizer("Q: What is it?\n" + tail, add_special_tokens=False)["input_ids"]
    assert AnswerGrammar(tokenizer).quoted(ids) == entry


@pytest.mark.parametrize("written, text, allowed", [
    ("", " daemon", True), ("", " what", False), ("", " Daemon", False), (" daemon", ":", True), (" daemon", " is", False),
    (" daemon: A program", "<", False), (" daemon: A program that lies dormant", "<", True),
    (" daemon: A program that lies dormant", "0", True), (" daemon: A program that lies dormant", ". It", True),
])
def test_after_a_look_ups_one_entry_the_answer_line_begins_with_it(written, text, allowed):
    """Regressions: asked "Explain what a daemon is." the model searched, got the daemon entry and answered "Result
    = what a daemon is"; "Result = A newbie." for "A Usenet neophyte"; "metasytactic" copying "metasyntactic".
    After the whole entry anything may follow (a number too: no number rule)."""
    from app.answer_line import owed_allows

    assert owed_allows(written, " daemon: A program that lies dormant", text, numeric=False) is allowed


def test_the_entry_is_spelled_token_by_token_and_then_the_line_is_free(tokenizer):
    """Greedy over flat logits: the mask alone spells the entry (the model picks how it is cut), then lets go."""
    from app.answer_grammar import AnswerGrammar
    from app.answer_line import AnswerLine

    grammar, entry = AnswerGrammar(tokenizer), "daemon: A program that is not invoked explicitly (it waits)"
    line = AnswerLine(after_tool=True, quote=entry)
    for piece in ["\n", "Result", " ="]:
        line.push(piece)
    written = ""
    while line.owed_due is not None and len(written) < 200:
        kept = (grammar.mask(torch.zeros(len(tokenizer)), line) > float("-inf")).nonzero().flatten().tolist()
        token = max(kept, key=lambda i: len(tokenizer.decode([i])))  # the longest piece it allows
        written += tokenizer.decode([token])
        line.push(tokenizer.decode([token]))
    assert written.startswith(" " + entry)
    assert grammar.allowed(line) is None and line.owed_due is None


@pytest.mark.parametrize("text, twice", [
    ("jargon_file_jargon_file_", True), ("laughs at a joke. laughs at a joke. ", True), ("kludge", False),
    ("1 + 1 + 1 + 1 + 1 + 1 + 1", False),  # (no letter: a sum's own repeats) ...
    ("sqrt(2) * sqrt(2) * sqrt", False), ("10 km + 10 km + ", False),  # (... a review found these cut short)
    ("abcab", False), ("foo foo ", False), ("knock knock ", False),  # (under MIN_REPEAT characters)
    ("magic cookie", False), ("x" * 15, False), ("x" * 16, True),
])
def test_a_calls_input_written_twice(text, twice):
    from app.answer_line import writes_it_twice

    assert writes_it_twice(text) is twice


def _kept(grammar, line, vocabulary: int) -> list[str]:
    """The texts of the tokens the grammar's mask keeps after `line`, over flat logits."""
    out = grammar.mask(torch.zeros(vocabulary), line)
    return [grammar.text(i) for i in (out > float("-inf")).nonzero().flatten().tolist()]


def test_a_calls_input_is_one_line_and_ends_where_it_would_end_or_repeat(tokenizer):
    """Regressions: "Tell me a joke." wrote `<request><Search>laughs at a joke.` and the same line again until the
    repetition stop; "What is the Jargon File?" `<request><Search>jargon_file_jargon_file_jargon_file_`: each turn
    ended with the unfinished call as its answer, and the chat's next question copied it."""
    from app.answer_grammar import AnswerGrammar
    from app.answer_line import AnswerLine

    grammar = AnswerGrammar(tokenizer)
    newline, lt = encode(tokenizer, "\n")[0], encode(tokenizer, "<")[0]
    line = AnswerLine(after_question=True)
    for piece in ["<request>", "<Search>", "laughs at a joke."]:
        line.push(piece)
    assert line.call_input == "laughs at a joke."
    logits = torch.zeros(len(tokenizer))
    logits[newline] = 10.0
    out = grammar.mask(logits, line)
    assert out[newline] == float("-inf") and int(out.argmax()) == lt  # (the newline's probability went to `<`)
    assert not [t for t in map(tokenizer.decode, (out > float("-inf")).nonzero().flatten().tolist()) if "\n" in t]
    submit = encode(tokenizer, "<submit>")  # (a `<` in the input only begins `<call>`, or `<response>`)
    assert [tokenizer.decode([i]) for i in submit][:2] == ["<", "submit"]
    line.push(" jargon_file_jargon_file_")
    kept = (grammar.mask(torch.zeros(len(tokenizer)), line) > float("-inf")).nonzero().flatten().tolist()
    assert kept and all("<call>".startswith(tokenizer.decode([i])) for i in kept)
    line.push("<")  # (`<call>` is three tokens: each part on its own goes on spelling a tag that ends the call; review)
    kept = set(_kept(grammar, line, len(tokenizer)))
    assert "call" in kept and "submit" not in kept and "response" in kept  # (`<response>`: the engine reads a call)
    line.push("call")
    kept = _kept(grammar, line, len(tokenizer))
    assert line.call_closing == "<call" and kept and all(text.startswith(">") for text in kept)  # (">", "><", ...)
    line.push(">")
    assert line.call_input is None and grammar.mask(logits, line) is logits  # (the call is over: no rule)


def test_a_line_longer_than_a_call_is_not_followed_as_one(tokenizer):
    """Regression (review): past MAX_CALL_LINE characters the line's text stopped growing and still read as a call."""
    from app.answer_line import MAX_CALL_LINE, AnswerLine

    line = AnswerLine()
    line.push("<request><Search>")
    for _ in range(MAX_CALL_LINE // 8 + 1):
        line.push("abcdefg ")
    assert line.call_input is None
    line.push("\n<request><Search>kludge")
    assert line.call_input == "kludge"


def test_a_token_verified_as_a_draft_is_the_one_chosen_alone_mid_character(tiny_llama, tokenizer):
    """Regression (review): the answer line read an accepted draft as its own text, U+FFFD for the first byte of
    "✓", while a token chosen alone feeds it the segment's delta ("" until the character is whole): with the same
    logits the draft path ended the line ("Result = �<") where one token at a time wrote "Result = ✓"."""
    from app.answer_line import AnswerLine
    from app.decoding import Detokenizer
    from app.local_backend import LocalBackend

    backend = LocalBackend(tiny_llama)
    first, second = encode(tokenizer, "✓")  # two byte tokens
    newline, lt = encode(tokenizer, "\n")[0], encode(tokenizer, "<")[0]
    logits = torch.full((2, len(tokenizer)), -20.0)
    logits[0, first] = 5.0
    logits[1, newline], logits[1, second], logits[1, lt] = 10.0, 9.5, 9.4

    def fresh():
        line, detok = AnswerLine(), Detokenizer(tokenizer)
        for token in encode(tokenizer, "Result = "):
            line.push(detok.push(token))
        return line, detok

    line, detok = fresh()
    drafted = backend._choose(logits, [first], Settings(draft_tokens=4), None, line, detok)
    line, detok = fresh()
    alone = backend._choose(logits[:1], [], Settings(), None, line, detok)
    line.push(detok.push(alone[0]))
    alone += backend._choose(logits[1:], [], Settings(), None, line, detok)
    assert drafted == alone == [first, second]


@pytest.mark.parametrize("after", [".", ",", "e", "e-"])
def test_after_the_calculators_number_a_point_cannot_lead_to_more_digits(tokenizer, after):
    """Regression (review): the rule let "." follow the number and then let go of it: sampling (temperature 1)
    answered "Result = 64.2536" and "Result = 64.0" where the Calculator said 64 (2 of 33 runs)."""
    from app.answer_grammar import AnswerGrammar
    from app.answer_line import AnswerLine

    grammar, line = AnswerGrammar(tokenizer), AnswerLine(after_tool=True, number="64")
    for piece in ["\n", "Result", " =", " 64", after]:
        line.push(piece)
    kept = grammar.mask(torch.zeros(len(tokenizer)), line) > float("-inf")
    assert kept.any()
    assert not [t for t in map(tokenizer.decode, kept.nonzero().flatten().tolist()) if t[:1] in "0123456789"]


def test_the_calculators_number_is_kept_by_a_few_allowed_ids_not_a_ban_of_the_vocabulary(tokenizer):
    """Regression (load test, 20 chats: ~1 s a turn): once the number was begun, every token banned ~49,000 ids."""
    from app.answer_grammar import AnswerGrammar
    from app.answer_line import AnswerLine, number_allows

    grammar, line = AnswerGrammar(tokenizer), AnswerLine(after_tool=True, number="-24")
    for piece in ["\n", "Result", " =", " -", "2", "4", "<"]:
        banned, allowed = grammar.banned(line), grammar.allowed(line)
        assert banned is None or len(banned) < 1000 or line.head is not None  # (the line after a tool: opening)
        assert (allowed is not None) == (line.owed_due in ("", " -", " -2"))  # not yet whole
        assert allowed is None or len(allowed) < 10
        logits = grammar.mask(torch.zeros(len(tokenizer)), line)
        if allowed is not None:
            kept = [tokenizer.decode([i]) for i in (logits > float("-inf")).nonzero().flatten()]
            assert kept and all(number_allows(line.owed_due, " -24", text) for text in kept), kept
        line.push(piece)


def test_the_number_rules_states_are_shared_and_allow_what_number_allows_says(tokenizer):
    """Regression (py-spy of the server under the load test): the state right after the number was keyed by the
    number, so each Calculator result scanned the ~3,000 number tokens again (~15 ms in the scheduler's thread,
    every row waiting), and each new number found the tokens that are a part of it by scanning the ~32,000 whose
    text starts with " " (13 ms). One state now serves every number; token by token, what the line may take is
    what number_allows says (brute force over the vocabulary)."""
    from app.answer_grammar import AnswerGrammar
    from app.answer_line import AnswerLine, breaks_the_line, number_allows

    grammar = AnswerGrammar(tokenizer)
    texts = [grammar.text(i) for i in range(len(tokenizer))]
    for number in ["707", "-24", "1.5"]:
        due = " " + number
        line = AnswerLine(after_tool=True, number=number)
        for piece in ["\n", "Result", " ="]:
            line.push(piece)
        allowed = set(grammar.allowed(line).tolist())  # nothing of the number written yet
        rest = due[len(line.owed_due):]
        part = {i for i, text in enumerate(texts) if text and rest.startswith(text) and text != rest}
        whole = {i for i, text in enumerate(texts) if text.startswith(rest) and number_allows(line.owed_due, due, text)}
        assert allowed == part | whole
        for after in ["", "."]:
            line = AnswerLine(after_tool=True, number=number)
            for piece in ["\n", "Result", " =", due, after]:
                line.push(piece)
            kept = grammar.mask(torch.zeros(len(texts)), line) > float("-inf")
            for i, text in enumerate(texts):
                if text.lstrip()[:1] in "0123456789.,-+eE" and not breaks_the_line(text):
                    assert bool(kept[i]) == number_allows(line.owed_due, due, text), (number, after, text)
    assert sorted(key[1] for key in grammar._banned if key[0] == "number") == ["", "."]
