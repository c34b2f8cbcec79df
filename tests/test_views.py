"""Compare, timing chart and batch views: pure renderers on hand-built episodes, and their handlers on the
tiny forced model (tests/conftest.py), with the custom system prompt and tool subset."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gradio as gr
import pandas as pd
import pytest
from gradio.utils import get_upload_folder

from app.decoding.stops import Stop, StopReason
from app.engine.comparisons import Comparison, GuideComparison
from app.engine.rewards import builtin_questions, exact_match
from app.episode import Episode, Provenance, Segment
from app.settings import MAX_QUESTION_CHARS, InputError
from components.batch import (BatchRun, Item, accuracy, batch_frame, batch_summary, episode_record, episodes_jsonl,
                              format_items, parse_batch, rewards)
from components.compare import compare_markdown, guide_markdown
from components.timing import prefill_frame, segment_order, time_frame, timing_summary
from tests.conftest import plan_text
from tests.support.page import (ALONE, CLAIMED, calculator_episode, make_page, page_settings, plain, request, turn,
                                writing_page)

CALL_STOP = Stop(StopReason.STRING_MATCH, string="<call>")
SUBMIT_STOP = Stop(StopReason.STRING_MATCH, string="<submit>")
TOOLS = ["Calculator", "Search"]


@pytest.fixture(autouse=True)
def one_token_per_pass(monkeypatch):
    """Forced plans name the token of each forward pass; prompt-lookup drafts verify several per pass. The guide
    is off unless a test turns it on: it would change the planned text (tests/test_guide.py tests it)."""
    from components import inputs

    monkeypatch.setattr(inputs, "DEFAULTS", dataclasses.replace(inputs.DEFAULTS, draft_tokens=0, guide=False))


def answer_episode(question: str, text: str, use_cache: bool = True, ms: float = 500.0) -> Episode:
    episode = Episode(question, 700, 710, use_cache=use_cache)
    episode.segments = [Segment("model", text, 710, 720, stop=SUBMIT_STOP, prefill_tokens=10 if use_cache else 710,
                                cached_tokens=700 if use_cache else 0, generated_tokens=10, ms=ms)]
    episode.token_ids = list(range(20))
    return episode


# ---- timing chart -----------------------------------------------------------------------------------------
def test_timing_frames_equal_the_segment_stats():
    first = calculator_episode()
    second = Episode("And 2 + 2?", 744, 755, use_cache=True)
    second.segments = [Segment("model", "Result = 4<submit>", 755, 763, stop=SUBMIT_STOP, prefill_tokens=12,
                               cached_tokens=743, generated_tokens=8, ms=400.25)]
    frame = prefill_frame([first, second])
    segments = [(1, s) for s in first.segments] + [(2, s) for s in second.segments]
    assert len(frame) == 2 * len(segments)
    for (number, segment), (_, new), (_, reused) in zip(segments, frame.iloc[0::2].iterrows(),
                                                        frame.iloc[1::2].iterrows()):
        assert (new["part"], new["tokens"], new["kind"], new["turn"]) == ("new", segment.prefill_tokens,
                                                                          segment.kind, number)
        assert (reused["part"], reused["tokens"]) == ("reused", segment.cached_tokens)
        assert new["ms"] == reused["ms"] == round(segment.ms, 1)
        assert new["segment"] == reused["segment"]
    assert segment_order(frame) == ["T1.1 model", "T1.2 tool", "T1.3 model", "T2.1 model"]
    by_part = frame.groupby("part")["tokens"].sum()
    assert by_part["new"] == first.prefill_tokens + second.prefill_tokens
    assert by_part["reused"] == first.reused_tokens + second.reused_tokens
    times = time_frame([first, second])
    assert list(times["segment"]) == segment_order(frame)
    assert list(times["ms"]) == [round(s.ms, 1) for _, s in segments]
    assert prefill_frame([]).empty and time_frame([]).empty
    assert list(prefill_frame([first, second], most=1)["segment"].unique()) == ["T2.1 model"]
    assert list(prefill_frame([first, second], most=3)["segment"].unique()) == ["T2.1 model"]  # (whole turns)
    assert list(time_frame([second, first], most=1)["segment"]) == ["T2.1 model", "T2.2 tool", "T2.3 model"]
    # (regression: "1 segments", seen on the page)
    assert timing_summary([first, second]) == ("Turn 2: 1 segment, 12 tokens prefilled new, 743 reused from "
                                               "cache, 0.00 s")
    plot = gr.BarPlot(x="segment", y="tokens", color="part").postprocess(frame)
    assert plot.datatypes["segment"] == "nominal" and plot.datatypes["tokens"] == "quantitative"


def test_the_charts_show_the_last_turns_that_fit_their_width():
    """Regression (Chromium): at 8 turns of 3 segments the slanted labels of 24 bars ran into each other."""
    turns = [calculator_episode() for _ in range(8)]
    assert segment_order(prefill_frame(turns)) == [f"T{t}.{i} {k}" for t in range(5, 9)
                                                   for i, k in enumerate(("model", "tool", "model"), 1)]
    assert list(time_frame(turns)["turn"].unique()) == [5, 6, 7, 8]


# ---- compare ------------------------------------------------------------------------------------------------
def test_compare_markdown_shows_both_columns_identity_and_speedup():
    on, off = answer_episode("What is 6*7?", "Result = 42<submit>"), answer_episode("What is 6*7?",
                                                                                   "Result = 42<submit>", False)
    text = compare_markdown(Comparison(on, off, cached_s=0.5, uncached_s=1.0))
    assert "| | cache on | cache off |" in text
    assert "| tokens prefilled, all segments | 10 | 710 |" in text
    assert "| tokens reused, all segments | 700 | 0 |" in text
    assert "| wall time | 0.50 s | 1.00 s |" in text
    assert "identical tokens: yes" in text and "2.00×" in text
    assert text.count("Result = 42&lt;submit&gt;") == 2
    off.token_ids = [1, 2, 3]
    assert "identical tokens: no" in compare_markdown(Comparison(on, off, cached_s=0.0, uncached_s=1.0))
    assert "∞" in compare_markdown(Comparison(on, off, cached_s=0.0, uncached_s=1.0))


def test_guide_markdown_shows_both_answers_and_what_the_guide_chose():
    on = answer_episode("What is 6*7?", "Result = 42<submit>")
    on.guide = True
    on.segments[0].provenance = [Provenance.MODEL] * 2 + [Provenance.FORCED] * 6 + [Provenance.STEERED] * 2
    off = answer_episode("What is 6*7?", "Result = 41<submit>", ms=300.0)
    text = guide_markdown(GuideComparison(on, off, guided_s=0.5, unguided_s=0.25))
    assert "| | guide on | guide off |" in text
    assert "| answer | Result = 42&lt;submit&gt; | Result = 41&lt;submit&gt; |" in text
    assert "| tokens forced by the guide | 6 | 0 |" in text and "| tokens steered by the guide | 2 | 0 |" in text
    assert "| wall time | 0.50 s | 0.25 s |" in text and "| tool calls | none | none |" in text
    assert "same answer: no" in text and "6 tokens were forced and 2 steered" in text
    on.segments[0].steered_known = False  # a model server's: steering not reported
    assert "| tokens steered by the guide | not reported | 0 |" in guide_markdown(GuideComparison(on, off, 1, 1))
    on.segments[0].stop = Stop(StopReason.CANCELLED)
    stopped = guide_markdown(GuideComparison(on, off, 1, 1))
    assert "stopped by user" in stopped and "same answer" not in stopped


# ---- batch --------------------------------------------------------------------------------------------------
def test_parse_batch_lines_expected_answers_and_limits():
    items = parse_batch("What is 2+2? | 4\n\n  Hello  \nWhat is a|b? | x\n")
    assert items == [Item("What is 2+2?", "4"), Item("Hello", None), Item("What is a|b?", "x")]
    assert parse_batch(format_items(builtin_questions()))[0] == Item(*builtin_questions()[0])
    # Regression (Chromium): "What is 6 | 3?" ran as the question "What is 6" expecting "3?"
    assert parse_batch("What is 6 | 3?\nWhat is 6 | 3? | 7") == [Item("What is 6 | 3?"), Item("What is 6 | 3?", "7")]
    for text, message in [("", "no questions"), ("  \n ", "no questions"), ("| 4", "line 1: the question is empty"),
                          ("ok\nq |  ", "line 2: the expected answer after | is empty"),
                          ("x" * (MAX_QUESTION_CHARS + 1), "too long"),
                          ("\n".join(["q"] * 17), r"too many questions \(17, at most 16\)")]:
        with pytest.raises(InputError, match=message):
            parse_batch(text)


def test_batch_rewards_accuracy_rows_and_summary():
    items = [Item("What is 41 * 23?", "943"), Item("What is 96 / 8?", "12"), Item("Hi", None),
             Item("What is 1,000 + 234?", "1,234")]
    on = [answer_episode(items[0].question, "Result = 943<submit>"),
          answer_episode(items[1].question, "Result = 13<submit>"),
          answer_episode(items[2].question, "Hello<submit>"),
          answer_episode(items[3].question, "Result = 1234.<submit>")]
    on[0].segments.insert(0, Segment("tool", "943<response>", 700, 705, tool="Calculator", query="41 * 23"))
    scores = rewards(on, items)
    assert scores == [exact_match("Result = 943", "943"), 0.0, None, 1.0] == [1.0, 0.0, None, 1.0]
    assert accuracy(scores) == (2.0, 3)
    assert accuracy([None]) is None
    frame = batch_frame(on, items)
    assert list(frame["reward"]) == ["1", "0", "", "1"]
    assert list(frame["answer"]) == ["Result = 943", "Result = 13", "Hello", "Result = 1234."]
    assert frame.loc[0, "stops"] == "string match <submit>" and frame.loc[0, "tool calls"] == "Calculator: 41 * 23"
    assert frame.loc[1, "tool calls"] == "—"
    off = [dataclasses.replace(e, use_cache=False) for e in on]
    summary = batch_summary(items, BatchRun(on, 2.0, True), BatchRun(off, 5.0, False))
    assert "accuracy: 2/3 = 67%" in summary
    assert "total time, cache on: 2.00 s" in summary and "total time, cache off: 5.00 s" in summary
    assert "speed-up: 2.50× · identical answers: yes" in summary
    off[1] = answer_episode(items[1].question, "Result = 12<submit>")
    off[1].token_ids = [9]
    assert "identical answers: no" in batch_summary(items, BatchRun(on, 2.0, True), BatchRun(off, 5.0, False))
    assert "accuracy: n/a" in batch_summary([Item("Hi")], BatchRun(on[2:3], 1.0, True))


def test_a_stopped_batch_pass_is_marked_partial_and_not_compared():
    """Regression (Chromium): Stop during the cache-off pass showed "speed-up: 8.80× · identical answers: no",
    comparing a finished pass with one cut short."""
    on = [answer_episode("What is 41 * 23?", "Result = 943<submit>")]
    off = [dataclasses.replace(on[0], use_cache=False)]
    summary = batch_summary([Item("What is 41 * 23?")], BatchRun(on, 2.0, True),
                            BatchRun(off, 0.5, False, stopped=True))
    assert "total time, cache off: 0.50 s (stopped by user: partial)" in summary
    assert "speed-up:" not in summary and "identical answers: not compared (a pass was stopped)" in summary


def test_answers_cut_short_by_stop_are_not_scored():
    """Regression (Chromium): Stop 4 s into the built-in batch showed "accuracy: 1/8 = 12%", counting the rows
    Stop had cut short as wrong answers."""
    items = [Item("What is 41 * 23?", "943"), Item("What is 96 / 8?", "12"), Item("What is 7 + 5?", "12"),
             Item("Hi", None)]
    on = [answer_episode(items[0].question, "Result = 943<submit>"),
          answer_episode(items[1].question, "<request><Calc"), answer_episode(items[2].question, ""),
          answer_episode(items[3].question, "Hel")]
    for episode in on[1:]:
        episode.segments[-1].stop = Stop(StopReason.CANCELLED)
    assert rewards(on, items) == [1.0, None, None, None]
    assert list(batch_frame(on, items)["reward"]) == ["1", "", "", ""]
    summary = batch_summary(items, BatchRun(on, 4.0, True, stopped=True))
    assert "accuracy: 1/1 = 100% (2 answers cut short by Stop, not scored)" in summary
    assert "accuracy: n/a (1 answer cut short by Stop, not scored)" in batch_summary(
        items[1:2], BatchRun(on[1:2], 4.0, True, stopped=True))


# ---- handlers on the tiny forced model ------------------------------------------------------------------
def steps(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def answers_plan(tokenizer, runs: int, *answers: tuple[str, ...]) -> dict[int, int]:
    """Force each episode's model segments in order, `runs` times over (cache on, then off)."""
    plan, step = {}, 0
    for _ in range(runs):
        for pieces in answers:
            for piece in pieces:
                plan.update(plan_text(tokenizer, (step, piece)))
                step += steps(tokenizer, piece)
    return plan


