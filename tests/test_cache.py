"""The KV cache: only new tokens are prefilled, and cached runs equal uncached ones token for token."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig

from app.engine.engine import Engine
from app.model.kvcache import GROW_TOKENS, CacheInvariantError, TokenCache, new_kv, room_for
from app.protocols.base import encode
from app.settings import Settings
from tests.conftest import forced, logit_tolerance, plan_text, prime

import pytest

PROMPT = "Answer with tools.\n{tools}\n\n"
CALL = "<request><Calculator>12*7<call>"


def two_turns(loaded, tokenizer, use_cache: bool):
    """Two chat turns, the first with a tool call, on real forward passes with a few forced tokens."""
    first = len(encode(tokenizer, CALL)) + 3
    plan = plan_text(tokenizer, (3, CALL), (first + 4, "<submit>"))  # free tokens between the forced ones
    engine = Engine(forced(loaded, plan), prompt=PROMPT)
    session = prime(engine)
    settings = Settings(use_cache=use_cache, max_new_tokens=20, guide=False)
    episodes = [engine.ask(session, q, settings) for q in ("What is 12 times 7?", "And then?")]
    return engine, session, episodes


def test_cached_and_uncached_give_identical_tokens_and_stops(tiny, tokenizer):
    _, cached_session, cached = two_turns(tiny, tokenizer, use_cache=True)
    _, plain_session, plain = two_turns(tiny, tokenizer, use_cache=False)
    assert cached_session.cache.ids == plain_session.cache.ids
    assert [s.kind for s in cached[0].segments] == ["model", "tool", "model"]
    assert [s.stop for s in cached[0].model_segments] == [s.stop for s in plain[0].model_segments]
    assert [e.answer for e in cached] == [e.answer for e in plain]


def test_logits_match_within_1e4(tiny, tokenizer):
    runs = []
    for use_cache in (True, False):
        engine, session, _ = two_turns(tiny, tokenizer, use_cache)
        runs.append((torch.stack(engine.backend.model.raw), engine.backend.model.fed, session.cache.ids))
    (cached_logits, cached_fed, ids), (plain_logits, plain_fed, ids2) = runs
    assert ids == ids2
    assert (cached_logits - plain_logits).abs().max().item() < 1e-4
    assert sum(cached_fed) < sum(plain_fed) / 2  # the cached run fed far fewer tokens


def test_resumed_segment_prefills_only_new_tokens(tiny, tokenizer):
    _, session, (first, second) = two_turns(tiny, tokenizer, use_cache=True)
    call, tool, answer = first.segments
    assert call.prefill_tokens == first.query_end - first.query_start  # just the question
    assert call.cached_tokens == first.query_start  # the whole prompt came from the shared cache
    # After a tool call: the tool output plus the one generated token the cache never holds.
    assert answer.prefill_tokens == (tool.end - tool.start) + 1
    assert answer.cached_tokens == call.end - 1
    # A new chat turn: its query plus the last token of the previous turn.
    assert second.segments[0].prefill_tokens == (second.query_end - second.query_start) + 1
    for episode in (first, second):
        for s in episode.model_segments:
            assert s.prefill_tokens + s.cached_tokens == s.start


def test_uncached_prefills_everything(tiny, tokenizer):
    _, session, (first, _) = two_turns(tiny, tokenizer, use_cache=False)
    for s in first.model_segments:
        assert (s.prefill_tokens, s.cached_tokens) == (s.start, 0)
    assert session.cache.nbytes == 0  # no keys/values held between segments


def test_shared_prompt_cache_is_never_mutated(tiny_llama, tokenizer):
    engine = Engine(tiny_llama, prompt=PROMPT)
    engine.new_session()
    base = engine.prompt_cache()
    ids = list(base.ids)
    snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in base.own_kv.layers]
    for question in ("one", "two"):
        engine.ask(engine.new_session(), question, Settings(max_new_tokens=5))
    assert base.ids == ids and base.cached == len(ids)
    for layer, (keys, values) in zip(base.own_kv.layers, snapshot):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_shared_prompt_caches_keep_the_most_recent_few(tiny_llama):
    """Visitors' custom prompts each get a shared prefilled cache; only the last PROMPT_CACHE_SIZE stay."""
    engine = Engine(tiny_llama, prompt=PROMPT)
    engine.new_session()
    per_prompt = engine.prompt_cache().nbytes
    for i in range(Engine.PROMPT_CACHE_SIZE + 2):
        engine.new_session(prompt=f"Custom prompt {i}.\n{{tools}}\n")
    assert len(engine.held_prompts) == Engine.PROMPT_CACHE_SIZE
    assert engine.prompt not in engine.held_prompts  # the least recently used went first
    assert 0 < engine.shared_kv_bytes < (Engine.PROMPT_CACHE_SIZE + 1) * per_prompt


