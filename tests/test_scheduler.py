"""The batched scheduler (app.backends.scheduler, app.model.ragged): rows that share forward passes get exactly what
each would get alone, whatever joins, leaves, fails or is cancelled beside them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from app.backends import scheduler as scheduler_module
from app.backends.base import SegmentRequest
from app.backends.row import Row, RowStep
from app.backends.scheduler import CHUNK_ALONE, CHUNK_BESIDE_DECODE, Cancelled, Scheduler, plan_step
from app.backends.tokens import SegmentTokens
from app.decoding.stops import StopChecker
from app.engine.engine import Engine
from app.episode import EpisodeFinished, Limit, Stop, StopReason, TextDelta
from app.model.kvcache import TokenCache
from app.settings import Settings
from app.tools.base import Tool
from app.tools.registry import default_tools
from tests.conftest import logit_tolerance


def wait_for_steps(scheduler: Scheduler, n: int) -> None:
    """Block until the scheduler has run `n` more steps: rows started after it join a batch mid-flight. (No
    deadline: it used to give up silently after 60 s; pytest-timeout now fails a hang with its traceback.)"""
    target = scheduler.stats.steps + n
    while scheduler.stats.steps < target:
        time.sleep(0.002)


@pytest.mark.parametrize("rows, expected", [
    ([(1, 1)], [1]),  # a decode step
    ([(900, 1)], [CHUNK_ALONE]),  # a long prefill alone: big chunks
    ([(900, 1), (300, 1)], [CHUNK_ALONE - 300, 300]),  # two prefills, no decoding row: the shorter first
    ([(1, 1), (900, 1), (500, 1)], [1, 0, CHUNK_BESIDE_DECODE]),  # beside a decoding row: a small chunk
    # Regression: a question behind a cache-off batch's recomputations waited for all of them (first text 4.3 s)
    ([(900, 1), (900, 1), (15, 1), (1, 1)], [CHUNK_BESIDE_DECODE - 15, 0, 15, 1]),
    ([(5, 5), (20, 1)], [5, 20]),  # drafts are fed whole; a short prefill fits the budget
    ([(CHUNK_BESIDE_DECODE + 1, 9), (1, 1)], [CHUNK_BESIDE_DECODE + 1 - 9, 1]),  # the last chunk keeps `keep`
])
def test_plan_step_chunks_prefills_beside_decoding_rows(rows, expected):
    assert plan_step(rows) == expected


def greedy_steps(forward, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill `ids`, then decode `steps` greedy tokens; return the tokens and every step's logits."""
    cache, tokens, logits = TokenCache(ids), [], []
    for _ in range(steps):
        out, _, _ = forward(cache)
        logits.append(out[-1])
        tokens.append(int(out[-1].argmax()))
        cache.extend(tokens[-1:])
    return tokens, logits


@pytest.mark.parametrize("which", ["tiny_llama", "real"])
def test_staggered_rows_of_very_different_lengths_match_the_models_own_forward(which, request, tokenizer):
    loaded = request.getfixturevalue(which)
    texts = ["Q: What is 2 + 2?\n", "word " * 1800, "The Jargon File says a kludge is", "Hi"]
    prompts = [tokenizer.encode(t) for t in texts]
    # alone, through transformers' own forward pass
    solo = [greedy_steps(lambda c: c.forward(loaded.model), ids, 12) for ids in prompts]
    scheduler = Scheduler(loaded.model)
    assert scheduler.ragged
    results: list = [None] * len(prompts)

    def row(i):
        results[i] = greedy_steps(scheduler.forward, prompts[i], 12)

    threads = []
    for i in range(len(prompts)):
        threads.append(threading.Thread(target=row, args=(i,)))
        threads[-1].start()
        wait_for_steps(scheduler, 3)  # the next row joins three steps later
    for t in threads:
        t.join()
    for (tokens, logits), (solo_tokens, solo_logits) in zip(results, solo):
        assert tokens == solo_tokens
        assert max((a - b).abs().max().item() for a, b in zip(logits, solo_logits)) < logit_tolerance(loaded)
    assert scheduler.stats.peak_rows >= 2  # the rows really shared steps