CALC = ("<request><Calculator>41 * 23<call>", "Result = 943<submit>")


def compare_outputs(page, message="", key="page-1", tools=TOOLS, prompt=None):
    return list(page.chat.compare(message, page_settings(tools=tools, prompt=prompt), request(key)))


def test_compare_runs_cache_on_and_off_with_identical_text_and_leaves_the_chat(tiny_llama, tokenizer):
    page, loaded = make_page(tiny_llama, answers_plan(tokenizer, 2, CALC))
    outputs = compare_outputs(page, "What is 41 * 23?")  # no chat yet: a fresh session
    assert outputs[0].status.startswith("running")
    text, status = outputs[-1].compare_result, outputs[-1].status
    assert status == "done · protocol textenv"
    assert "identical tokens: yes" in text and "| | cache on | cache off |" in text
    assert text.count("Result = 943&lt;submit&gt;") == 2
    assert page.service.store.peek("page-1").session is None  # compare never creates or changes the chat
    # with a chat: an empty message box runs the chat's last turn again, on forks of the session from before it
    loaded.model.plan, loaded.model.step = answers_plan(tokenizer, 3, CALC), 0
    turn(page, "What is 41 * 23?")
    session = page.service.store.peek("page-1").session
    before = (list(session.cache.ids), len(session.episodes))
    last = compare_outputs(page, "")[-1]
    text, status = last.compare_result, last.status
    assert status == "done · protocol textenv" and "Question: What is 41 \\* 23?" in text and "identical tokens: yes" in text
    assert (session.cache.ids, len(session.episodes)) == before
    assert page.service.store.peek("page-1").session is session


