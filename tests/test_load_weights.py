"""New weights for a running model (LocalBackend.load_weights, Scheduler.paused): what a trainer's rollouts use
after each of its steps."""

from __future__ import annotations

import copy

import pytest
import torch

from app.backends.local import LocalBackend
from app.engine.engine import Engine
from app.model.kvcache import TokenCache
from app.model.loading import wrap
from app.settings import Settings


def _copy(backend: LocalBackend) -> LocalBackend:
    """A float32 backend on a copy of `backend`'s model (its weights change here, the fixture's stay)."""
    model = copy.deepcopy(backend.model)
    return LocalBackend(wrap(model, backend.tokenizer, "tiny-llama-copy"))


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def test_the_next_pass_after_load_weights_computes_with_the_new_weights(tiny_llama):
    backend = _copy(tiny_llama)
    ids = [5, 6, 7, 8, 9]
    before = backend.scheduler.forward(TokenCache(ids))[0]
    state = _perturbed(backend.model.state_dict(), seed=1)
    backend.load_weights(state)
    after = backend.scheduler.forward(TokenCache(ids))[0]
    reference = copy.deepcopy(tiny_llama.model)
    reference.load_state_dict(state)
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0, -1:]
    assert not torch.allclose(before, after)
    assert torch.allclose(after, want, atol=1e-5)
    backend.scheduler.release()


def test_answers_follow_the_weights_loaded_between_two_turns(tiny_llama):
    """Greedy answers of one session's engine change with the weights, and come back with them."""
    backend = _copy(tiny_llama)
    engine, settings = Engine(backend), Settings(max_new_tokens=6, max_turns=0, guide=False)
    original = {k: v.clone() for k, v in backend.model.state_dict().items()}
    first = engine.ask(engine.new_session(use_cache=False), "What is 2 + 2?", settings).answer
    backend.load_weights(_perturbed(original, seed=2))
    other = engine.ask(engine.new_session(use_cache=False), "What is 2 + 2?", settings).answer
    backend.load_weights(original)
    again = engine.ask(engine.new_session(use_cache=False), "What is 2 + 2?", settings).answer
    assert first == again and other != first
    backend.scheduler.release()


def test_no_step_runs_while_the_scheduler_is_paused(tiny_llama):
    backend = _copy(tiny_llama)
    with backend.scheduler.paused():
        request = backend.scheduler.submit(TokenCache([5, 6, 7]))
        assert not request.done.wait(0.3)  # (the step waits for the weights to be in place)
    assert request.done.wait(60) and request.error is None
    backend.scheduler.release()


def test_a_state_that_does_not_fit_the_model_is_refused_and_leaves_it_as_it_was(tiny_llama):
    backend = _copy(tiny_llama)
    state = _perturbed(backend.model.state_dict(), seed=3)
    missing = {k: v for i, (k, v) in enumerate(state.items()) if i > 0}
    with pytest.raises(ValueError, match="1 missing"):
        backend.load_weights(missing)
    reshaped = dict(state, **{"lm_head.weight": state["lm_head.weight"][:-1]})
    with pytest.raises(ValueError, match="1 of another shape"):
        backend.load_weights(reshaped)
    assert all(torch.equal(v, tiny_llama.model.state_dict()[k]) for k, v in backend.model.state_dict().items())


def test_an_int8_model_refuses_float_weights(tiny_llama):
    model = copy.deepcopy(tiny_llama.model)
    backend = LocalBackend(wrap(model, tiny_llama.tokenizer, "tiny-llama-int8", weights="int8"))
    with pytest.raises(ValueError, match="WEIGHTS=float32"):
        backend.load_weights(tiny_llama.model.state_dict())