def test_kv_bytes_are_tokens_times_bytes_per_token(tiny_llama):
    engine = Engine(tiny_llama, prompt=PROMPT)
    session = engine.new_session()
    engine.ask(session, "hello", Settings(max_new_tokens=7))
    assert session.cache.cached == len(session.cache) - 1
    own = session.cache.cached - session.cache.shared  # the prompt's positions are read in place, not held
    assert session.cache.shared == session.prompt_tokens
    exact = own * tiny_llama.kv_bytes_per_token  # the storage has room to grow in place
    assert exact <= session.cache.nbytes <= exact + GROW_TOKENS * tiny_llama.kv_bytes_per_token


def test_batch_equals_single(tiny, tokenizer):
    questions = ["What is 2+3?", "Define foo", "hello"]
    engine = Engine(tiny, prompt=PROMPT)
    settings = Settings(max_new_tokens=6)
    batch = engine.run(questions, settings, reward_fn=lambda row, ep: float(row))
    for row, question in enumerate(questions):
        single = engine.ask(engine.new_session(), question, settings)
        assert batch[row].token_ids == single.token_ids
        assert [s.stop for s in batch[row].segments] == [s.stop for s in single.segments]
        assert batch[row].reward == float(row)
        assert len(batch[row].mask) == len(batch[row].token_ids)
        assert sum(batch[row].mask) == sum(s.generated_tokens for s in batch[row].model_segments)


def test_switching_cache_off_and_on_mid_session_is_consistent(tiny_llama, tokenizer):
    engine = Engine(tiny_llama, prompt=PROMPT)
    a, b = engine.new_session(), engine.new_session()
    for i, use_cache in enumerate([True, False, True]):
        engine.ask(a, f"q{i}", Settings(max_new_tokens=4, use_cache=use_cache))
        engine.ask(b, f"q{i}", Settings(max_new_tokens=4))
    assert a.cache.ids == b.cache.ids


def test_invariant_check_catches_a_desynced_cache(tiny_llama):
    cache = TokenCache([5, 6, 7, 8])
    cache.forward(tiny_llama.model)
    cache.truncate(2)
    cache.extend([9, 10])
    cache.forward(tiny_llama.model)  # fine: cropped to the common prefix, then fed the rest
    cache.ids[0] = 99  # simulate a bug: ids changed under the cache (read-only by convention only)
    cache.extend([11])
    with pytest.raises(CacheInvariantError):
        cache.forward(tiny_llama.model)


def test_fully_cached_ids_give_up_one_position(tiny_llama):
    cache = TokenCache([5, 6, 7])
    cache.forward(tiny_llama.model)
    assert cache.cached == 3
    logits, fed, reused = cache.forward(tiny_llama.model)
    assert (fed, reused) == (1, 2) and logits.shape[-1] == tiny_llama.model.config.vocab_size


def test_real_model_episode_cached_equals_uncached(real):
    runs = []
    for use_cache in (True, False):
        engine = Engine(forced(real))
        session = prime(engine)
        episode = engine.ask(session, "What is 41 * 23?", Settings(use_cache=use_cache, max_new_tokens=24))
        runs.append((session.cache.ids, torch.stack(engine.backend.model.raw), episode))
    (ids, logits, cached), (ids2, logits2, plain) = runs
    assert ids == ids2
    assert (logits - logits2).abs().max().item() < logit_tolerance(real)
    assert cached.answer == plain.answer
    assert [s.kind for s in cached.segments] == ["model", "tool", "model"]  # it used the calculator
    assert cached.segments[1].text.startswith("943")
    assert cached.prefill_tokens < plain.prefill_tokens / 10