def test_compare_errors_are_messages(tiny_llama):
    page, _ = make_page(tiny_llama)
    assert compare_outputs(page, "  ")[-1].status.startswith("error: nothing to compare")
    assert compare_outputs(page, "x", prompt="  ")[-1].status.startswith("error: the system prompt is empty")


def test_batch_runs_twice_with_rewards_accuracy_and_both_totals(tiny_llama, tokenizer):
    answers = (CALC, ("Result = 13<submit>",))
    page, _ = make_page(tiny_llama, answers_plan(tokenizer, 2, *answers))
    text = "What is 41 * 23? | 943\nWhat is ninety-six over eight? | 12"
    outputs = list(page.batch.run(text, page_settings(), request()))
    last = outputs[-1]
    frame, summary, status, download = last.batch_results, last.batch_summary, last.batch_status, last.batch_download
    assert status == "done · protocol textenv" and outputs[0].batch_status == "running"
    assert outputs[0].batch_download.interactive is False and all(o.batch_download is None for o in outputs[1:-1])
    assert download.interactive is True and download.value["orig_name"] == "batch-episodes.jsonl"
    path = Path(download.value["path"])  # in Gradio's cache folder, which serves it, in a folder of its own
    assert path.parent.parent == Path(get_upload_folder()).resolve() and path.parent.name.startswith("textenv-batch-")
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert [line["question"] for line in lines] == ["What is 41 * 23?", "What is ninety-six over eight?"]
    assert [line["reward"] for line in lines] == [1.0, 0.0]
    for line in lines:
        assert len(line["token_ids"]) == len(line["mask"]) == len(line["provenance"]) > 0
        assert line["guide"] is False and set(line["provenance"]) <= {"user", "tool", "model"}
        assert line["mask"] == [int(p == "model") for p in line["provenance"]]
    assert "tool" in lines[0]["provenance"] and lines[0]["answer"] == "Result = 943"
    assert any("cache off" in str(o.batch_status) for o in outputs)
    assert isinstance(frame, pd.DataFrame) and list(frame["reward"]) == ["1", "0"]
    assert list(frame["answer"]) == ["Result = 943", "Result = 13"]
    assert frame.loc[0, "stops"] == "string match <call> → string match <submit>"
    assert frame.loc[0, "tool calls"] == "Calculator: 41 * 23"
    assert "accuracy: 1/2 = 50%" in summary
    assert "total time, cache on:" in summary and "total time, cache off:" in summary
    assert "identical answers: yes" in summary
    assert page.service.store.peek("page-1").session is None  # the chat is untouched