def test_a_turn_counts_for_the_scheduler_from_its_question_to_its_answer(tiny_llama):
    """Regression (concurrency_bench, 8 questions sent at once): they reached the scheduler over 4-31 ms and the
    first one prefilled alone. A turn now counts from its start (LocalBackend.turn_scope), so a step waits up to
    GATHER_S for turns still writing their question, and they prefill in one pass."""
    engine, scheduler = Engine(tiny_llama), tiny_llama.scheduler
    turn = engine.turn(engine.new_session(), "What is 2 + 2?", Settings(max_new_tokens=2, max_turns=0))
    assert scheduler.rows_in_turns() == 0
    next(turn)  # started: in scope before its first pass
    assert scheduler.rows_in_turns() == 1
    assert isinstance(list(turn)[-1], EpisodeFinished)
    assert scheduler.rows_in_turns() == 0


def test_a_failing_row_fails_alone_and_its_cache_is_rolled_back(tiny_llama, tokenizer):
    scheduler = Scheduler(tiny_llama.model)
    good = [tokenizer.encode("one two three"), tokenizer.encode("four five six seven")]
    solo = [TokenCache(ids).forward(tiny_llama.model)[0] for ids in good]
    bad = TokenCache(tokenizer.encode("eight nine"))
    scheduler.forward(bad)  # cached: 1 of 2
    bad.extend([len(tokenizer) + 5])  # an id past the vocabulary: the embedding raises
    caches, out, errors = [TokenCache(ids) for ids in good] + [bad], [None] * 3, [None] * 3

    def row(i):
        try:
            out[i] = scheduler.forward(caches[i])[0]
        except Exception as error:
            errors[i] = error

    threads = [threading.Thread(target=row, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors[0] is None and errors[1] is None and isinstance(errors[2], IndexError)
    for logits, expected in zip(out, solo):
        assert torch.allclose(logits, expected, atol=1e-5)
    assert bad.cached == 2  # exactly what it covered before the failed pass
    bad.truncate(3)
    bad.check()


def stop_after_first_pass(monkeypatch) -> threading.Event:
    """An Event that the scheduler's first ragged pass sets once it is done (a Stop during a long prefill)."""
    cancel, real = threading.Event(), scheduler_module.ragged.ragged_forward

    def forward(model, rows):
        out = real(model, rows)
        cancel.set()
        return out

    monkeypatch.setattr(scheduler_module.ragged, "ragged_forward", forward)
    return cancel


def test_a_cancelled_prefill_stops_between_two_chunks_and_keeps_what_it_fed(tiny_llama, monkeypatch):
    scheduler = Scheduler(tiny_llama.model)
    cache = TokenCache([(7 * i) % 500 + 3 for i in range(2 * CHUNK_ALONE + 50)])
    with pytest.raises(Cancelled) as stopped:
        scheduler.forward(cache, cancel=stop_after_first_pass(monkeypatch))
    assert (stopped.value.fed, stopped.value.reused) == (CHUNK_ALONE, 0)
    assert cache.cached == CHUNK_ALONE
    cache.check()  # an exact prefix: the next pass goes on from there
    logits, fed, reused = scheduler.forward(cache)
    assert (fed, reused) == (len(cache) - CHUNK_ALONE, CHUNK_ALONE)
    assert torch.allclose(logits, TokenCache(cache.ids).forward(tiny_llama.model)[0], atol=logit_tolerance(tiny_llama))


def test_stop_during_a_long_question_ends_the_turn_before_its_prefill_is_done(tiny_llama, monkeypatch):
    """Regression (Chromium): Stop pressed while a 3,000-character message was prefilled took 7.6 s, the whole
    prefill; the Batch tab's Stop 20 s. Now the pass stops between two chunks."""
    engine = Engine(tiny_llama)
    session = engine.new_session()
    question = " ".join(f"word{i}" for i in range(CHUNK_ALONE))
    cancel = stop_after_first_pass(monkeypatch)
    episode = list(engine.turn(session, question, Settings(max_new_tokens=8), cancel=cancel))[-1].episode
    (segment,) = episode.segments
    assert segment.stop.reason is StopReason.CANCELLED and segment.generated_tokens == 0
    assert segment.prefill_tokens == CHUNK_ALONE < episode.total_tokens - session.prompt_tokens
    assert session.cache.cached == session.prompt_tokens + CHUNK_ALONE


def test_a_closed_stream_stopped_before_its_next_pass_keeps_no_unverified_drafts(tokenizer, monkeypatch):
    """Regression (review): a turn's stream closed right after Stop, while its next pass (with prompt-lookup
    drafts already in the ids) waited for another visitor's row, ended with Cancelled unhandled: the drafts stayed
    in the session's ids and segment as if the model had written them, and the next turn prefilled them."""
    from tests.conftest import _tiny, forced, plan_text, prime

    question = "one two three four five six seven eight nine ten"
    plan = plan_text(tokenizer, (0, " " + question + " " + question))  # the model copies the question
    settings = Settings(max_new_tokens=40, draft_tokens=8, guide=False)
    monkeypatch.setattr(scheduler_module, "GATHER_S", 1.0)  # the next step waits for the other row a while
    loaded = forced(_tiny("llama", tokenizer), plan)
    engine = Engine(loaded, prompt="Answer.\n{tools}\n\n")
    session, cancel = prime(engine), threading.Event()
    turn = engine.turn(session, question, settings, cancel)
    with loaded.scheduler.turn():  # another visitor's turn, between two of its passes
        for event in turn:
            if isinstance(event, TextDelta) and len(session.cache) - session.cache.cached > 1:  # drafts added
                cancel.set()
                turn.close()
                break
        else:
            pytest.fail("no pass with drafts")
    segment = session.episodes[-1].segments[-1]
    assert segment.stop.reason is StopReason.CANCELLED
    assert segment.end - segment.start == segment.generated_tokens  # only the tokens the model chose
    assert len(session.cache) == segment.end == session.cache.cached + 1  # the last one, not yet fed
    answer = session.cache.ids[session.episodes[-1].query_end:]
    assert answer == [plan[step] for step in range(len(answer))]


def test_a_stream_closed_after_its_request_was_stopped_keeps_no_unverified_drafts(tokenizer, monkeypatch):
    """Regression (review): Stop ended the request, and the stream was closed before it read that end: the drafts
    added for the pass that never ran stayed in the ids and the segment's text ("zebra quokka walrus nar" where the
    model wrote "zebra quok")."""
    from tests.conftest import _tiny, forced, plan_text, prime

    question = "one two three four five six seven eight nine ten"
    loaded = forced(_tiny("llama", tokenizer), plan_text(tokenizer, (0, " " + question + " " + question)))
    engine = Engine(loaded, prompt="Answer.\n{tools}\n\n")
    monkeypatch.setattr(scheduler_module, "GATHER_S", 0.5)  # the next step waits for the other row a while
    session, cancel = prime(engine), threading.Event()
    turn = engine.turn(session, question, Settings(max_new_tokens=40, draft_tokens=8, guide=False), cancel)
    with loaded.scheduler.turn():  # another visitor's turn, between two of its passes
        for event in turn:
            if isinstance(event, TextDelta) and len(session.cache) - session.cache.cached > 1:  # drafts added
                cancel.set()
                deadline = time.monotonic() + 10
                while loaded.scheduler.pending() and time.monotonic() < deadline:
                    time.sleep(0.005)  # (the request ends, Cancelled, before its next pass ...)
                turn.close()  # (... and only then is the stream closed)
                break
    segment = session.episodes[-1].segments[-1]
    assert segment.stop.reason is StopReason.CANCELLED
    assert segment.end - segment.start == segment.generated_tokens == len(session.cache) - segment.start


def test_a_bad_model_threads_setting_fails_at_load_not_in_the_schedulers_thread(tiny_llama, monkeypatch):
    """Regression (review): MODEL_THREADS=two raised in the scheduler's thread, which ended, and every forward
    pass then waited forever (the app hung at its warm-up)."""
    monkeypatch.setenv("MODEL_THREADS", "two")
    with pytest.raises(ValueError, match="MODEL_THREADS"):
        Scheduler(tiny_llama.model)


def test_rows_on_a_model_without_the_ragged_pass_still_run_one_by_one(tiny, tokenizer):
    """tiny: llama (the ragged pass) and gpt2 (one row at a time)."""
    scheduler = Scheduler(tiny.model)
    assert scheduler.ragged == (tiny.model.config.model_type == "llama")
    prompts = [tokenizer.encode(t) for t in ("alpha beta", "gamma delta epsilon", "zeta")]
    solo = [greedy_steps(lambda c: c.forward(tiny.model), ids, 6)[0] for ids in prompts]
    results: list = [None] * 3
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, greedy_steps(scheduler.forward,
                                                                                      prompts[i], 6)[0]))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo


