"""Sampling (temperature, top_p, seed) and streaming text: what a user sees when not decoding greedily."""

from __future__ import annotations

import pytest
import torch

from app.decoding.sampling import greedy
from app.engine.engine import Engine
from app.episode import TextDelta
from app.settings import Settings
from tests.conftest import forced, plan_text, prime

PROMPT = "Answer.\n{tools}\n\n"
SAMPLED = Settings(max_new_tokens=20, max_turns=0, temperature=1.0)


def answer(engine: Engine, settings: Settings, seed: int = 0) -> list[int]:
    return engine.ask(engine.new_session(seed=seed), "Tell me something.", settings).token_ids


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(tiny_llama):
    engine = Engine(tiny_llama, tools={}, prompt=PROMPT)
    assert answer(engine, SAMPLED, seed=1) == answer(engine, SAMPLED, seed=1)
    assert answer(engine, SAMPLED, seed=1) != answer(engine, SAMPLED, seed=2)
    assert answer(engine, SAMPLED, seed=1) != answer(engine, Settings(max_new_tokens=20, max_turns=0))


def test_a_tiny_top_p_keeps_only_the_most_likely_token(tiny_llama):
    engine = Engine(tiny_llama, tools={}, prompt=PROMPT)
    greedy = answer(engine, Settings(max_new_tokens=20, max_turns=0))
    assert answer(engine, Settings(max_new_tokens=20, max_turns=0, temperature=1.5, top_p=1e-6), seed=3) == greedy


def test_a_fork_continues_the_same_random_stream(tiny_llama):
    engine = Engine(tiny_llama, tools={}, prompt=PROMPT)
    session = engine.new_session(seed=7)
    engine.ask(session, "first", SAMPLED)
    fork = session.fork()
    assert engine.ask(fork, "second", SAMPLED).token_ids == engine.ask(session, "second", SAMPLED).token_ids


def test_streamed_text_never_splits_a_character(tiny_llama, tokenizer):
    """Emoji and CJK take several byte-level tokens each: the stream holds bytes back until a character is
    whole, and the deltas add up to the segment's text."""
    text = "Result = 🎉 中文 ok 👍🏽<submit>"
    engine = Engine(forced(tiny_llama, plan_text(tokenizer, (0, text))), tools={}, prompt=PROMPT)
    session = prime(engine)
    deltas = [e.text for e in engine.turn(session, "go", Settings(max_new_tokens=40, guide=False))
              if isinstance(e, TextDelta)]
    segment = session.episodes[-1].segments[0]
    assert "".join(deltas) == segment.text == text
    assert not any("\ufffd" in d for d in deltas) and len(deltas) > 1


@pytest.mark.parametrize("case", ["ties", "masked", "nan", "bfloat16", "strided"])
def test_greedy_picks_what_torch_argmax_picks(case):
    """decoding.greedy (NumPy's argmax, ~20x faster on the vocabulary) against torch.argmax: the first of tied
    maxima, -inf masks, a NaN (both take it), another dtype, a view with strides."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(3))
    if case == "ties":
        logits[1, [7, 300, 40000]] = 50.0
    elif case == "masked":
        logits[1, :45000] = float("-inf")
    elif case == "nan":
        logits[1, 123] = float("nan")
    elif case == "bfloat16":
        logits = logits.bfloat16()
    row = logits[:, 5] if case == "strided" else logits[1]
    assert greedy(row) == int(torch.argmax(row))


def test_top_k_of_one_is_greedy(tiny_llama):
    engine = Engine(tiny_llama, tools={}, prompt=PROMPT)
    greedy_ids = answer(engine, Settings(max_new_tokens=20, max_turns=0))
    assert answer(engine, Settings(max_new_tokens=20, max_turns=0, temperature=2.0, top_k=1), seed=5) == greedy_ids


@pytest.mark.parametrize("top_k, allowed", [(2, {7, 3}), (3, {7, 3, 9}), (0, None)])
def test_top_k_samples_only_among_the_k_largest_logits(top_k, allowed):
    from app.decoding.sampling import next_token

    logits = torch.full((16,), -1.0)
    logits[[7, 3, 9]] = torch.tensor([3.0, 2.9, 2.8])
    generator = torch.Generator().manual_seed(0)
    picks = {next_token(logits, 5.0, 1.0, generator, top_k) for _ in range(400)}
    assert picks <= allowed if allowed else len(picks) > 3  # (top_k 0: a hot temperature reaches the rest too)
    assert allowed is None or picks == allowed


def test_a_negative_top_k_is_refused():
    from app.settings import InputError

    with pytest.raises(InputError, match="top_k"):
        Settings(top_k=-1).validated(2048)