def test_batch_input_errors(tiny_llama):
    page, _ = make_page(tiny_llama)
    for text, message in [("", "error: no questions"), ("\n".join(["q"] * 17), "error: too many questions")]:
        outputs = list(page.batch.run(text, page_settings(prompt="p"), request()))
        # (one update: regression, the table of the last results was emptied first, then the error shown)
        assert len(outputs) == 1 and outputs[0].batch_results is None and outputs[0].batch_summary is None
        assert outputs[0].batch_status.startswith(message)
    assert list(page.batch.run("q", page_settings(tools=["Shell"], prompt="p"), request()))[-1].batch_status.startswith(
        "error: unknown tool")
    assert list(page.batch.run("q", page_settings(prompt=""), request()))[-1].batch_status.startswith(
        "error: the system prompt is empty")
    assert "Result" not in page.batch.builtin_batch().splitlines()[0]
    assert page.batch.builtin_batch().splitlines()[0] == "What is 41 * 23? | 943"


def test_custom_prompt_and_tool_subset_are_used_and_a_change_starts_a_new_chat(tiny_llama):
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    custom = "You are Custom Bot. Tools you may call:\n{tools}\n"
    shown = turn(page, "hi", tools=["Calculator"], prompt=custom, max_new_tokens=2)[-1]
    assert plain(shown.status) == "done"
    system = shown.tokens[0]
    assert system[1] == "system" and system[0].startswith("You are Custom Bot. Tools you may call:\n- Calculator:")
    assert "- Search:" not in system[0] and "{tools}" not in system[0]
    entry = page.service.store.peek("page-1")
    assert entry.prompt == custom and entry.engine_key == ("textenv", "Calculator")
    first = entry.session
    # same prompt again: the chat continues
    turn(page, "more", tools=["Calculator"], prompt=custom, max_new_tokens=2)
    assert entry.session is first and len(first.episodes) == 2
    # a changed prompt starts a new chat with a visible note
    shown = turn(page, "again", tools=["Calculator"], prompt="Other. {tools}", max_new_tokens=2)[-1]
    chat = shown.chat
    assert plain(shown.status) == "done" and entry.session is not first and len(entry.session.episodes) == 1
    assert chat[0]["metadata"]["title"] == "Note" and "System prompt changed" in chat[0]["content"]
    assert shown.tokens[0][0].startswith("Other. - Calculator:")
    # an empty prompt is an error; the chat is kept
    shown = turn(page, "keep me", prompt="   ")[-1]
    assert shown.status.startswith("error: the system prompt is empty") and shown.msg == "keep me"
    assert len(entry.session.episodes) == 1
    kept = entry.session
    shown = turn(page, "keep me", tools=["Calculator"], prompt="".join(chr(0x4E00 + i) for i in range(7000)))[-1]
    assert shown.status.startswith("error: the system prompt has") and entry.session is kept  # nothing lost
    assert "System prompt changed" in shown.chat[0]["content"] and len(shown.chat) > 1
    shown = turn(page, "keep me", prompt="x" * 8001)[-1]
    assert shown.status == "error: the system prompt is too long (8001 characters, at most 8000)"
    assert entry.session is kept