def test_a_sampled_rows_output_depends_only_on_its_own_seed(tiny_llama, monkeypatch):
    """Four sampled rows at once: the seed-7 row's tokens are its tokens alone. The scheduler's first step waits
    until all four have asked for their passes (no timing: it reads its own queue), so they share steps, which
    the steps' records show."""
    engine = Engine(tiny_llama)
    sampled = Settings(max_new_tokens=24, max_turns=0, temperature=0.9, seed=7)
    alone = engine.ask(engine.new_session(seed=7), "Tell me something.", sampled).token_ids
    others = [Settings(max_new_tokens=30, max_turns=0, temperature=1.2, seed=s) for s in (1, 2, 3)]
    mine = engine.new_session(seed=7)
    sessions = [engine.new_session(seed=s.seed) for s in others]  # (their shared prompt prefilled before the gate)
    scheduler = tiny_llama.scheduler
    steps: list[set[int]] = []  # each step's rows, by their own keys/values (TokenCache.own_kv)
    real = scheduler_module.ragged.ragged_forward

    def gathered(model, rows):  # (the scheduler's thread, each step's pass)
        if not steps:  # (the first step waits until all four rows are in: its requests and those waiting)
            deadline = time.monotonic() + 10
            while scheduler.pending() < 4 and time.monotonic() < deadline:
                time.sleep(0.002)
        steps.append({id(row.kv) for row in rows})
        return real(model, rows)

    monkeypatch.setattr(scheduler_module.ragged, "ragged_forward", gathered)
    threads = [threading.Thread(target=lambda s=s, session=session: engine.ask(session, "Go on.", s))
               for s, session in zip(others, sessions)]
    for t in threads:
        t.start()
    got = engine.ask(mine, "Tell me something.", sampled).token_ids
    for t in threads:
        t.join()
    assert got == alone
    shared = [step for step in steps if id(mine.cache.own_kv) in step and len(step) > 1]
    assert len(shared) >= sampled.max_new_tokens // 2  # (each row's first pass may come a step apart)