def test_compare_runs_both_ways_on_forks_and_leaves_the_session_alone(tiny):
    from app.engine.comparisons import compare

    engine = Engine(tiny, prompt=PROMPT)
    session = engine.new_session()
    engine.ask(session, "warm-up turn", Settings(max_new_tokens=3))
    before = list(session.cache.ids)
    result = compare(engine, session, "What is 12 times 7?", Settings(max_new_tokens=6))
    assert session.cache.ids == before and len(session.episodes) == 1
    assert result.identical and result.cached.answer == result.uncached.answer
    assert result.cached.prefill_tokens < result.uncached.prefill_tokens
    assert result.uncached.reused_tokens == 0


@pytest.mark.parametrize("kv", [True, False])
def test_compare_can_run_the_last_turn_again_from_where_it_was_asked(tiny, kv):
    """Regression (a visitor's pass): Compare of the chat's last question asked it again after its own answer, so
    its "cache on" answer differed from the chat's ("kluge" searched after "kludge"). A fork of the first turns
    holds the tokens and cache from before the next question, and running that question gives the chat's bits."""
    from app.engine.comparisons import compare

    engine = Engine(tiny, prompt=PROMPT)
    session = engine.new_session()
    engine.ask(session, "warm-up turn", Settings(max_new_tokens=3))
    last = engine.ask(session, "What is 12 times 7?", Settings(max_new_tokens=6))
    fork = session.fork(kv=kv, turns=1)
    assert fork.cache.ids == session.cache.ids[:last.query_start] and len(fork.episodes) == 1
    assert fork.cache.cached == (last.query_start if kv else 0)
    before = list(session.cache.ids)
    result = compare(engine, session, last.question, Settings(max_new_tokens=6), turns=1)
    assert result.cached.token_ids == result.uncached.token_ids == last.token_ids
    assert session.cache.ids == before and len(session.episodes) == 2


def test_an_evicted_session_copies_the_shared_prompt_and_prefills_only_its_own_tokens(tiny_llama):
    """Regression (load test, 20 chats in a 512 MB budget): a session whose cache the budget dropped recomputed
    the whole system prompt at its next turn, ~1,150 tokens on the default prompt, for every evicted session."""
    engine = Engine(tiny_llama, prompt=PROMPT)
    session = engine.new_session()
    engine.ask(session, "hello", Settings(max_new_tokens=5))
    twin = session.fork()
    session.cache.drop_kv()  # what the store does past its budget
    before = len(session.cache)
    episode = engine.ask(session, "again", Settings(max_new_tokens=5))
    assert episode.token_ids == engine.ask(twin, "again", Settings(max_new_tokens=5)).token_ids
    first = episode.segments[0]
    assert first.cached_tokens == session.prompt_tokens
    assert first.prefill_tokens == episode.query_end - session.prompt_tokens == before - session.prompt_tokens + (
        episode.query_end - episode.query_start)


def test_a_growing_layer_holds_a_count_and_reads_as_views_of_its_storage():
    """GrowingLayer keeps the positions held as a count (a pass grows 30 layers a row: no views made then);
    keys/values read as views of the storage, crops only change the count, and an assignment of another tensor
    (transformers' reorder or device moves) leaves a plain layer that grows into new storage again."""
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    kv = new_kv(config)
    layer, gen = kv.layers[0], torch.Generator().manual_seed(0)
    first = [torch.randn(1, 2, 5, 16, generator=gen) for _ in range(2)]
    layer.update(*first)
    keys, _, held = layer.reserve(first[0], first[1], 3)  # room for 3 more, written by the caller
    assert held == 5 and kv.get_seq_length() == 8 and keys.shape[-2] >= GROW_TOKENS
    assert layer.keys.data_ptr() == keys.data_ptr() and torch.equal(layer.values[..., :5, :], first[1])
    kv.crop(-2)
    assert layer.get_seq_length() == 6 and layer.keys.shape[-2] == 6 and torch.equal(layer.keys[..., :5, :], first[0])
    layer.keys, layer.values = layer.keys[..., :4, :], layer.values[..., :4, :]  # transformers' crop: a view
    assert layer.get_seq_length() == 4 and layer.room == room_for(8)  # (still in its storage)
    copied = copy.deepcopy(kv)
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # another tensor: a plain layer now
    assert layer.room == 0 and layer.get_seq_length() == 4 and torch.equal(layer.keys, first[0][..., :4, :])
    more = [torch.randn(1, 2, 2, 16, generator=gen) for _ in range(2)]
    layer.update(*more)
    assert layer.room == room_for(6) and torch.equal(layer.keys, torch.cat([first[0][..., :4, :], more[0]], dim=-2))
    assert copied.get_seq_length() == 4 and torch.equal(copied.layers[0].values, first[1][..., :4, :])