def test_timing_handler_follows_the_chat(tiny_llama, tokenizer):
    page, _ = make_page(tiny_llama, answers_plan(tokenizer, 1, CALC))
    on_load = page.chat.refresh(request())  # (page load: the charts of the visitor's chat, none yet)
    tokens_plot, ms_plot, summary = on_load.timing, on_load.timing_ms, on_load.timing_text
    assert tokens_plot.value is None or tokens_plot.value["data"] == []
    assert summary == "Timing: no turns yet"
    # Regression (seen in Chromium): New chat sent `sort=[]` with the empty frames, and a change of `sort` redraws
    # the chart from its previous data, so it kept the last chat's bars; the empty data alone clears them
    assert "sort" not in tokens_plot.constructor_args and "sort" not in ms_plot.constructor_args
    assert tokens_plot.value["datatypes"]["tokens"] == ms_plot.value["datatypes"]["ms"] == "quantitative"
    _, submitted, _ = page.chat.submit("What is 41 * 23?", [], request())
    outputs = list(page.chat.turn(submitted, page_settings(), request()))
    # the charts come with the final status
    assert all(o.timing is None and o.timing_ms is None and o.timing_text is None for o in outputs[:-1])
    assert outputs[-1].status == "done · protocol textenv"
    tokens_plot, ms_plot, summary = outputs[-1].timing, outputs[-1].timing_ms, outputs[-1].timing_text
    episode = page.service.store.peek("page-1").session.episodes[-1]
    assert summary == timing_summary([episode])
    frame = prefill_frame([episode])
    assert tokens_plot.sort == segment_order(frame) == ["T1.1 model", "T1.2 tool", "T1.3 model"]
    assert tokens_plot.value["data"] == frame.values.tolist()
    assert [row[2] for row in ms_plot.value["data"]] == [round(s.ms, 1) for s in episode.segments]