def long_tool() -> Tool:
    """A tool that returns a long text: a long tool result to prefill beside decoding rows."""
    return Tool("Manual", "returns a long manual page",
                lambda query: " ".join(f"step {i}: turn the knob of the {query} once." for i in range(100)))


# A prompt the model follows for as long as it may write, adapter or not (a "long story" prompt it ends in a few
# tokens with the shipped adapter).
COUNTING = "You count out loud.\n\nQ: Count to 30.\nResult = " + ", ".join(map(str, range(1, 31))) + "<submit>\n"

ROWS = [  # (question, settings, prompt): every way a row can leave a step (guided: "Say yes." ends at EOS)
    ("What is 13 * 7?", Settings(guide=True, max_new_tokens=48, draft_tokens=8), None),  # <call> inside a draft
    ("What does grok mean?", Settings(guide=True, max_new_tokens=48), None),  # a search, then <submit>
    ("What is 1,250 + 3,780?", Settings(guide=True, max_new_tokens=48, max_length=1300), None),  # session max_length
    ("Say yes.", Settings(guide=True, max_new_tokens=48), "You answer in one word.\n"),  # EOS
    ("Count to 300.", Settings(guide=True, max_new_tokens=20, max_turns=0), COUNTING),  # max_new_tokens
    ("Read me the manual for the radio.", Settings(guide=True, max_new_tokens=24, max_tool_response=4000),
     "To read a manual write <request><Manual>name<call>.\n\nQ: Read me the manual for the tv.\n"
     "<request><Manual>tv<call>"),  # a long tool output
]