def test_sessions_read_the_prompt_in_place_and_hold_only_their_own_tokens(tiny_llama):
    """Regression (load test, 20 chats at once in a 512 MB budget): every session held its own copy of the
    system prompt's keys/values (~34 MB on the bundled model), so running chats alone went over the budget."""
    engine = Engine(tiny_llama, prompt=PROMPT)
    sessions = [engine.new_session() for _ in range(3)]
    base = engine.prompt_cache()
    assert all(s.cache.prefix is base.own_kv and s.cache.nbytes == 0 for s in sessions)
    engine.ask(sessions[0], "hello", Settings(max_new_tokens=4))
    held = sessions[0].cache.nbytes
    assert 0 < held <= GROW_TOKENS * tiny_llama.kv_bytes_per_token and sessions[0].cache.prefix is base.own_kv
    compare_run = sessions[0].fork()  # Compare's fork shares the prefix too, and copies the session's own part
    assert compare_run.cache.prefix is base.own_kv and compare_run.cache.nbytes == held


@pytest.mark.parametrize("draft_tokens", [0, 4])
def test_a_shared_prefix_gives_the_logits_and_tokens_of_a_copied_one(tiny_llama, draft_tokens):
    """Cascade attention (prefix and own keys in two parts) against one ordinary cache holding both."""
    engine = Engine(tiny_llama, prompt=PROMPT)
    shared = engine.new_session()
    copied = engine.new_session()
    copied.cache = engine.prompt_cache().fork()  # share=False: a deep copy
    assert shared.cache.prefix is not None and copied.cache.prefix is None
    settings = Settings(max_new_tokens=12, draft_tokens=draft_tokens)
    for question in ("What is 2+3?", "and then?"):
        a, b = engine.ask(shared, question, settings), engine.ask(copied, question, settings)
        assert a.token_ids == b.token_ids
    ids = shared.cache.ids + [5, 6, 7]
    one, two = TokenCache(ids), TokenCache(ids)
    one.reuse(engine.prompt_cache(), share=True)
    two.reuse(engine.prompt_cache(), share=False)
    scheduler = tiny_llama.scheduler
    got, want = scheduler.forward(one, keep=3)[0], scheduler.forward(two, keep=3)[0]
    assert torch.allclose(got, want, atol=logit_tolerance(tiny_llama))
    solo = TokenCache(ids)  # the model's own forward (not the ragged pass) joins the prefix into its cache first
    solo.reuse(engine.prompt_cache(), share=True)
    solo_logits, fed, reused = solo.forward(tiny_llama.model, keep=3)
    assert solo.prefix is None and reused == len(ids) - fed == len(engine.prompt_cache())
    assert torch.allclose(solo_logits, want, atol=logit_tolerance(tiny_llama)) and solo.cached == len(ids)


def test_a_rollback_into_the_prefix_drops_the_link_and_a_new_turn_relinks(tiny_llama):
    engine = Engine(tiny_llama, prompt=PROMPT)
    session = engine.new_session()
    engine.ask(session, "hello", Settings(max_new_tokens=3))
    session.cache.truncate(session.prompt_tokens - 1)  # cut into the shared positions
    assert session.cache.prefix is None and session.cache.cached == 0
    session.cache.extend(engine.prompt_cache().ids[-1:])
    episode = engine.ask(session, "again", Settings(max_new_tokens=3))
    assert session.cache.prefix is not None and episode.segments[0].cached_tokens == session.prompt_tokens