def test_stop_during_compare_stops_both_runs(tiny_llama):
    """Regression: compare ignored Stop and ran both long runs to the end while holding the model."""
    page, loaded = make_page(tiny_llama, eos_ids=frozenset())
    forward = loaded.model.forward

    def forward_then_stop(*args, **kwargs):  # Stop pressed a few tokens into the cached run
        if loaded.model.step == 3:
            page.chat.stop(request())
        return forward(*args, **kwargs)

    loaded.model.forward = forward_then_stop
    ticket = page.chat.ticket(request())
    last = list(page.chat.compare("go on", page_settings(max_new_tokens=400), request(), ticket=ticket))[-1]
    text, status = last.compare_result, last.status
    assert status == "done (stopped by user) · protocol textenv" and text.count("stopped by user") == 3  # both runs + the verdict
    assert "speed-up with the cache" not in text and "identical tokens: " not in text  # no verdict from cut-short runs
    assert loaded.model.step < 20


def test_new_chat_during_a_batch_leaves_the_batch_running(tiny_llama):
    """Regression: New chat set the visitor's stop signal, which the batch on the other tab obeys too."""
    page, loaded = make_page(tiny_llama, eos_ids=frozenset())
    forward = loaded.model.forward

    def forward_then_new_chat(*args, **kwargs):
        if loaded.model.step == 2:
            page.chat.new_chat(request())
        return forward(*args, **kwargs)

    loaded.model.forward = forward_then_new_chat
    last = list(page.batch.run("one\ntwo", page_settings(), request(), ticket=page.batch.ticket(request())))[-1]
    frame, summary, status = last.batch_results, last.batch_summary, last.batch_status
    assert status == "done · protocol textenv" and "total time, cache off" in summary
    assert "stopped by user" not in " ".join(frame["stops"])