def test_eight_rows_at_once_give_each_row_its_solo_episode(real):
    """Greedy rows that join at staggered steps, stop in every way and read long tool output, plus one that is
    cancelled mid-segment and one with a long history: each episode is token for token its solo run."""
    tools = {**default_tools(), "Manual": long_tool()}
    engine = Engine(real, tools=tools)
    history = engine.new_session()
    for question in ("What is 6 * 7?", "What is a luser?", "And 100 - 1?"):
        engine.ask(history, question, Settings(guide=True, max_new_tokens=48))
    rows = [(engine.new_session(prompt), q, s) for q, s, prompt in ROWS]
    rows.append((history, "What is 2 ** 10?", Settings(guide=True, max_new_tokens=48)))
    solo = []
    for session, question, settings in rows:
        twin = session.fork()
        solo.append(engine.ask(twin, question, settings))
    cancelled = engine.new_session(COUNTING)
    cancel = threading.Event()
    episodes: list = [None] * len(rows)

    def run(i):
        session, question, settings = rows[i]
        episodes[i] = engine.ask(session, question, settings)

    def run_cancelled():
        for event in engine.turn(cancelled, "Count to 300.",
                                 Settings(guide=True, max_new_tokens=200, max_turns=0), cancel=cancel):
            if isinstance(event, TextDelta) and engine.backend.scheduler.stats.steps > started + 12:
                cancel.set()

    scheduler = engine.backend.scheduler
    started = scheduler.stats.steps
    threads = [threading.Thread(target=run_cancelled)]
    threads[0].start()
    for i in range(len(rows)):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        wait_for_steps(scheduler, 2)
    for t in threads:
        t.join()
    assert scheduler.stats.peak_rows >= 4  # they really shared steps
    for got, want in zip(episodes, solo):
        assert got.token_ids == want.token_ids, got.question
        assert [s.stop for s in got.model_segments] == [s.stop for s in want.model_segments]
    stops = {s.stop.reason for e in episodes for s in e.model_segments}
    assert {StopReason.STRING_MATCH, StopReason.EOS, StopReason.MAX_LENGTH} <= stops
    assert any(s.kind == "tool" and s.end - s.start > 300 for s in episodes[5].segments)  # a long tool result
    assert cancelled.episodes[-1].segments[-1].stop.reason is StopReason.CANCELLED
    assert episodes[4].model_segments[-1].stop.limit is Limit.MAX_NEW_TOKENS
    for session in [cancelled] + [row[0] for row in rows]:  # each cache covers a prefix of its own ids
        assert session.cache.cached <= len(session.cache)


def test_a_batch_runs_its_rows_at_once_and_returns_them_in_order(tiny_llama):
    engine = Engine(tiny_llama)
    questions = [f"question number {i}" for i in range(8)]
    settings = Settings(max_new_tokens=12, max_turns=0)
    solo = [engine.ask(engine.new_session(seed=i), q, settings).token_ids for i, q in enumerate(questions)]
    before = engine.backend.scheduler.stats.steps
    episodes = engine.run(questions, settings)
    assert [e.token_ids for e in episodes] == solo
    assert [e.question for e in episodes] == questions
    assert engine.backend.scheduler.stats.steps - before < 8 * 12  # fewer steps than one row after another
    rows = [e.row for e in engine.stream_batch(questions[:3], settings) if isinstance(e, EpisodeFinished)]
    assert sorted(rows) == [0, 1, 2]