# ---- guided answers: Compare guide and the Batch tab's JSONL ---------------------------------------------------
def test_compare_guide_runs_the_question_with_the_guide_on_and_off_and_leaves_the_chat(tiny_llama):
    page = writing_page(tiny_llama, ALONE)
    outputs = list(page.chat.compare_guide(CLAIMED, page_settings(max_new_tokens=24, guide=False),
                                           request()))  # (the checkbox does not matter: both runs are made)
    assert outputs[0].status == "running: compare (guide on, then off)"
    text, status = outputs[-1].compare_result, outputs[-1].status
    assert plain(status) == "done" and "| | guide on | guide off |" in text
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in text.splitlines() if " | " in line}
    assert rows["answer"][0].startswith("&lt;request&gt;&lt;Calculator&gt;2 \\+ 2 \\* 3&lt;call&gt;")
    assert "Result = 8" in rows["answer"][0] and rows["answer"][1] == "Result = 7&lt;submit&gt; |"
    assert rows["tool calls"] == ["Calculator: 2 \\+ 2 \\* 3", "none |"]
    assert int(rows["tokens forced by the guide"][0]) > 0 and rows["tokens forced by the guide"][1] == "0 |"
    assert "same answer: no" in text
    assert page.service.store.peek("page-1").session is None  # the chat is untouched


def test_a_guided_batchs_jsonl_marks_the_guides_tokens_out_of_the_mask(tiny_llama):
    page = writing_page(tiny_llama, ALONE)
    guided = page_settings(max_new_tokens=24, guide=True)
    first = list(page.batch.run("What is 1 + 1?", guided, request("other")))[-1].batch_download
    path = Path(first.value["path"])
    last = list(page.batch.run(f"{CLAIMED} | 8", guided, request()))[-1]
    status, download = last.batch_status, last.batch_download
    assert plain(status) == "done"
    (line,) = [json.loads(line) for line in open(download.value["path"], encoding="utf-8")]
    assert Path(download.value["path"]).parent != path.parent  # (each batch's file in a folder of its own)
    assert line["guide"] is True and line["question"] == CLAIMED and line["answer"].startswith("Result = 8")
    assert line["reward"] == exact_match(line["answer"], "8")  # (the tiny model writes on after the 8)
    provenance, mask = line["provenance"], line["mask"]
    assert "forced" in provenance and len(provenance) == len(mask) == len(line["token_ids"])
    assert all(m == 0 for m, p in zip(mask, provenance) if p in ("forced", "user", "tool"))
    assert all(m == 1 for m, p in zip(mask, provenance) if p in ("model", "steered"))


def test_episode_records_are_one_json_line_each():
    episode = answer_episode("Qué es 6*7?", "Result = 42<submit>")
    episode.reward = 1.0
    record = episode_record(episode)
    assert set(record) == {"question", "answer", "token_ids", "mask", "provenance", "reward", "guide", "protocol"}
    text = episodes_jsonl([episode, episode])
    assert text.count("\n") == 2 and text.endswith("\n") and "Qué" in text  # (UTF-8 as is)
    assert json.loads(text.splitlines()[1]) == record
    assert episodes_jsonl([]) == ""