def test_a_batchs_rows_prefill_their_questions_in_one_step(tiny_llama, monkeypatch):
    """Regression: each batch row opened its own turn scope when its thread got going, so the first row's
    question went through a step alone (~150 ms on the real model) while the other seven were a few ms behind.
    The batch now opens its rows' scopes before any starts; a long gather wait makes the check independent of
    thread timing."""
    import app.backends.scheduler

    monkeypatch.setattr(app.backends.scheduler, "GATHER_S", 5.0)
    engine = Engine(tiny_llama)
    engine.ask(engine.new_session(), "warm up", Settings(max_new_tokens=2, max_turns=0))
    steps: list[int] = []
    scheduler = engine.backend.scheduler
    real = scheduler_module.ragged.ragged_forward
    monkeypatch.setattr(scheduler_module.ragged, "ragged_forward",
                        lambda model, rows: (steps.append(len(rows)), real(model, rows))[1])
    engine.run([f"question number {i}" for i in range(8)], Settings(max_new_tokens=4, max_turns=0))
    assert steps[0] == 8
    assert scheduler.rows_in_turns() == 0  # every row's scope was left


def test_a_rows_passes_run_in_the_schedulers_thread_and_a_failing_row_fails_alone(tiny_llama, monkeypatch):
    """submit(..., row): after each pass the scheduler updates the row from the pass's result in its own thread and
    runs the next pass in a later step without the row's thread; the greedy tokens are a solo run's. A row whose
    update raises ends its own request with that error (its stream raises it, its record says so, its pass's tokens
    are undone) while a row beside it goes on."""
    scheduler = Scheduler(tiny_llama.model)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = greedy_steps(lambda c: c.forward(tiny_llama.model), prompts[0], 6)[0]
    caches = [TokenCache(ids) for ids in prompts]
    settings = Settings(max_new_tokens=6, draft_tokens=0).validated(4096)
    threads, update = set(), Row.update

    def failing_update(row: Row, *args) -> RowStep:
        threads.add(threading.current_thread())
        if row.cache is caches[1] and len(caches[1]) > 5:
            raise RuntimeError("this row's work failed")
        return update(row, *args)

    monkeypatch.setattr(Row, "update", failing_update)
    rows = [Row(SegmentTokens(tiny_llama.tokenizer, tiny_llama.lock, StopChecker((), frozenset()), cache, settings,
                              SegmentRequest()), settings, None, torch.Generator(), None) for cache in caches]
    requests = [scheduler.submit(cache, row.begin(1).keep, row=row) for cache, row in zip(caches, rows)]
    "".join(requests[0].stream())
    with pytest.raises(RuntimeError, match="this row's work failed"):
        "".join(requests[1].stream())
    assert caches[0].ids[len(prompts[0]):] == want and threads == {scheduler.thread}
    assert rows[0].record.stop == Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_NEW_TOKENS)
    assert rows[1].record.stop.reason is StopReason.ERROR and len(caches[1]) == 6  # (3 tokens before the failure)
    caches[0].check()
    scheduler.release()


def test_the_schedulers_thread_is_released_at_the_process_exit(tiny_llama, monkeypatch):
    """Regression: 8 chats at once and then the process's exit aborted it in 3 of 10 runs (a C++ `terminate` in the
    threads' teardown) once rows' per-token work ran in the scheduler's thread. Its thread now ends at exit, before
    the interpreter's teardown (an atexit hook, by weak reference), after the work in flight. The hooks registered
    meanwhile are recorded (and not kept for this process's exit) and the scheduler's is run as the exit would."""
    import atexit
    import weakref

    hooks: list[tuple] = []
    monkeypatch.setattr(atexit, "register", lambda hook, *args: hooks.append((hook, args)) or hook)
    scheduler = Scheduler(tiny_llama.model)
    scheduler.forward(TokenCache([5, 6, 7]))
    thread = scheduler.thread
    scheduler.forward(TokenCache([8, 9]))
    assert thread.is_alive() and scheduler.thread is thread
    # registered once per scheduler, holding it by weak reference
    [(hook, args)] = [(h, a) for h, a in hooks if any(isinstance(x, weakref.ref) and x() is scheduler for x in a)]
    hook(*args)
    assert not thread.is_alive() and scheduler.thread is None
